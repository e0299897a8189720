"""Flash attention backward in Triton, from the saved log-sum-exp (no stored probabilities).

With ``p_ij = exp(s_ij - lse_i)``, ``s_ij = scale q_i . k_j`` over visible keys:

    dv_j = sum_i p_ij do_i
    dp_ij = do_i . v_j
    ds_ij = p_ij (dp_ij - delta_i),   delta_i = do_i . o_i  (= sum_j p_ij dp_ij)
    dq_i = scale sum_j ds_ij k_j,     dk_j = scale sum_i ds_ij q_i

Three kernels: ``delta`` (row sums of do * o), ``dk/dv`` (one program per key block,
looping over the query blocks of every query head of its group, so GQA sums inside the
program, no atomics) and ``dq`` (one program per query block, looping over key blocks).

Ring attention: the pair (q block, k/v block) may be any piece of a longer attention. Pass
the *global* lse and the global out and do (or their ``delta``), and the result is that
pair's exact contribution to dq, dk, dv: sum it over the key/value blocks. A gradient on
lse itself (when partial results were merged under autograd) enters as ``delta - dlse``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megalite.kernels._utils import (INTERPRET, check_attention_inputs, check_backward_shapes, check_blocks,
                                     next_power_of_2, on_input_device)

LOG2E = 1.4426950408889634


@triton.jit
def _delta_kernel(O, DO, DELTA, n_rows, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.reduce(o * do, 1, tl.standard._sum_combine), mask=rows < n_rows)


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, s_q, s_k, delta_pos, qk_scale, scale, heads,
                 groups, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                 PREC: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bg = tl.program_id(1)
    per_group = heads // groups
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_off = bg.to(tl.int64) * s_k * HEAD_DIM
    kv_ptrs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    kv_mask = (offs_n[:, None] < s_k) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + kv_off + kv_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off + kv_ptrs, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    lo = 0
    if CAUSAL:  # query i sees key start_n iff i >= start_n - delta_pos
        lo = tl.maximum(start_n - delta_pos, 0) // BLOCK_M * BLOCK_M
    for hq in range(0, per_group):
        bh = ((bg // groups) * heads + (bg % groups) * per_group + hq).to(tl.int64)
        for start_m in range(lo, s_q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_ptrs = bh * s_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
            q_mask = (offs_m[:, None] < s_q) & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(Q + q_ptrs, mask=q_mask, other=0.0)
            do = tl.load(DO + q_ptrs, mask=q_mask, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + bh * s_q + offs_m, mask=offs_m < s_q, other=0.0)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            dlt = tl.load(DELTA + bh * s_q + offs_m, mask=offs_m < s_q, other=0.0)
            visible = (offs_m[None, :] < s_q) & (offs_n[:, None] < s_k)
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + delta_pos)
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (BLOCK_N, BLOCK_M)
            p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds_t = p_t * (dp_t - dlt[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)
    tl.store(DK + kv_off + kv_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off + kv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, s_q, s_k, delta_pos, qk_scale, scale, heads, groups,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
               PREC: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    kv = (bh // heads) * groups + (bh % heads) // (heads // groups)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = bh * s_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q_mask = (offs_m[:, None] < s_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + q_ptrs, mask=q_mask, other=0.0)
    do = tl.load(DO + q_ptrs, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + bh * s_q + offs_m, mask=offs_m < s_q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dlt = tl.load(DELTA + bh * s_q + offs_m, mask=offs_m < s_q, other=0.0)
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    hi = s_k
    if CAUSAL:
        hi = tl.maximum(tl.minimum(s_k, start_m + BLOCK_M + delta_pos), 0)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ptrs = kv * s_k * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = (offs_n[:, None] < s_k) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        visible = (offs_n[None, :] < s_k) & (offs_m[:, None] < s_q)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + delta_pos)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - dlt[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + q_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def _bwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tiles (BLOCK_M, BLOCK_N, num_warps, num_stages): dk/dv programs hold a (BLOCK_N, d) pair
    of accumulators, dq programs one (BLOCK_M, d). One small config under the interpreter;
    fp32 tiles take twice the shared memory: smaller ones."""
    if INTERPRET:
        return dict(kv=(32, 32, 1, 1), q=(32, 32, 1, 1))
    if dtype == torch.float32:
        return dict(kv=(32, 64, 4, 2), q=(64, 32, 4, 2))
    warps = 4 if head_dim <= 64 else 8
    return dict(kv=(32, 128, warps, 3), q=(128, 32, warps, 3))


@on_input_device
def attention_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta_i = sum_d do_id o_id in float32, shape out.shape[:-1]."""
    out, dout = out.contiguous(), dout.contiguous()
    d = out.shape[-1]
    delta = torch.empty(out.shape[:-1], device=out.device, dtype=torch.float32)
    rows = delta.numel()
    if rows:
        bm = 32 if INTERPRET else 64
        _delta_kernel[(triton.cdiv(rows, bm),)](out, dout, delta, rows, HEAD_DIM=d, BLOCK_M=bm,
                                                BLOCK_D=max(16, next_power_of_2(d)))
    return delta


@on_input_device
def flash_attention_backward(q, k, v, out, dout, lse, causal: bool = True, q_offset: int = 0,
                             k_offset: int = 0, scale: float | None = None, *, delta=None,
                             dlse=None, block_m: int | None = None, block_n: int | None = None):
    """(dq, dk, dv) for one (q, k/v) pair given the global ``lse`` (b, heads, s_q) and either
    the global ``out``/``dout`` or their precomputed ``delta`` (see module docstring).
    Gradients come back in the inputs' dtypes; dk, dv summed over each group's query heads."""
    check_attention_inputs(q, k, v)
    check_backward_shapes("flash_attention_backward", q, out, dout, lse, delta)
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    b, heads, s_q, d = q.shape
    groups, s_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if delta is None:
        delta = attention_delta(out, dout)
    if dlse is not None:
        delta = delta - dlse.float()
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    cfg = _bwd_config(d, q.dtype)
    common = dict(HEAD_DIM=d, BLOCK_D=max(16, next_power_of_2(d)), CAUSAL=bool(causal),
                  UPCAST=INTERPRET, PREC="ieee" if q.dtype == torch.float32 else "tf32")
    args = (s_q, s_k, int(q_offset) - int(k_offset), scale * LOG2E, scale, heads, groups)
    bm, bn, warps, stages = cfg["kv"]
    bm, bn = check_blocks(block_m or bm, block_n or bn)
    _dkdv_kernel[(triton.cdiv(s_k, bn), b * groups)](
        q, k, v, dout, lse, delta, dk, dv, *args, BLOCK_M=bm, BLOCK_N=bn, **common,
        num_warps=warps, num_stages=stages)
    bm, bn, warps, stages = cfg["q"]
    bm, bn = check_blocks(block_m or bm, block_n or bn)
    _dq_kernel[(triton.cdiv(s_q, bm), b * heads)](
        q, k, v, dout, lse, delta, dq, *args, BLOCK_M=bm, BLOCK_N=bn, **common,
        num_warps=warps, num_stages=stages)
    return dq, dk, dv
