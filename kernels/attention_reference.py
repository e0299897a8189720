"""Plain torch attention (the reference for the flash kernels) and the exact merge of partials.

Notation, per batch element and query head: scores ``s_ij = scale * q_i . k_j`` over the
keys j visible to query i; ``lse_i = log sum_j exp(s_ij)``; ``o_i = sum_j exp(s_ij - lse_i) v_j``.
Causal with offsets: query i sits at absolute position ``i + q_offset``, key j at
``j + k_offset``, and j is visible iff ``j + k_offset <= i + q_offset``. A query that sees no
key has ``lse_i = -inf`` and ``o_i = 0``.

Packed documents (``doc_start``, ``doc_end``): several documents share the sequence and a
query sees only keys of its own document. ``doc_start`` (b, s_q) gives, for each query row, the
absolute position where its document begins; key j is visible to query i iff
``doc_start[i] <= j + k_offset`` (and, always causal, ``j + k_offset <= i + q_offset``).
``doc_end`` (b, s_k) gives, for each key, the absolute position where its document ends
(exclusive): no query at or past it sees the key. It carries no extra information (documents
are contiguous) and only tells the kernels which query tiles to skip; the reference ignores it.

Value head size: v's last size d_v may differ from q's and k's d (DeepSeek-V3's MLA: 192 and
128); scores and the default scale 1/sqrt(d) use d, out, dout and dv have d_v.

Grouped-query attention: q has ``heads`` heads and k, v have ``groups`` heads; query head h
reads key/value head ``h // (heads / groups)`` (consecutive query heads share a group).

Block functions (``attention_block_forward``, ``attention_block_backward``,
``attention_block_delta``): the "math" path of ring attention on any device, with the
signatures and semantics of the Triton ``flash_attention_forward``, ``flash_attention_backward``
and ``attention_delta``. They materialize one block's (s_q, s_k) scores, compute in float32
for 16-bit inputs (float64 stays float64) and create every tensor on the inputs' device, so
they also run on CUDA and on ``meta`` tensors. Backward of one (q, k/v) block, from the
*global* lse and ``delta_i = do_i . o_i``, with ``p_ij = exp(s_ij - lse_i)`` over visible keys:

    dv_j = sum_i p_ij do_i,  dp_ij = do_i . v_j,  ds_ij = p_ij (dp_ij - delta_i),
    dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i

(the block's exact share of the full gradients: sum it over the key/value blocks).
"""
from __future__ import annotations

import functools
import math

import torch

from megalite.kernels._utils import check_backward_shapes


