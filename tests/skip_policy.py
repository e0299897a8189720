"""Under CI (``CI=true``), a skipped test fails the run unless the machine cannot run it.

The tests that hold megalite against independent references (``transformers``, ``tokenizers``,
``matplotlib``, ``tensorboard``, ``wandb``) skip when the package is missing. On a developer's
machine that is a convenience; in CI it would turn a failed install into a green run that checks
less. So under CI every skip must give one of the ALLOWED reasons: no GPU (and what only runs on
one: the compiled kernels, flash-attn, transformer-engine, FP8), or a machine fact a test cannot
change (a writable /sys, no free port). Anything else, an ``importorskip`` of a reference above
all, is listed and the run exits 1. ``scripts/test.sh`` runs pytest with ``-rs``, so every skip
reason is printed either way.
"""
from __future__ import annotations

import os

ALLOWED = (
    "needs a CUDA GPU",                       # tests marked gpu (tests/conftest.py)
    "TRITON_INTERPRET=1",                     # compiled-kernel tests, on a GPU only
    "flash-attn is not installed",            # a CUDA-only build
    "transformer-engine is not installed",    # needs CUDA and cuDNN
    "this GPU has no FP8",
    "this machine has a GPU",                 # CPU-only checks, on a GPU machine
    "checks the message on a machine without a GPU",
    "no read-only filesystem",                # /sys writable in this container
    "no free port",
)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_reason(report) -> str:
    """The reason of a skipped test report (``Skipped: `` removed)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def disallowed(skips: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (test id, reason) pairs whose reason is none of ALLOWED."""
    return [(node, reason) for node, reason in skips if not any(a in reason for a in ALLOWED)]
