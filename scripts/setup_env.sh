#!/usr/bin/env bash
# Create .venv (if missing) and install megalite with its pinned requirements.
# torch is pinned to the 2.13.0 CPU build: a looser pin pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, triton, sentencepiece, safetensors, megalite; print('megalite env ready: torch', torch.__version__, '| triton', triton.__version__)"
