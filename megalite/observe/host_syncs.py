"""Counting host syncs on a CPU: the reads of tensor values that would stop a GPU.

On a GPU, reading a value on the host waits for every kernel queued before it. A CPU has
nothing to wait for, so :func:`count_host_syncs` counts the reads instead, in two layers:

* **Python-level reads**, by patching ``torch.Tensor``: ``item``, ``tolist``, ``numpy``,
  ``cpu``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``__format__`` (an
  f-string's ``f"{t:.3f}"``: torch's ``Tensor.__format__`` calls ``item`` from its own
  Python) and ``to(cpu)`` from another device. ``tolist``, ``numpy`` and ``cpu`` on a CPU
  tensor dispatch no operator at all, so only a patch sees them; the patch also gives each
  read its own name.
* **Operator-level syncs**, by a ``TorchDispatchMode`` (:class:`_SyncingOps`) that records
  the aten operators whose CUDA implementation waits for the device (:data:`SYNCING_OPS`:
  ``_local_scalar_dense``, which every scalar read reaches, ``nonzero``, ``equal``,
  ``allclose``, ``masked_select``, the ``unique`` family, ``repeat_interleave`` without
  ``output_size``, ``bincount``, ...; indexing or ``index_put_`` with a boolean mask; a blocking copy
  between the host and another device). These are the C-level syncs that no Python patch
  reaches (``torch.equal``, ``torch.nonzero``, ``t[mask]``, ``torch.is_nonzero``,
  ``torch.allclose``...). A dispatch mode sits below autograd, so gradients, the Triton
  interpreter's kernels and the gloo collectives run through it unchanged; it costs one
  Python call per operator while counting. A read already named by a patch (``t.item()``
  reaching ``_local_scalar_dense``) is counted once, under the patch's name.

Each read is attributed to the innermost Python frame outside torch, the standard library
and this module, and counted when that frame's file is megalite's: under the ``megalite``
package or ``megalite.kernels`` (the repository's top-level ``kernels/`` folder in a source
checkout). So a read torch makes on megalite's behalf (formatting, ``__contains__``,
``backward()``'s C++ formulas) counts where megalite asked for it, while a test's own reads
and the Triton interpreter's internal copies (frames in ``triton``) do not. The recorded
entries are :class:`HostRead` strings (``"tolist"``, ``"nonzero"``...) that also carry the
file and line.

Used by the tests (a train step makes none, the log line one) and ``tools/bench_host_syncs.py``.
What it still cannot see on a CPU: syncs inside a CUDA kernel's C++ implementation of an
operator not listed in :data:`SYNCING_OPS` (the list follows torch's CUDA code, it is not
derived from it), reads on threads other than the one that entered the counter (the
dispatch mode is thread-local; the patches are not), stream or event waits
(``torch.cuda.synchronize``, ``Event.synchronize``), and any difference between the code
paths a GPU and a CPU take (a branch on ``t.device.type == "cuda"``). On a GPU,
``torch.cuda.set_sync_debug_mode("error")`` sees what the device itself waits for.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

PATCHED_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__", "__format__")
SYNCING_OPS = {  # aten operator -> the name it is recorded under
    aten._local_scalar_dense.default: "_local_scalar_dense",  # item, bool, int, float, index reach it
    aten.equal.default: "equal",
    aten.allclose.default: "allclose",
    aten.nonzero.default: "nonzero",
    aten.nonzero.out: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.unique_dim_consecutive.default: "unique_consecutive",
    aten.bincount.default: "bincount",  # its CUDA kernel reads the maximum to size the output
    aten._linalg_check_errors.default: "linalg error check",
}
_OUTPUT_SIZE_OPS = (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)  # sync without output_size
_MASK_INDEX_OPS = {aten.index.Tensor: "index (bool mask)", aten.index_put.default: "index_put (bool mask)",
                   aten.index_put_.default: "index_put (bool mask)",
                   aten._index_put_impl_.default: "index_put (bool mask)"}  # sync with a bool or uint8 index
_COPY_OPS = (aten._to_copy.default, aten.copy_.default)  # sync between the host and another device


class HostRead(str):
    """One counted read: equal to its name (``"tolist"``), and knows where megalite made it."""

    def __new__(cls, name: str, file: str, line: int):
        read = super().__new__(cls, name)
        read.file, read.line = file, line
        return read

    def __reduce__(self):  # a worker process returns its reads to the test
        return HostRead, (str(self), self.file, self.line)

    def __repr__(self) -> str:
        return f"{str.__repr__(self)}@{os.path.basename(self.file)}:{self.line}"


def _roots() -> tuple[str, ...]:
    """The folders whose code counts as megalite's: the package and its kernels."""
    import megalite
    import megalite.kernels

    folders = list(megalite.__path__) + list(megalite.kernels.__path__)
    return tuple(os.path.abspath(f) + os.sep for f in folders)


def _is_python_library(path: str) -> bool:
    return "site-packages" not in path and "dist-packages" not in path and path.startswith(_STDLIB)


