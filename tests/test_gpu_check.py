"""scripts/gpu_check.sh on a machine without a GPU: it says so, runs nothing, and exits 0."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
                    reason="this machine has a GPU (or nvidia-smi): the script would run the whole check")
def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out))
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gpu_check:" in run.stdout and "no GPU on this machine" in run.stdout and "nothing to run" in run.stdout
    assert "(a)" not in run.stdout and not out.exists()  # nothing ran, no results folder
