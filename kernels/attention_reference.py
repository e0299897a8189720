"""Plain torch attention (the reference for the flash kernels) and the exact merge of partials.

Notation, per batch element and query head: scores ``s_ij = scale * q_i . k_j`` over the
keys j visible to query i; ``lse_i = log sum_j exp(s_ij)``; ``o_i = sum_j exp(s_ij - lse_i) v_j``.
Causal with offsets: query i sits at absolute position ``i + q_offset``, key j at
``j + k_offset``, and j is visible iff ``j + k_offset <= i + q_offset``. A query that sees no
key has ``lse_i = -inf`` and ``o_i = 0``.

Grouped-query attention: q has ``heads`` heads and k, v have ``groups`` heads; query head h
reads key/value head ``h // (heads / groups)`` (consecutive query heads share a group).
"""
from __future__ import annotations

import math

import torch


def causal_visible(s_q: int, s_k: int, q_offset: int, k_offset: int,
                   device=None) -> torch.Tensor:
    """Boolean (s_q, s_k) mask: ``visible[i, j] = j + k_offset <= i + q_offset``."""
    i = torch.arange(s_q, device=device).unsqueeze(1) + q_offset
    j = torch.arange(s_k, device=device).unsqueeze(0) + k_offset
    return j <= i


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        q_offset: int = 0, k_offset: int = 0, scale: float | None = None):
    """(out, lse) in plain torch, computed in the inputs' dtype (pass float64 for a reference).

    q: (b, heads, s_q, d); k, v: (b, groups, s_k, d). Returns out (b, heads, s_q, d) and
    lse (b, heads, s_q) with the natural log. Differentiable with autograd.
    """
    heads, groups = q.shape[1], k.shape[1]
    if heads % groups != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({groups}).")
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if not causal:
        lse = torch.logsumexp(scores, dim=-1)
        return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse
    visible = causal_visible(q.shape[2], k.shape[2], q_offset, k_offset, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    # Rows with no visible key: take the log-sum-exp of zeros instead (finite, no NaN in the
    # backward), then report -inf; their probabilities are exp(-inf) = 0 either way.
    empty = ~visible.any(dim=-1, keepdim=True)
    lse = torch.logsumexp(scores.masked_fill(empty, 0.0), dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse.masked_fill(empty.squeeze(-1), float("-inf"))


def merge_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                    lse2: torch.Tensor):
    """Exact attention over the union of two disjoint key sets from the two partial results.

    ``lse = log(exp(lse1) + exp(lse2))`` and ``out = out1 exp(lse1 - lse) + out2 exp(lse2 - lse)``,
    evaluated against ``m = max(lse1, lse2)`` for stability. Rows that see no key on either
    side (both lse = -inf) give lse = -inf and out = 0, never NaN. out: (..., s, d) in the
    dtype of out1; lse: (..., s) in float32 (or float64 for float64 inputs). Differentiable.
    """
    if out1.shape != out2.shape or lse1.shape != lse2.shape or out1.shape[:-1] != lse1.shape:
        raise ValueError(f"merge_attention: shapes must be out (..., s, d) and lse (..., s) on both "
                         f"sides, got {tuple(out1.shape)}, {tuple(lse1.shape)}, "
                         f"{tuple(out2.shape)}, {tuple(lse2.shape)}.")
    acc = torch.promote_types(lse1.dtype, torch.float32)
    lse1, lse2 = lse1.to(acc), lse2.to(acc)
    m = torch.maximum(lse1, lse2).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    empty = total == 0
    safe_total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), m + torch.log(safe_total))
    out = (out1.to(acc) * (w1 / safe_total).unsqueeze(-1)
           + out2.to(acc) * (w2 / safe_total).unsqueeze(-1))
    return out.to(out1.dtype), lse
