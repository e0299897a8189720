"""Expert MLPs stored as stacked weights, and the grouped matmul over sorted rows.

Each expert is megalite's MLP without bias: ``fc2(act(fc1(x)))`` with
``fc1: h -> 2F`` holding ``[gate; up]`` for SwiGLU (``act = silu(gate) * up``) or
``fc1: h -> F`` for GELU (tanh approximation, like GPT-2). The weights of the E experts are
stacked, ``w1: (E, sections*F, h)`` and ``w2: (E, h, F)`` (``nn.Linear`` layout, out x in), so
an expert-parallel shard of experts ``[e0, e0 + E_local)`` is simply a slice along dim 0.

:func:`grouped_mlp` takes rows already sorted by expert (``counts[e]`` contiguous rows for
local expert ``e``) and applies expert ``e`` to its rows:

    y[rows of e] = act(x[rows of e] w1[e]^T) w2[e]^T

The torch fallback is a loop of two matmuls per non-empty group. TODO (later step): a Triton
grouped GEMM (one launch over all groups, tiles assigned by a prefix sum over ``counts``,
like torch._grouped_mm / Megatron's GroupedMLP); it must match this loop to fp32 tolerance
forward and backward, and this loop stays as its oracle.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _activation(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


def grouped_mlp(x_sorted: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
                swiglu: bool = True) -> torch.Tensor:
    """Rows ``x_sorted`` (N, h) grouped by expert (``counts``: E host ints summing to N) ->
    (N, h). Experts without rows cost nothing; their weight gradients are zero (not None),
    also when no expert gets a row at all: every rank must still present a gradient to
    the data-parallel reduction of expert parameters."""
    if len(counts) != w1.shape[0]:
        raise ValueError(f"{len(counts)} group counts for {w1.shape[0]} experts")
    if sum(counts) != x_sorted.shape[0]:
        raise ValueError(f"group counts sum to {sum(counts)}, but there are {x_sorted.shape[0]} rows")
    outputs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = x_sorted[start:start + n]
        outputs.append(F.linear(_activation(F.linear(rows, w1[e]), swiglu), w2[e]))
        start += n
    if not outputs:  # keep the weights in the graph: zero gradients rather than None
        return x_sorted.new_zeros((0, w2.shape[1])) + 0.0 * (w1.sum() + w2.sum())
    return torch.cat(outputs, dim=0)


class GroupedExperts(nn.Module):
    """``num_local`` experts (global indices ``first, first+1, ...``) as stacked weights."""

    def __init__(self, num_local: int, hidden: int, ffn: int, swiglu: bool = True, first: int = 0,
                 grouped_gemm: bool = False):
        super().__init__()
        self.num_local, self.first, self.swiglu, self.grouped_gemm = num_local, first, swiglu, grouped_gemm
        self.hidden, self.ffn = hidden, ffn
        sections = 2 if swiglu else 1
        self.w1 = nn.Parameter(torch.empty(num_local, sections * ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, ffn))

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return grouped_mlp(x_sorted, counts, self.w1, self.w2, self.swiglu)
