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
"${PIP[@]}" -r requirements-dev.txt 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" -e . 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, triton, sentencepiece, safetensors, megalite; print('megalite env ready: torch', torch.__version__, '| triton', triton.__version__)"
