"""Under CI (``CI=true``), a skip fails the run unless the machine cannot run what was skipped.

The tests that hold megalite against independent references (``transformers``, ``tokenizers``,
``matplotlib``, ``tensorboard``, ``wandb``) skip when the package is missing. On a developer's
machine that is a convenience; in CI it would turn a failed install into a green run that checks
less. So under CI every skip must give, word for word, one of the ALLOWED reasons: no GPU (and
what only runs on one: the compiled kernels, flash-attn, transformer-engine, FP8), or a machine
fact a test cannot change (a writable /sys, no free port). Anything else, an ``importorskip`` of a
reference above all, is listed and the run exits 1.

Two kinds of skip are seen, both by the hooks below (tests/conftest.py imports them, which is
what makes pytest call them):
- a test's skip (``pytest.skip`` in its body, a ``skip``/``skipif`` mark): ``pytest_runtest_logreport``;
- a whole module's skip at collection (a module-level ``pytest.importorskip`` or
  ``pytest.skip(..., allow_module_level=True)``): ``pytest_collectreport``. Such a module has no
  test reports at all, so the first hook alone would let it vanish from a CI run unnoticed.

Reasons are matched with ``re.fullmatch``: a reason that merely *mentions* an allowed one (``...
TRITON_INTERPRET=1 ...``) is refused. ``scripts/test.sh`` runs pytest with ``-rs``, so every skip
reason is printed either way.
"""
from __future__ import annotations

import os
import re

import pytest


def _exact(reason: str) -> str:
    return re.escape(reason)


ALLOWED = (  # patterns, each matched against the whole reason (re.fullmatch)
    # tests marked gpu (tests/conftest.py)
    _exact("needs a CUDA GPU (torch.cuda.is_available() is False)"),
    # the compiled kernels' cases under the interpreter, the interpreter's cases on a GPU run
    # (tests/device_twins.py's kernel_device)
    _exact("TRITON_INTERPRET=1 was set when megalite.kernels was imported: the kernels run in the CPU "
           "interpreter. Run with TRITON_INTERPRET=0 (scripts/gpu_check.sh does)."),
    _exact("the CPU case runs the Triton kernels in the interpreter: TRITON_INTERPRET=1 (conftest.py's default)"),
    # megalite.layers.backends.triton_missing("cpu") on a GPU run with the kernels compiled
    _exact("there is no CUDA GPU, and Triton runs on a CPU only in its interpreter: set TRITON_INTERPRET=1 in "
           "the environment before starting (slow; meant for tests)"),
    _exact("megalite.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels were compiled for "
           "a GPU; set the variable before anything imports them"),
    # flash-attn and transformer-engine build only with CUDA (megalite.layers.backends.te_missing)
    _exact("flash-attn is not installed (it builds only on a CUDA machine)"),
    _exact("transformer-engine is not installed; it needs a CUDA GPU with cuDNN: pip install megalite[te]"),
    _exact("transformer-engine runs only on a CUDA GPU and there is none here"),
    _exact("this GPU has no FP8"),
    # CPU-only checks, on a GPU machine
    _exact("this machine has a GPU (or nvidia-smi): the script would run the whole check"),
    _exact("checks the message on a machine without a GPU"),
    # machine facts a test cannot change
    _exact("/sys is writable here: no read-only filesystem to test with"),
    _exact("no free port in 20000-39999"),
)
_ALLOWED = tuple(re.compile(pattern) for pattern in ALLOWED)

WHOLE_MODULE = "(whole module, at collection)"
_SKIPS: list[tuple[str, str]] = []  # (test id, reason) of every skip this session


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_reason(report) -> str:
    """The reason of a skipped test or collection report (``Skipped: `` removed)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def allowed(reason: str) -> bool:
    return any(pattern.fullmatch(reason) for pattern in _ALLOWED)


def disallowed(skips: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (test id, reason) pairs whose reason is none of ALLOWED."""
    return [(node, reason) for node, reason in skips if not allowed(reason)]


def pytest_collectreport(report):
    """A module (or class) skipped whole at collection: recorded as one entry, named as such."""
    if report.skipped:
        _SKIPS.append((f"{report.nodeid} {WHOLE_MODULE}", skip_reason(report)))


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, skip_reason(report)))


def pytest_sessionfinish(session, exitstatus):
    """Under CI, a skip other than the machine's (no GPU, ...) fails the run."""
    bad = disallowed(_SKIPS) if in_ci() else []
    if not bad:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"CI=true: {len(bad)} test(s) or module(s) skipped for a reason that is not the machine's (a "
             f"reference package missing?); install what they need (scripts/setup_env.sh), or, for a reason "
             f"that is the machine's, add it to ALLOWED in tests/skip_policy.py:"]
    lines += [f"  {node}: {reason}" for node, reason in bad]
    for line in lines:
        reporter.write_line(line) if reporter else print(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
