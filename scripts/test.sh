#!/usr/bin/env bash
# Set up the environment and run the whole test suite on CPU.
# Triton kernels run in the interpreter; each worker process uses one thread.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q -rs tests "$@"  # -rs: every skip and its reason
