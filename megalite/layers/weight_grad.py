"""The B/W split: input gradients now, weight gradients later.

A linear ``y = x W^T + b`` has two gradients in backward::

    B:  dx = dy W            (the previous layer, and the previous pipeline stage, wait for it)
    W:  dW = dy^T x          (only the optimizer step waits for it)

The zero-bubble schedules run B when the gradient arrives and W later, in a slot the
pipeline would otherwise leave idle. While a schedule is active (:func:`split_weight_gradients`),
megalite's linears, embeddings and experts build the autograd nodes of this module: their
backward computes dx (and the cheap bias gradient, a sum over dy) at once and hands
``(weight, fn)`` to the :class:`WeightGradStore`, ``fn()`` computing dW from the kept ``x``
and ``dy``. :meth:`WeightGradStore.run` later computes the dW's of one (micro-batch, chunk)
and feeds each to ``torch.autograd.backward``: the engine carries it through what stands
between the tensor the layer used and the parameter (an ``unbind`` of stacked expert
weights) into the parameter's AccumulateGrad, so ``.grad`` accumulates and the
post-accumulate hooks of DDP and ZeRO fire exactly as in a fused backward, once per
parameter per micro-batch.

What stays in B: norm weights and biases (O(s h) work, under 1% of a layer's W) and the
router of a mixture of experts (h x E). Under sequence parallelism the linear keeps only its
sequence shard of x; W all-gathers x over TP again (the same all-gather the fused backward
runs, moved from B to W), so the stored W inputs stay 1/TP of the gathered input.
Recomputation runs in B (the recomputed x is what W keeps).

Outside a schedule nothing changes: the layers call ``F.linear`` / ``F.embedding``. A node
built under the split whose backward runs with no open (micro-batch, chunk) computes dW at
once, so the same model also trains under a plain ``loss.backward()``.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.nn.functional as F

from megalite.parallel import comm
from megalite.parallel.comm import group_size


class WeightGradStore:
    """Deferred weight gradients, grouped by the key of the B that produced them."""

    def __init__(self):
        self.key = None  # the (micro-batch, chunk) whose B runs now; None: compute at once
        self.pending: dict = defaultdict(list)  # key -> [(weight tensor as used, fn)]

    @contextlib.contextmanager
    def collecting(self, key):
        """Deferred weight gradients created inside belong to ``key`` (one B step)."""
        previous, self.key = self.key, key
        try:
            yield
        finally:
            self.key = previous

    def defer(self, weight: torch.Tensor, fn) -> torch.Tensor | None:
        """Keep ``fn`` (-> dW) for the W of the current key and return None (no weight
        gradient now); with no current key return ``fn()`` (a fused backward).

        ``weight`` must be the tensor object the layer's forward received (kept on the
        autograd context), not the one ``ctx.saved_tensors`` gives back: under activation
        recomputation that is a fresh alias whose link to the parameter's AccumulateGrad is
        weak, and once B's graph is freed, a backward into it would fill the alias's .grad
        instead of the parameter's."""
        if self.key is None:
            return fn()
        self.pending[self.key].append((weight, fn))
        return None

    def run(self, key) -> None:
        """W of ``key``: compute its weight gradients and accumulate them into the parameters.

        Each dW goes into its parameter as soon as it is computed (its inputs are dropped
        then too), so W holds one dW at a time, as a fused backward does. A parameter used
        twice in the chunk (a tied embedding and output layer) and a weight reached through
        other autograd nodes (stacked experts' ``unbind``) are fed in one final
        ``torch.autograd.backward``: the engine sums a parameter's contributions before its
        AccumulateGrad, so every parameter's hooks fire once per micro-batch, as in a fused
        backward."""
        work = self.pending.pop(key, [])
        uses: dict[int, int] = defaultdict(int)
        for weight, _ in work:
            uses[id(weight)] += 1
        later_weights, later_grads = [], []
        work.reverse()
        while work:
            weight, fn = work.pop()
            with torch.no_grad():  # as inside a backward: nothing here is differentiated
                grad = fn()
            del fn  # its x and dy go now
            if weight.is_leaf and uses[id(weight)] == 1:
                torch.autograd.backward(weight, grad)
            else:
                later_weights.append(weight)
                later_grads.append(grad)
        if later_weights:
            torch.autograd.backward(later_weights, later_grads)

    def stored_bytes(self, key) -> int:
        """Bytes the pending closures of ``key`` keep alive (x and dy of every deferred node,
        each storage once): the "W inputs" of the memory formula (docs/pipeline.md)."""
        seen, total = set(), 0
        for _, fn in self.pending.get(key, ()):
            for t in getattr(fn, "tensors", ()):
                meta = t.device.type == "meta"
                ptr = id(t) if meta else (t.untyped_storage().data_ptr(), t.device)
                if ptr not in seen:
                    seen.add(ptr)
                    total += t.numel() * t.element_size() if meta else t.untyped_storage().nbytes()
        return total

    def __len__(self) -> int:
        return sum(len(w) for w in self.pending.values())


