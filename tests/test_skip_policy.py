"""CI fails when a reference package is missing: a skip that is not the machine's fails the run,
a whole module's skip at collection included, and only a reason that *is* an allowed one (not one
that mentions it) passes. The policy is run for real: pytest in subprocesses over generated test
trees, with and without ``CI=true``."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import skip_policy
from tests.skip_policy import ALLOWED, allowed, disallowed

REPO = Path(__file__).resolve().parent.parent
MISSING = "could not import 'no_such_reference_package': No module named 'no_such_reference_package'"
GPU = "needs a CUDA GPU (torch.cuda.is_available() is False)"
# a reason that contains an allowed phrase (TRITON_INTERPRET=1) without being an allowed reason
MENTIONS = "the Triton kernels take no documents here (not landed, or no TRITON_INTERPRET=1)"


def test_only_the_machines_reasons_are_allowed():
    skips = [("a", GPU), ("b", MISSING), ("c", "flash-attn is not installed (it builds only on a CUDA machine)"),
             ("d", MENTIONS)]
    assert disallowed(skips) == [skips[1], skips[3]]


def _string_constants() -> set[str]:
    """Every string literal in megalite/ and tests/ (adjacent literals joined, as Python does),
    but for the policy's own files, which hold the patterns' sources."""
    found = set()
    own = {REPO / "tests" / "skip_policy.py", Path(__file__).resolve()}
    for path in [*REPO.glob("megalite/**/*.py"), *REPO.glob("tests/*.py")]:
        if path in own:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_each_allowed_pattern_is_a_whole_reason_the_suite_gives():
    """Each pattern matches, whole, a reason written in the suite or in megalite (no pattern is a
    fragment or a dead entry), and that reason with anything before or after it is refused."""
    constants = _string_constants()
    for pattern in ALLOWED:
        reasons = [text for text in constants if re.fullmatch(pattern, text)]
        assert reasons, f"no reason in megalite/ or tests/ is {pattern!r}"
        for reason in reasons:
            assert allowed(reason)
            assert not allowed(f"{reason}; and more") and not allowed(f"cannot import x: {reason}"), reason


def test_conftest_calls_the_policy_hooks():
    """pytest calls a hook found on a conftest module: tests/conftest.py must expose the policy's."""
    from tests import conftest

    for hook in ("pytest_collectreport", "pytest_runtest_logreport", "pytest_sessionfinish"):
        assert getattr(conftest, hook, None) is getattr(skip_policy, hook), hook


def _tree(root: Path, conftest: str, helpers: tuple[str, ...]) -> Path:
    """A test tree under ``root``: a module skipped whole for a missing reference, one skipped
    whole for no GPU, and tests skipping for a missing reference, no GPU, a reason that mentions
    an allowed one, or not at all."""
    tests = root / "tests"
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text(conftest)
    for helper in helpers:
        (tests / helper).write_text((REPO / "tests" / helper).read_text())
    (tests / "test_reference_module.py").write_text(
        "import pytest\nreference = pytest.importorskip('no_such_reference_package')\n"
        "def test_uses_it():\n    pass\n")
    (tests / "test_gpu_module.py").write_text(
        f"import pytest\npytest.skip({GPU!r}, allow_module_level=True)\ndef test_on_gpu():\n    pass\n")
    (tests / "test_refs.py").write_text(
        "import pytest\n"
        "def test_reference():\n    pytest.importorskip('no_such_reference_package')\n"
        f"def test_gpu():\n    pytest.skip({GPU!r})\n"
        f"def test_mentions():\n    pytest.skip({MENTIONS!r})\n"
        "def test_ok():\n    pass\n")
    return root


def _start(root: Path, ci: str | None, *selection: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                             *(selection or ("tests",))],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _listed(out: str) -> list[str]:
    """The entries of the CI failure list, in order."""
    if "CI=true:" not in out:
        return []
    return [line.strip() for line in out.split("CI=true:", 1)[1].splitlines()[1:] if line.startswith("  ")]


def test_a_module_skipped_whole_fails_the_run_under_ci(tmp_path):
    """Three pytest processes side by side over a tree whose conftest holds only the policy's hooks
    (no torch to import, so this stays fast): without CI the skips are skips (exit 0); with
    CI=true the module skipped at collection, the test skipped for the missing reference and the
    one whose reason only mentions an allowed phrase are listed, nothing else, and the run fails;
    with CI=true over the allowed skips alone (a module and a test without a GPU) it passes."""
    root = _tree(tmp_path, "from tests.skip_policy import (pytest_collectreport, pytest_runtest_logreport,\n"
                           "                               pytest_sessionfinish)\n", ("skip_policy.py",))
    allowed_only = ("tests/test_gpu_module.py", "tests/test_refs.py::test_gpu", "tests/test_refs.py::test_ok")
    runs = [_start(root, None), _start(root, "true"), _start(root, "true", *allowed_only)]
    (local, local_err), (ci, ci_err), (ok, ok_err) = [p.communicate(timeout=120) for p in runs]
    assert runs[0].returncode == 0 and not _listed(local), local + local_err
    assert runs[1].returncode == 1, ci + ci_err
    assert _listed(ci) == [f"tests/test_reference_module.py {skip_policy.WHOLE_MODULE}: {MISSING}",
                           f"tests/test_refs.py::test_reference: {MISSING}",
                           f"tests/test_refs.py::test_mentions: {MENTIONS}"], ci
    assert runs[2].returncode == 0 and not _listed(ok), ok + ok_err
    assert "2 passed" not in ok and "1 passed, 2 skipped" in ok, ok  # the allowed ones did skip


@pytest.mark.slow  # the real conftest imports torch in each process: the policy is CI's, and CI runs the slow tier
def test_the_real_conftest_fails_a_run_with_a_missing_reference_under_ci(tmp_path):
    """The same tree under the repository's own conftest.py (copied verbatim, with what it imports)."""
    helpers = ("skip_policy.py", "process_state.py", "dependency_versions.py")
    conftest = (REPO / "tests" / "conftest.py").read_text()
    runs = [_start(_tree(tmp_path / "local", conftest, helpers), None),
            _start(_tree(tmp_path / "ci", conftest, helpers), "true")]  # side by side
    (local, local_err), (ci, ci_err) = [p.communicate(timeout=120) for p in runs]
    assert runs[0].returncode == 0, local + local_err  # a developer's machine: a skip
    assert runs[1].returncode == 1, ci + ci_err
    assert _listed(ci) == [f"tests/test_reference_module.py {skip_policy.WHOLE_MODULE}: {MISSING}",
                           f"tests/test_refs.py::test_reference: {MISSING}",
                           f"tests/test_refs.py::test_mentions: {MENTIONS}"], ci