def causal_visible(s_q: int, s_k: int, q_offset: int, k_offset: int,
                   device=None, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask ``visible[i, j] = j + k_offset <= i + q_offset``, (s_q, s_k); with
    ``doc_start`` (b, s_q) also ``doc_start[i] <= j + k_offset``, (b, 1, s_q, s_k)."""
    i = torch.arange(s_q, device=device).unsqueeze(1) + q_offset
    j = torch.arange(s_k, device=device).unsqueeze(0) + k_offset
    visible = j <= i
    if doc_start is not None:
        visible = (visible & (j >= doc_start.to(device=device).unsqueeze(-1))).unsqueeze(1)
    return visible


def check_documents(what: str, causal: bool, q: torch.Tensor, k: torch.Tensor, doc_start, doc_end) -> None:
    """Documents go with causal attention; doc_start is (b, s_q), doc_end (b, s_k)."""
    if doc_start is None and doc_end is None:
        return
    if not causal:
        raise ValueError(f"{what}: packed documents (doc_start/doc_end) need causal attention.")
    b, s_q, s_k = q.shape[0], q.shape[2], k.shape[2]
    if doc_start is None or tuple(doc_start.shape) != (b, s_q):
        raise ValueError(f"{what}: doc_start must be (b, s_q) = {(b, s_q)}, got "
                         f"{None if doc_start is None else tuple(doc_start.shape)}.")
    if doc_end is not None and tuple(doc_end.shape) != (b, s_k):
        raise ValueError(f"{what}: doc_end must be (b, s_k) = {(b, s_k)}, got {tuple(doc_end.shape)}.")


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        q_offset: int = 0, k_offset: int = 0, scale: float | None = None,
                        doc_start: torch.Tensor | None = None, doc_end: torch.Tensor | None = None):
    """(out, lse) in plain torch, computed in the inputs' dtype (pass float64 for a reference).

    q: (b, heads, s_q, d); k: (b, groups, s_k, d); v: (b, groups, s_k, d_v). Returns out (b, heads, s_q, d_v) and
    lse (b, heads, s_q) with the natural log. Differentiable with autograd. ``doc_start`` /
    ``doc_end``: packed documents (module docstring), causal only.
    """
    check_documents("attention_reference", causal, q, k, doc_start, doc_end)
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
    visible = causal_visible(q.shape[2], k.shape[2], q_offset, k_offset, q.device, doc_start)
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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _check_block_inputs(what: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] \
            or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{what}: expected q (b, heads, s_q, d), k (b, groups, s_k, d) and v (b, groups, "
                         f"s_k, d_v) with heads a multiple of groups, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")


def without_autocast(fn):
    """Run a block function with autocast off on its inputs' device. The block functions
    compute in float32 for 16-bit inputs (as the Triton kernels accumulate); the model's
    forward runs under autocast, which would cast their float32 ``matmul`` back to 16 bits."""
    @functools.wraps(fn)
    def run(q, *args, **kwargs):
        kind = q.device.type
        if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
            with torch.autocast(kind, enabled=False):
                return fn(q, *args, **kwargs)
        return fn(q, *args, **kwargs)

    return run


@torch.no_grad()
@without_autocast
def attention_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                            q_offset: int = 0, k_offset: int = 0, scale: float | None = None,
                            doc_start: torch.Tensor | None = None, doc_end: torch.Tensor | None = None,
                            row_max: torch.Tensor | None = None):
    """(out, lse) of one block, as ``flash_attention_forward``: out in q's dtype, lse
    (b, heads, s_q) in float32 (float64 for float64 inputs); no autograd. ``row_max``: gets
    each row's largest visible logit (:func:`logit_row_max`), as the Triton kernel's."""
    _check_block_inputs("attention_block_forward", q, k, v)
    acc = _compute_dtype(q.dtype)
    out, lse = attention_reference(q.to(acc), k.to(acc), v.to(acc), causal=causal,
                                   q_offset=q_offset, k_offset=k_offset, scale=scale,
                                   doc_start=doc_start, doc_end=doc_end)
    if row_max is not None:
        row_max.copy_(logit_row_max(q, k, causal, q_offset, k_offset, scale, doc_start))
    return out.to(q.dtype), lse


@torch.no_grad()
def logit_row_max(q: torch.Tensor, k: torch.Tensor, causal: bool = True, q_offset: int = 0, k_offset: int = 0,
                  scale: float | None = None, doc_start: torch.Tensor | None = None,
                  rows_per_chunk: int = 256) -> torch.Tensor:
    """Each query row's largest visible logit ``max_j scale q_i . k_j`` (the scores softmax
    sees, masked keys excluded; -inf for a row that sees none), (b, heads, s_q) float32
    (float64 for float64 inputs). The scores are formed ``rows_per_chunk`` query rows at a
    time, so the extra memory is (b, heads, rows_per_chunk, s_k), not (s_q, s_k): the torch
    backend's QK-clip statistic, which SDPA does not give (the Triton kernel keeps it anyway)."""
    heads, groups = q.shape[1], k.shape[1]
    acc = _compute_dtype(q.dtype)
    k = k.to(acc) if heads == groups else k.to(acc).repeat_interleave(heads // groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    parts = []
    for lo in range(0, q.shape[2], rows_per_chunk):
        q_part = q[:, :, lo: lo + rows_per_chunk].to(acc)
        scores = torch.matmul(q_part, k.transpose(-1, -2)) * scale
        if causal:
            starts = None if doc_start is None else doc_start[:, lo: lo + q_part.shape[2]]
            visible = causal_visible(q_part.shape[2], k.shape[2], q_offset + lo, k_offset, q.device, starts)
            scores = scores.masked_fill(~visible, float("-inf"))
        parts.append(scores.amax(dim=-1) if scores.shape[-1] else scores.new_full(scores.shape[:-1], float("-inf")))
    return torch.cat(parts, dim=2) if parts else q.new_empty(q.shape[:3], dtype=acc)


def fold_head_max(head_max: torch.Tensor, row_max: torch.Tensor) -> None:
    """``head_max`` (heads,) <- max(head_max, max over batch and rows of ``row_max`` (b, heads,
    s)), in place on the device (no host read): a call's share of a layer's per-head logit max."""
    torch.maximum(head_max, row_max.amax(dim=(0, 2)).to(head_max.dtype), out=head_max)


def attention_block_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta_i = sum_d do_id o_id, shape out.shape[:-1], float32 (float64 for float64)."""
    acc = _compute_dtype(out.dtype)
    return (out.to(acc) * dout.to(acc)).sum(dim=-1)


@torch.no_grad()
@without_autocast
def attention_block_backward(q, k, v, out, dout, lse, causal: bool = True, q_offset: int = 0,
                             k_offset: int = 0, scale: float | None = None, *, delta=None,
                             dlse=None, doc_start: torch.Tensor | None = None,
                             doc_end: torch.Tensor | None = None):
    """(dq, dk, dv) of one (q, k/v) block from the global ``lse`` and ``out``/``dout`` (or their
    ``delta``), as ``flash_attention_backward``: in the inputs' dtypes, dk and dv summed over
    each group's query heads. A gradient on lse enters as ``delta - dlse``."""
    _check_block_inputs("attention_block_backward", q, k, v)
    check_backward_shapes("attention_block_backward", q, out, dout, lse, delta, v.shape[3])
    check_documents("attention_block_backward", causal, q, k, doc_start, doc_end)
    acc = _compute_dtype(q.dtype)
    b, heads, s_q, d = q.shape
    groups, s_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if delta is None:
        delta = attention_block_delta(out, dout)
    if dlse is not None:
        delta = delta - dlse
    # Query heads grouped by their key/value head: (b, groups, heads/groups, s, d) against
    # k, v of shape (b, groups, 1, s_k, d), so GQA sums dk, dv over dim 2.
    q_g = q.to(acc).reshape(b, groups, heads // groups, s_q, d)
    do_g = dout.to(acc).reshape(b, groups, heads // groups, s_q, v.shape[3])
    k_g, v_g = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    lse_g = lse.to(acc).reshape(b, groups, heads // groups, s_q, 1)
    delta_g = delta.to(acc).reshape(b, groups, heads // groups, s_q, 1)
    # A row that sees no key anywhere has lse = -inf: its p is 0, not exp(+inf).
    lse_g = lse_g.masked_fill(lse_g == float("-inf"), float("inf"))
    p = torch.exp(torch.matmul(q_g, k_g.transpose(-1, -2)) * scale - lse_g)
    if causal:
        visible = causal_visible(s_q, s_k, q_offset, k_offset, q.device, doc_start)
        if doc_start is not None:  # (b, 1, s_q, s_k) -> (b, 1, 1, s_q, s_k) against the grouped heads
            visible = visible.unsqueeze(1)
        p = p.masked_fill(~visible, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do_g).sum(dim=2)
    ds = p * (torch.matmul(do_g, v_g.transpose(-1, -2)) - delta_g)
    dq = torch.matmul(ds, k_g) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q_g).sum(dim=2) * scale
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
