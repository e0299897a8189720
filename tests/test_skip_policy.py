"""CI fails when a reference package is missing: a skip that is not the machine's fails the run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skip_policy import disallowed

REPO = Path(__file__).resolve().parent.parent


def test_only_the_machines_reasons_are_allowed():
    skips = [("a", "needs a CUDA GPU (torch.cuda.is_available() is False)"),
             ("b", "could not import 'transformers': No module named 'transformers'"),
             ("c", "flash-attn is not installed (it builds only on a CUDA machine)")]
    assert disallowed(skips) == [skips[1]]


def _run(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "tests" / "skip_policy.py").write_text((REPO / "tests" / "skip_policy.py").read_text())
    (tmp_path / "tests" / "test_refs.py").write_text(
        "import pytest\n"
        "def test_reference():\n    pytest.importorskip('no_such_reference_package')\n"
        "def test_gpu():\n    pytest.skip('needs a CUDA GPU (torch.cuda.is_available() is False)')\n"
        "def test_ok():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two pytest processes (8 s): the policy is CI's, and CI runs the slow tier
def test_a_missing_reference_fails_the_run_under_ci(tmp_path):
    local = _run(tmp_path, None)
    assert local.returncode == 0, local.stdout + local.stderr  # a developer's machine: a skip
    ci = _run(tmp_path, "true")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "test_refs.py::test_reference: could not import 'no_such_reference_package'" in ci.stdout
    assert "test_gpu" not in ci.stdout.split("CI=true:")[1]  # no GPU is the machine's reason
