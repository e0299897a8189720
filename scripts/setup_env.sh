#!/usr/bin/env bash
# Create .venv (if missing) and install megalite for this CPU machine.
# setup.py and requirements.txt state ranges (a GPU machine keeps its own CUDA torch); here
# constraints.txt pins torch==2.13.0 (the local CPU wheel: anything looser pulls a multi-GB CUDA
# build) and every other dependency at the version the suite last passed with, so CI does not
# change under the project overnight. Use pip: uv and poetry do not see the local torch wheel.
#
#   ./scripts/setup_env.sh            .venv, pinned (what CI and the demo use)
#   ./scripts/setup_env.sh --latest   .venv-latest, the newest releases of everything but torch:
#                                     see what a new release breaks before CI does
#                                     (./scripts/test.sh --latest runs the suite in it)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
CONSTRAINTS=constraints.txt
UPGRADE=()
if [ "${1:-}" = "--latest" ]; then
  VENV=.venv-latest
  CONSTRAINTS="$(mktemp)"
  trap 'rm -f "$CONSTRAINTS"' EXIT
  # Only the machine's pins: every line above constraints.txt's 'reproducible' marker.
  sed '/^# ---- reproducible/,$d' constraints.txt > "$CONSTRAINTS"
  UPGRADE=(--upgrade --upgrade-strategy eager)
elif [ $# -gt 0 ]; then
  echo "setup_env: unknown argument '$1' (the only option is --latest)" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
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
pip_install "${UPGRADE[@]}" -r requirements-dev.txt
pip_install -e .
# Every package the tests rely on, references included: a missing one must stop here, not turn
# into skipped tests (under CI=true a skip that is not the machine's fails the run anyway).
"$VENV/bin/python" -c "import torch, triton, sentencepiece, safetensors, numpy, tqdm, pytest, transformers, tokenizers, huggingface_hub, kernels, matplotlib, tensorboard, wandb, megalite"
# The release archives some tests read as references (flash-attn's interface file, TE's wheels),
# pinned with their sha256 in tests/reference_archives.json, into the cache the tests read
# ($MEGALITE_TEST_REFERENCES, default ~/.cache/megalite/test-references): fetched here, never by
# a test. Once they are cached a run only checks their sums (no network).
if ! "$VENV/bin/python" tools/fetch_test_references.py; then
  echo "setup_env: fetching the test references failed (see above); the tests that read them skip" \
       "without them, and fail under CI=true. Fix the cause and run: python3 tools/fetch_test_references.py" >&2
  # The demo and training need none of them: only CI stops here.
  case "${CI:-}" in 1|true|TRUE|True|yes) exit 1 ;; esac
fi
# Run from the repository root: the check above and this line import the installed `kernels`,
# never the checkout's folder (tests/test_import_shadowing.py).
echo "megalite env ready ($VENV): $("$VENV/bin/python" -m tests.dependency_versions)"
