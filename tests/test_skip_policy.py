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


def _start(tmp_path, ci: str | None) -> subprocess.Popen:
    """A pytest process over a copy of the skip policy and three tests, CI set or not."""
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    for helper in ("skip_policy.py", "process_state.py", "dependency_versions.py"):  # what conftest imports
        (tmp_path / "tests" / helper).write_text((REPO / "tests" / helper).read_text())
    (tmp_path / "tests" / "test_refs.py").write_text(
        "import pytest\n"
        "def test_reference():\n    pytest.importorskip('no_such_reference_package')\n"
        "def test_gpu():\n    pytest.skip('needs a CUDA GPU (torch.cuda.is_available() is False)')\n"
        "def test_ok():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # two pytest processes: the policy is CI's, and CI runs the slow tier
def test_a_missing_reference_fails_the_run_under_ci(tmp_path):
    (tmp_path / "local").mkdir()
    (tmp_path / "ci").mkdir()
    runs = [_start(tmp_path / "local", None), _start(tmp_path / "ci", "true")]  # side by side
    (local_out, local_err), (ci_out, ci_err) = [p.communicate(timeout=120) for p in runs]
    assert runs[0].returncode == 0, local_out + local_err  # a developer's machine: a skip
    assert runs[1].returncode == 1, ci_out + ci_err
    assert "test_refs.py::test_reference: could not import 'no_such_reference_package'" in ci_out
    assert "test_gpu" not in ci_out.split("CI=true:")[1]  # no GPU is the machine's reason
