"""Flash attention in Triton: forward with the per-row log-sum-exp, autograd wrapper.

Each program owns a tile of ``BLOCK_M`` queries of one (batch, head) and streams the keys
and values in blocks of ``BLOCK_N`` with the online softmax: for each block,

    s_ij = scale * log2(e) * q_i . k_j                       (base-2 scores)
    m'_i = max(m_i, max_j s_ij);   alpha = 2^(m_i - m'_i)
    l_i  = alpha l_i + sum_j 2^(s_ij - m'_i);   acc_i = alpha acc_i + sum_j 2^(s_ij - m'_i) v_j

and at the end ``o_i = acc_i / l_i`` and ``lse_i = ln 2 * (m_i + log2 l_i)`` (natural log).
The probabilities are never stored. Causal masking with offsets keeps key j for query i iff
``j + k_offset <= i + q_offset``; key blocks wholly past the tile's diagonal are skipped.
Without causal masking and with s_k a multiple of BLOCK_N no mask is applied. A query that
sees no key gets o = 0, lse = -inf.

Layout: q (b, heads, s_q, d), k and v (b, groups, s_k, d) with ``heads % groups == 0``;
query head h reads key/value head ``h // (heads // groups)``. fp32, fp16, bf16; softmax
statistics and accumulators are fp32. Under the CPU interpreter every load is upcast to
fp32 (bf16 is wrong there otherwise); on a GPU fp16/bf16 tiles go to the tensor cores as they
are and fp32 tiles use exact ("ieee") dot products. The backward is in
``flash_attention_bwd.py``; the torch reference and the merge of partials in
``attention_reference.py``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megalite.kernels._utils import (INTERPRET, check_attention_inputs, check_blocks, next_power_of_2,
                                     on_input_device)
from megalite.kernels.attention_reference import attention_reference, merge_attention  # noqa: F401
from megalite.kernels.flash_attention_bwd import flash_attention_backward

LOG2E = 1.4426950408889634


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, s_q, s_k, delta, qk_scale, heads, groups,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, MASK_N: tl.constexpr,
                UPCAST: tl.constexpr, PREC: tl.constexpr):
    # Reductions call tl.reduce with the combine functions tl.sum / tl.max use: the same code
    # when compiled, and it skips a jit-wrapper call that costs milliseconds in the interpreter.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    kv = (bh // heads) * groups + (bh % heads) // (heads // groups)
    q_base = Q + bh.to(tl.int64) * s_q * HEAD_DIM
    k_base = K + kv.to(tl.int64) * s_k * HEAD_DIM
    v_base = V + kv.to(tl.int64) * s_k * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q_mask = (offs_m[:, None] < s_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + q_ptrs, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    hi = s_k
    if CAUSAL:  # the tile's last row, start_m + BLOCK_M - 1, sees keys j <= it + delta
        hi = tl.maximum(tl.minimum(s_k, start_m + BLOCK_M + delta), 0)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ptrs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = (offs_n[:, None] < s_k) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if MASK_N:
            visible = offs_n[None, :] < s_k
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + delta)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(O + bh.to(tl.int64) * s_q * HEAD_DIM + q_ptrs, out.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + bh.to(tl.int64) * s_q + offs_m, lse, mask=offs_m < s_q)


def _fwd_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Under the interpreter one small config (it
    runs program after program). fp32 tiles take twice the shared memory: smaller ones."""
    if INTERPRET:
        return 32, 32, 1, 1
    if dtype == torch.float32:
        return 64, 32, 4, 2
    return (128, 64, 4, 3) if head_dim <= 64 else (128, 64, 8, 3)


@on_input_device
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                            q_offset: int = 0, k_offset: int = 0, scale: float | None = None,
                            block_m: int | None = None, block_n: int | None = None):
    """(out, lse): out like q, lse (b, heads, s_q) float32 natural log; no autograd."""
    check_attention_inputs(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, heads, s_q, d = q.shape
    groups, s_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    bm, bn, warps, stages = _fwd_config(d, q.dtype)
    bm, bn = check_blocks(block_m or bm, block_n or bn)
    out = torch.empty_like(q)
    lse = torch.empty((b, heads, s_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    grid = (triton.cdiv(s_q, bm), b * heads)
    _fwd_kernel[grid](q, k, v, out, lse, s_q, s_k, int(q_offset) - int(k_offset), scale * LOG2E,
                      heads, groups, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_D=max(16, next_power_of_2(d)), CAUSAL=bool(causal),
                      MASK_N=bool(causal) or s_k % bn != 0,
                      UPCAST=INTERPRET, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                      num_warps=warps, num_stages=stages)
    return out, lse


class _FlashAttention(torch.autograd.Function):
    """Saves (q, k, v, out, lse); the backward recomputes the probabilities block by block.
    A gradient reaching lse enters as ``delta_i - dlse_i`` (d lse_i / d s_ij = p_ij), so
    partial attentions can be merged with ``merge_attention`` under autograd."""

    @staticmethod
    def forward(ctx, q, k, v, causal, q_offset, k_offset, scale):
        out, lse = flash_attention_forward(q, k, v, causal, q_offset, k_offset, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # an unused lse brings no gradient, not zeros
        ctx.args = (causal, q_offset, k_offset, scale)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = flash_attention_backward(q, k, v, out, dout, lse, *ctx.args, dlse=dlse)
        return dq, dk, dv, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    q_offset: int = 0, k_offset: int = 0, softmax_scale: float | None = None,
                    return_lse: bool = False):
    """softmax(scale q k^T + mask) v with autograd; ``(out, lse)`` when ``return_lse``."""
    out, lse = _FlashAttention.apply(q, k, v, causal, q_offset, k_offset, softmax_scale)
    return (out, lse) if return_lse else out