_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_HERE = os.path.abspath(__file__)
_passed_through: dict[str, bool] = {}  # filename -> whether the walk goes past its frames


def _reader() -> tuple[str, int]:
    """(file, line) of the innermost frame outside torch, the standard library and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        through = _passed_through.get(name)
        if through is None:
            path = os.path.abspath(name)
            through = _passed_through[name] = (path == _HERE or path.startswith(_TORCH) or _is_python_library(path)
                                               or name.startswith("<frozen"))
        if not through:
            return os.path.abspath(name), frame.f_lineno
        frame = frame.f_back
    return "", 0


class _Counter:
    """The reads of one ``count_host_syncs`` block; ``inside`` (per thread) marks a patched read
    in progress, so the operators it dispatches are not counted a second time."""

    def __init__(self):
        self.calls: list[HostRead] = []
        self.roots = _roots()
        self._depth = threading.local()

    def record(self, name: str) -> None:
        if self.inside():
            return
        file, line = _reader()
        if file.startswith(self.roots):
            self.calls.append(HostRead(name, file, line))

    def inside(self) -> bool:
        return getattr(self._depth, "n", 0) > 0

    @contextlib.contextmanager
    def reading(self, name: str | None):
        """A patched read (recorded as ``name``; None: a read the GPU does not make) in progress."""
        if name is not None:
            self.record(name)
        self._depth.n = getattr(self._depth, "n", 0) + 1
        try:
            yield
        finally:
            self._depth.n -= 1


def _host_device_copy(func, args, kwargs) -> str | None:
    """"copy to cpu" / "copy from cpu" for a blocking copy between the host and another device
    (``_to_copy`` or ``copy_``; a ``non_blocking`` one waits for nothing), else None."""
    if kwargs.get("non_blocking") or (func is aten.copy_.default and len(args) > 2 and args[2]):
        return None
    if func is aten._to_copy.default:
        if kwargs.get("device") is None:
            return None
        src, dst = args[0].device.type, torch.device(kwargs["device"]).type
    else:
        if not isinstance(args[1], torch.Tensor):
            return None
        src, dst = args[1].device.type, args[0].device.type
    if (src == "cpu") == (dst == "cpu"):
        return None
    return "copy to cpu" if dst == "cpu" else "copy from cpu"


def _syncing_op(func, args, kwargs) -> str | None:
    """The name a synchronizing operator call is recorded under, or None."""
    name = SYNCING_OPS.get(func)
    if name is not None:
        return name
    if func in _OUTPUT_SIZE_OPS:
        return "repeat_interleave" if kwargs.get("output_size") is None else None
    if func in _MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masked = any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
        return _MASK_INDEX_OPS[func] if masked else None
    if func in _COPY_OPS:
        return _host_device_copy(func, args, kwargs)
    return None


class _SyncingOps(TorchDispatchMode):
    """Records every operator in :data:`SYNCING_OPS` (and the conditional ones) that runs."""

    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _syncing_op(func, args, kwargs)
        if name is not None:
            self.counter.record(name)
        return func(*args, **kwargs)


def _patched(counter: _Counter, name: str, fn):
    def counted(self, *a, **kw):
        with counter.reading(name):
            return fn(self, *a, **kw)
    return counted


def _patched_to(counter: _Counter, real_to):
    def to(self, *a, **kw):
        target = kw.get("device", a[0] if a else None)
        if isinstance(target, torch.Tensor):
            target = target.device
        if (isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
                and self.device.type != "cpu" and not kw.get("non_blocking")):
            with counter.reading("to(cpu)"):
                return real_to(self, *a, **kw)
        return real_to(self, *a, **kw)
    return to


def _one_hot_checks_on_cpu_only(counter: _Counter, one_hot):
    """``F.one_hot(t, num_classes)`` reads ``t.min()`` and ``t.max()`` on the CPU to check the
    class values; on CUDA it leaves the check to a device assert and reads nothing (torch's
    ``Onehot.cpp``), so those two reads are not counted. Without ``num_classes`` it reads the
    maximum on every device (and the minimum on the CPU only): one read."""
    def counted(tensor, num_classes=-1):
        with counter.reading("one_hot (reads the maximum)" if num_classes == -1 else None):
            return one_hot(tensor, num_classes)
    return counted


@contextlib.contextmanager
def count_host_syncs():
    """Yields a list that collects a :class:`HostRead` for every host read made from megalite's code."""
    counter = _Counter()
    saved = {name: getattr(torch.Tensor, name) for name in PATCHED_READS}
    real_to = torch.Tensor.to
    for name, fn in saved.items():
        setattr(torch.Tensor, name, _patched(counter, name, fn))
    torch.Tensor.to = _patched_to(counter, real_to)
    real_one_hot = torch.nn.functional.one_hot
    torch.nn.functional.one_hot = _one_hot_checks_on_cpu_only(counter, real_one_hot)
    try:
        with _SyncingOps(counter):
            yield counter.calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.Tensor.to = real_to
        torch.nn.functional.one_hot = real_one_hot
