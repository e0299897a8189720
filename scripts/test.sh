#!/usr/bin/env bash
# Set up the environment and run the whole test suite on CPU.
# Triton kernels run in the interpreter; each worker process uses one thread.
set -euo pipefail
cd "$(dirname "$0")/.."
# ./scripts/test.sh [--latest] [pytest arguments]: --latest runs in .venv-latest, with the newest
# releases of every dependency but torch (scripts/setup_env.sh --latest), instead of the pins.
VENV=.venv
if [ "${1:-}" = "--latest" ]; then
  shift
  VENV=.venv-latest
  ./scripts/setup_env.sh --latest
else
  ./scripts/setup_env.sh
fi
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
exec "$VENV/bin/python" -m pytest -q -rs tests "$@"  # -rs: every skip and its reason
