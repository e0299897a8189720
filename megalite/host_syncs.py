"""Counting host syncs on a CPU: the reads of tensor values that would stop a GPU.

On a GPU, reading a value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``,
``int(t)``, ``float(t)``, ``t`` as an index, ``.numpy()``, ``.to("cpu")``) waits for every
kernel queued before it. A CPU has nothing to wait for, so the reads are counted instead:
:func:`count_host_syncs` patches those ``torch.Tensor`` methods to record each call made
from megalite's own code (the caller's frame is in the ``megalite`` package; torch's and
Triton's internals are not counted, nor are a test's own reads). ``.to`` counts only a copy
to the CPU from another device (``t.to(x.device)`` on the CPU copies nothing).

Used by the tests (a train step makes none, the log line one) and ``tools/bench_host_syncs.py``.
It cannot see reads inside torch's C++ code (on a GPU, ``torch.cuda.set_sync_debug_mode``
does).
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep  # megalite/, its kernels included
READS = ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__")


def _from_megalite() -> bool:
    return sys._getframe(2).f_code.co_filename.startswith(_OURS)


@contextlib.contextmanager
def count_host_syncs():
    """Yields a list that collects the name of every host read made from megalite's code."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    real_to = torch.Tensor.to

    def wrap(name, fn):
        def counted(self, *a, **kw):
            if _from_megalite():
                calls.append(name)
            return fn(self, *a, **kw)
        return counted

    def to(self, *a, **kw):
        target = kw.get("device", a[0] if a else None)
        if (isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
                and self.device.type != "cpu" and _from_megalite()):
            calls.append("to(cpu)")
        return real_to(self, *a, **kw)

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    torch.Tensor.to = to
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.Tensor.to = real_to
