"""Bytes of every live tensor storage during a training iteration, by category, with the peak.

A :class:`MemoryTracker` is a ``TorchDispatchMode``: every operator's output passes through it,
and each new storage is counted (``nbytes``) until Python drops its last reference (a weak
reference's callback subtracts it). Storages have a stable Python object (PyTorch preserves
it while the C++ storage lives), so views, autograd's saved tensors and in-place ops all map
to one entry. It works on any device: on meta tensors (no memory at all) it measures what the
same iteration would allocate, which is how a laptop sizes a rank of a 1,000-GPU layout.

Categories: tensors that exist before the iteration are registered with theirs (parameters,
gradients, optimizer state); a new storage takes the category active where it was made,
``activations`` by default, ``communication`` inside the collectives of
:mod:`megalite.parallel.comm` and the pipeline exchange, ``gradients`` in the gradient buckets,
``parameters`` for ZeRO-3's gathered weights, ``optimizer state`` in the optimizer step
(see :func:`category`); the step's micro-batches on the device are registered as ``data``. Allocator caching, fragmentation and the CUDA context are not storages;
on a GPU compare with ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "communication", "data")
_current = ["activations"]  # the category of storages made now (a stack; module state, one thread)
_active: list["MemoryTracker"] = []


@contextlib.contextmanager
def category(name: str):
    """Storages allocated inside the block belong to ``name`` (no-op without a tracker)."""
    _current.append(name)
    try:
        yield
    finally:
        _current.pop()


def resized(storage) -> None:
    """A storage changed size in place (``untyped_storage().resize_``, ZeRO-3's gather and
    free): update its entry in every active tracker (resizes are not dispatched operators)."""
    for tracker in _active:
        tracker._resize(storage)


class MemoryTracker(TorchDispatchMode):
    """``with MemoryTracker() as m: ...``; then ``m.peak``, ``m.peak_by_category``, ``m.live``."""

    def __init__(self):
        super().__init__()
        self._entries: dict[int, tuple[int, str, weakref.ref]] = {}
        self.by_category: dict[str, int] = defaultdict(int)
        self.live = 0
        self.peak = 0
        self.peak_by_category: dict[str, int] = {}

    # -- accounting --------------------------------------------------------------------------------
    def _add(self, storage, name: str) -> None:
        key = id(storage)
        if key in self._entries:
            return
        size = storage.nbytes()
        ref = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        self._entries[key] = (size, name, ref)
        self.live += size
        self.by_category[name] += size
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_category = dict(self.by_category)

    def _free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.live -= entry[0]
            self.by_category[entry[1]] -= entry[0]

    def _resize(self, storage) -> None:
        key = id(storage)
        if key not in self._entries:
            self._add(storage, "parameters")
            return
        old, name, ref = self._entries[key]
        new = storage.nbytes()
        self._entries[key] = (new, name, ref)
        self.live += new - old
        self.by_category[name] += new - old
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_category = dict(self.by_category)

    def register(self, tensors, name: str) -> None:
        """Count tensors that already exist (weights, buffers, optimizer state) as ``name``."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), name)

    def reset_peak(self) -> None:
        self.peak, self.peak_by_category = self.live, dict(self.by_category)

    # -- the dispatch mode -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), _current[-1])
        return out

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def summary(self) -> dict:
        """Peak and its breakdown, and what is live now, in bytes."""
        return {"peak": self.peak, "peak_by_category": {k: v for k, v in self.peak_by_category.items() if v},
                "live": self.live, "live_by_category": {k: v for k, v in self.by_category.items() if v}}


def training_tracker(model, optimizer) -> MemoryTracker:
    """--track-memory: a tracker that knows the model's weights, gradient buckets and optimizer
    state; pretrain runs each iteration inside it."""
    tracker = MemoryTracker()
    tracker.register([p for chunk in model for p in chunk.parameters()], "parameters")
    if optimizer.sharded is not None:
        tracker.register(optimizer.sharded.shards, "parameters")
    tracker.register([b.grad if b.grad is not None else b.grad_shard for b in optimizer.sync.buckets], "gradients")
    state = [shard for shards in optimizer.state.values() for shard in shards]  # the update rule's
    tracker.register([*optimizer.master, *state, *optimizer._host_grad, *optimizer._host_weight], "optimizer state")
    return tracker
