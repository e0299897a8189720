"""Expert MLPs stored as stacked weights, and the grouped matmul over sorted rows.

Each expert is megalite's MLP without bias: ``fc2(act(fc1(x)))`` with
``fc1: h -> 2F`` holding ``[gate; up]`` for SwiGLU (``act = silu(gate) * up``) or
``fc1: h -> F`` for GELU (tanh approximation, like GPT-2). The weights of the E experts are
stacked, ``w1: (E, sections*F, h)`` and ``w2: (E, h, F)`` (``nn.Linear`` layout, out x in), so
an expert-parallel shard of experts ``[e0, e0 + E_local)`` is simply a slice along dim 0.

:func:`grouped_mlp` takes rows already sorted by expert (``counts[e]`` contiguous rows for
local expert ``e``) and applies expert ``e`` to its rows:

    y[rows of e] = act(x[rows of e] w1[e]^T) w2[e]^T

The torch fallback is a loop of two matmuls per non-empty group. ``--moe-grouped-gemm``
(:func:`grouped_mlp_triton`) runs each of the two matmuls as one Triton launch over all groups
(:mod:`megalite.kernels.grouped_gemm`: tiles assigned to groups by a prefix sum over the
counts, dW per group without atomics); the loop stays its oracle (tests/test_grouped_gemm.py,
tests/test_moe.py). On meta (dry runs) the loop stands in: same shapes, same memory.

``counts`` are host ints or an (E,) integer tensor on the rows' device. The Triton path keeps a
tensor on the device (offsets ``F.pad(cumsum(counts), (1, 0))``, built once for both matmuls;
the grid is then sized by a bound, see the kernel): no device->host sync. The loop slices rows
by host counts, so it reads a tensor to the host: one sync (balanced counts on meta).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.layers.weight_grad import _Deferred, active_store, linear, mark_deferred
from megalite.moe.dispatch import host_ints


def _activation(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


def host_counts(counts, n_rows: int) -> list[int]:
    """Host ints as they are; a tensor read to the host (one sync; balanced over ``n_rows``
    on meta)."""
    return host_ints(counts, n_rows) if isinstance(counts, torch.Tensor) else list(counts)


def grouped_mlp(x_sorted: torch.Tensor, counts, w1: torch.Tensor, w2: torch.Tensor,
                swiglu: bool = True) -> torch.Tensor:
    """Rows ``x_sorted`` (N, h) grouped by expert (``counts``: E ints summing to N; a tensor is
    read to the host) -> (N, h). Experts without rows cost nothing; their weight gradients are
    zero (not None), also when no expert gets a row at all: every rank must still present a
    gradient to the data-parallel reduction of expert parameters."""
    counts = host_counts(counts, x_sorted.shape[0])
    if len(counts) != w1.shape[0]:
        raise ValueError(f"{len(counts)} group counts for {w1.shape[0]} experts")
    if sum(counts) != x_sorted.shape[0]:
        raise ValueError(f"group counts sum to {sum(counts)}, but there are {x_sorted.shape[0]} rows")
    # One unbind per weight (its backward stacks the experts' gradients once); indexing w1[e]
    # per expert would make a stacked-weight-sized zero gradient per expert in backward.
    w1s, w2s = w1.unbind(0), w2.unbind(0)
    outputs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = x_sorted[start:start + n]
        outputs.append(linear(_activation(linear(rows, w1s[e]), swiglu), w2s[e]))
        start += n
    if not outputs:  # keep the weights in the graph: zero gradients rather than None
        return x_sorted.new_zeros((0, w2.shape[1])) + 0.0 * (w1.sum() + w2.sum())
    return torch.cat(outputs, dim=0)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: autocast's, when it is on for x's device."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def grouped_mlp_triton(x_sorted: torch.Tensor, counts, w1: torch.Tensor, w2: torch.Tensor,
                       swiglu: bool = True) -> torch.Tensor:
    """:func:`grouped_mlp` with each matmul one Triton grouped GEMM (same numbers to fp32
    rounding). Autocast does not reach a Triton kernel, so inputs are cast as F.linear's would be.
    ``counts``: host ints, or a tensor on the rows' device (no sync, see the module docstring)."""
    from megalite.kernels.grouped_gemm import _GroupedLinear, group_offsets

    n_groups = w1.shape[0]
    if isinstance(counts, torch.Tensor):
        if counts.shape != (n_groups,):
            raise ValueError(f"{tuple(counts.shape)} group counts for {n_groups} experts")
        # Trusted device offsets: grouped_linear would read a CPU tensor's counts to check them.
        offsets, exact = F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0)), None
    else:
        if len(counts) != n_groups:
            raise ValueError(f"{len(counts)} group counts for {n_groups} experts")
        offsets, exact = group_offsets(counts, n_groups, x_sorted.shape[0], x_sorted.device)
    dtype = _compute_dtype(x_sorted)
    store = active_store() if torch.is_grad_enabled() else None

    def grouped(x, w):  # under a zero-bubble schedule the grouped dW waits for the schedule's W
        if store is not None:
            return _SplitGroupedLinear.apply(x, w, offsets, exact, store)
        return _GroupedLinear.apply(x, w, offsets, exact)

    h = grouped(x_sorted.to(dtype), w1.to(dtype))
    return grouped(_activation(h, swiglu), w2.to(dtype))


class _SplitGroupedLinear(torch.autograd.Function):
    """The grouped linear with the B/W split (:mod:`megalite.layers.weight_grad`): B computes
    dx = grouped(dy, w^T), the grouped dW[e] = dy[rows of e]^T x[rows of e] waits for W."""

    @staticmethod
    def forward(ctx, x, w, offsets, counts, store):
        from megalite.kernels.grouped_gemm import _GroupedLinear

        ctx.store, ctx.target = store, w  # see WeightGradStore.defer
        return _GroupedLinear.forward(ctx, x, w, offsets, counts)  # saves x, w, offsets and counts

    @staticmethod
    def backward(ctx, dy):
        from megalite.kernels.grouped_gemm import grouped_matmul, grouped_weight_grad

        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_matmul(dy, w.transpose(1, 2), offsets, ctx.counts) if ctx.needs_input_grad[0] else None
        dw = ctx.store.defer(ctx.target, _Deferred(grouped_weight_grad, dy, x, offsets))
        return dx, dw, None, None, None


class GroupedExperts(nn.Module):
    """``num_local`` experts (global indices ``first, first+1, ...``) as stacked weights."""

    def __init__(self, num_local: int, hidden: int, ffn: int, swiglu: bool = True, first: int = 0,
                 grouped_gemm: bool = False):
        super().__init__()
        self.num_local, self.first, self.swiglu, self.grouped_gemm = num_local, first, swiglu, grouped_gemm
        self.hidden, self.ffn = hidden, ffn
        sections = 2 if swiglu else 1
        self.w1 = mark_deferred(nn.Parameter(torch.empty(num_local, sections * ffn, hidden)))
        self.w2 = mark_deferred(nn.Parameter(torch.empty(num_local, hidden, ffn)))

    def forward(self, x_sorted: torch.Tensor, counts) -> torch.Tensor:
        """``counts``: host ints or a device tensor (see the module docstring)."""
        if self.grouped_gemm and x_sorted.device.type != "meta":
            return grouped_mlp_triton(x_sorted, counts, self.w1, self.w2, self.swiglu)
        return grouped_mlp(x_sorted, counts, self.w1, self.w2, self.swiglu)
