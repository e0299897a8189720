#!/usr/bin/env bash
# Create .venv (if missing) and install megalite for this CPU machine.
# setup.py and requirements.txt state ranges (a GPU machine keeps its own CUDA torch); here
# constraints.txt pins torch==2.13.0 (the local CPU wheel: anything looser pulls a multi-GB CUDA
# build) and triton==3.9.0. Use pip: uv and poetry do not see the local torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt)
pip_install() {  # pip's output without the local-mirror warnings; a failed install stops here, loudly
  local log rc=0
  log="$(mktemp)"
  "${PIP[@]}" "$@" > "$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$log" || true
  rm -f "$log"
  if [ "$rc" -ne 0 ]; then
    echo "setup_env: 'pip install $*' failed (exit $rc): the tests need every package it names (the" \
         "references they compare megalite with among them). Fix: see pip's output above." >&2
    exit "$rc"
  fi
}
pip_install -r requirements-dev.txt
pip_install -e .
# Every package the tests rely on, references included: a missing one must stop here, not turn
# into skipped tests (under CI=true a skip that is not the machine's fails the run anyway).
.venv/bin/python -c "import torch, triton, sentencepiece, safetensors, numpy, tqdm, pytest, transformers, tokenizers, matplotlib, tensorboard, wandb, megalite; print('megalite env ready: torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