_STORE: WeightGradStore | None = None  # set while a zero-bubble schedule runs


def mark_deferred(param: torch.Tensor) -> torch.Tensor:
    """Flag a parameter whose gradient W produces (under the split). The distributed optimizer
    buckets these apart from the parameters whose gradient B produces (norms, biases, the
    router): a bucket mixing both would stage its gradients from a micro-batch's B until that
    micro-batch's W, p micro-batches later, under ZeRO-2."""
    param.deferred_wgrad = True
    return param


def active_store() -> WeightGradStore | None:
    return _STORE


@contextlib.contextmanager
def split_weight_gradients(store: WeightGradStore):
    """Inside: megalite's layers build nodes whose weight gradients ``store`` defers. A
    module-level switch, not thread-local: the autograd engine runs a GPU's backward on its
    own thread."""
    global _STORE
    previous, _STORE = _STORE, store
    try:
        yield store
    finally:
        _STORE = previous


class _Deferred:
    """``fn`` with the tensors it keeps (for :meth:`WeightGradStore.stored_bytes`)."""

    def __init__(self, fn, *tensors):
        self.fn, self.tensors = fn, tensors

    def __call__(self):
        return self.fn(*self.tensors)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _linear_weight_grad(dy: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dW = (x^T dy)^T over all leading dims, in dy's dtype (autocast's), cast to the
    weight's: the product autograd's linear computes (for W^T), so the split changes no bit."""
    return _flat(x).to(dy.dtype).t().mm(_flat(dy)).t().to(dtype)


class _SplitLinear(torch.autograd.Function):
    """y = x W^T + b; backward: dx = dy W and db = sum dy now, dW = dy^T x deferred."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias, ctx.target = store, bias is not None, weight
        return F.linear(x, weight, bias)  # autocast, when on, casts inside as F.linear does

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight.to(dy.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        db = _flat(dy).sum(0) if ctx.has_bias else None
        dw = ctx.store.defer(ctx.target, _Deferred(lambda d, i: _linear_weight_grad(d, i, weight.dtype), dy, x))
        return dx, dw, db, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or under :func:`split_weight_gradients` the same with its weight
    gradient deferred to W."""
    store = _STORE
    if store is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _SplitLinear.apply(x, weight, bias, store)


class _SplitSequenceParallelLinear(torch.autograd.Function):
    """y = all-gather_TP(x) W^T + b from the sequence shard x (sequence parallelism).

    B: dX = dy W, reduce-scattered to dx (the conjugate of the forward all-gather); no
    gather is needed for it. W: X = all-gather(x) once more, dW = dy^T X. Only the shard x
    is kept, as in the fused backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, store):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.store, ctx.has_bias, ctx.target = group, store, bias is not None, weight
        return F.linear(comm.all_gather_dim0(x, group), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        group = ctx.group
        dfull = dy.matmul(weight.to(dy.dtype))
        with comm.category("communication"):
            dx = torch.empty_like(x, dtype=dfull.dtype)
        comm.reduce_scatter_async(dx, dfull.contiguous(), group).wait()
        db = _flat(dy).sum(0) if ctx.has_bias else None

        def weight_grad(d, shard):
            return _linear_weight_grad(d, comm.all_gather_dim0(shard.contiguous(), group), weight.dtype)

        dw = ctx.store.defer(ctx.target, _Deferred(weight_grad, dy, x))
        return dx.to(x.dtype), dw, db, None, None


def sequence_parallel_split_linear(x, weight, bias, group):
    """The sequence-parallel linear under the split (see :class:`_SplitSequenceParallelLinear`);
    None when the split is off, so the caller runs its fused version."""
    store = _STORE
    if store is None or group_size(group) == 1 or not torch.is_grad_enabled():
        return None
    return _SplitSequenceParallelLinear.apply(x, weight, bias, group, store)


class _SplitEmbedding(torch.autograd.Function):
    """y = W[ids]; no input gradient (ids are integers); dW (a scatter-add of dy into the
    rows of ids, aten's own embedding backward) deferred to W."""

    @staticmethod
    def forward(ctx, ids, weight, store):
        ctx.save_for_backward(ids)
        ctx.store, ctx.weight = store, weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows, dtype = weight.shape[0], weight.dtype

        def weight_grad(d, i):
            return torch.ops.aten.embedding_backward(d, i, rows, -1, False, False).to(dtype)

        return None, ctx.store.defer(weight, _Deferred(weight_grad, dy, ids)), None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding``, or under the split the same with its weight gradient deferred."""
    store = _STORE
    if store is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.embedding(ids, weight)
    return _SplitEmbedding.apply(ids, weight, store)
