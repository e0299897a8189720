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

Layout: q (b, heads, s_q, d), k (b, groups, s_k, d) and v (b, groups, s_k, d_v) with
``heads % groups == 0``; query head h reads key/value head ``h // (heads // groups)``; d and
d_v each up to 256, and they may differ (DeepSeek-V3's MLA: 192 and 128): the scores use d
(the default scale is 1/sqrt(d)), the output and its accumulator d_v. The kernels take
the (batch, head, sequence) strides of every input, so any tensor whose last dim has stride
1 (a permuted view of a fused qkv, a chunk along the sequence) is read in place; others are
copied first. The output is a (b, heads, s_q, d_v) view of memory laid out (s_q, b, heads, d_v), the
order the model's output projection reads it in: there ``permute + reshape`` to (s, b, h) is a
view, so the tensor the kernel keeps for backward and the projection's input are one. The lse
is contiguous. fp32, fp16, bf16; softmax statistics and accumulators
are fp32. Under the CPU interpreter every load is upcast to fp32 (bf16 is wrong there
otherwise); on a GPU fp16/bf16 tiles go to the tensor cores as they are and fp32 tiles use
exact ("ieee") dot products.

Tiles. On a GPU ``triton.autotune`` picks (BLOCK_M, BLOCK_N, num_warps, num_stages) from a
few configs per dtype class (16-bit; fp32: smaller, FMA products need registers) and tile
width (the wider of d and d_v rounded up to a power of two: 64 serves <= 64, 128 serves 96
and 128, 256 up to 256). Before timing, the configs whose estimated shared memory
(``fwd_shared_bytes``) exceeds the device's per-block limit are dropped (sm_90 keeps all,
sm_80 all but the largest, ~100 KB GPUs the smaller ones; at least one always remains). The
key is (head dims d and d_v, causal, s_q and s_k rounded up to powers of two, the tensors' dtypes): the
first call with a new key times the configs, and the fastest is cached by the autotuner for
the rest of the process and on disk (``_utils.autotune``). MEGALITE_KERNEL_TUNING=fixed gives
the autotuner one config instead, the first that fits the GPU (a test run: one compiled variant
per kernel and shape class). The grid is (query tiles, b * heads), the second spilling onto a
third axis past 65,535 (CUDA's cap of axes 1 and 2; ``_utils.split_grid``). The configs were
chosen from a compile-only sweep (tools/compile_kernels.py) to fit sm_80 and sm_90 shared
memory without register spills.
Under the interpreter one small config runs; explicit ``block_m``/``block_n``/``num_warps``/
``num_stages`` bypass the autotuner. The backward is in ``flash_attention_bwd.py``; the torch
reference and the merge of partials in ``attention_reference.py``.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from megalite.kernels import _utils
from megalite.kernels._utils import (INTERPRET, INTERPRET_TILES, autotune, block_d, check_attention_inputs,
                                     document_starts, tile_counter,
                                     config_width, explicit_config, fixed_limit, launch_tiles,
                                     on_input_device, seq_key, seq_strided, shared_memory_pruner, split_grid,
                                     tile_config, unit_last_stride)
from megalite.kernels.attention_reference import attention_reference, check_documents, merge_attention  # noqa: F401
from megalite.kernels.flash_attention_bwd import flash_attention_backward

LOG2E = 1.4426950408889634
TUNING_KEY = ("HEAD_DIM", "CAUSAL", "DOCS", "SQ_KEY", "SK_KEY")  # + the tensors' dtypes, added by triton.autotune


@triton.jit(do_not_specialize=["n_bh"])  # b * heads: no variant per value class
def _fwd_kernel(Q, K, V, O, LSE, DS, TILES, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os, s_q, s_k, delta, qk_scale,
                heads, groups, n_bh, SQ_KEY, SK_KEY, RM,
                HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                CAUSAL: tl.constexpr, DOCS: tl.constexpr, COUNT: tl.constexpr, ROW_MAX: tl.constexpr,
                MASK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, GRID_Y: tl.constexpr):
    # Reductions call tl.reduce with the combine functions tl.sum / tl.max use: the same code
    # when compiled, and it skips a jit-wrapper call that costs milliseconds in the interpreter.
    # SQ_KEY, SK_KEY (the lengths rounded to powers of two) only key the autotuner.
    # DS (DOCS): per query row, the first key index (this call's key numbering) of its
    # document; TILES (COUNT, tests and benchmarks): one count per key tile computed.
    # HEAD_DIM (tile width BLOCK_D): q's and k's head size; V_DIM (BLOCK_DV): v's and out's.
    # RM (ROW_MAX, QK-clip): per query row, the largest visible logit scale q.k, natural units.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1) + tl.program_id(2) * GRID_Y  # (batch, head): axes 1 and 2 (split_grid)
    if bh >= n_bh:
        return
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    g = (h // (heads // groups)).to(tl.int64)
    h = h.to(tl.int64)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < V_DIM
    q_mask = (offs_m[:, None] < s_q) & d_ok
    q = tl.load(q_base + offs_m.to(tl.int64)[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_rel = offs_n0[:, None] * stride_ks + offs_d[None, :]  # within a key block; int32 is enough
    v_rel = offs_n0[:, None] * stride_vs + offs_dv[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    hi = s_k
    if CAUSAL:  # the tile's last row, start_m + BLOCK_M - 1, sees keys j <= it + delta
        hi = tl.maximum(tl.minimum(s_k, start_m + BLOCK_M + delta), 0)
    lo = 0
    if DOCS:  # rows' document starts never decrease: the tile's first row starts earliest
        doc_row = tl.load(DS + b * s_q + offs_m, mask=offs_m < s_q, other=0)
        lo = tl.maximum(tl.load(DS + b * s_q + start_m), 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        if COUNT:
            tl.atomic_add(TILES, 1)
        offs_n = start_n + offs_n0
        n_ok = offs_n[:, None] < s_k
        row0 = tl.cast(start_n, tl.int64)
        k = tl.load(k_base + row0 * stride_ks + k_rel, mask=n_ok & d_ok, other=0.0)
        v = tl.load(v_base + row0 * stride_vs + v_rel, mask=n_ok & dv_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if MASK_N:
            visible = offs_n[None, :] < s_k
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + delta)
            if DOCS:
                visible = visible & (offs_n[None, :] >= doc_row[:, None])
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
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_os + offs_dv[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m[:, None] < s_q) & dv_ok)
    bh = bh.to(tl.int64)
    tl.store(LSE + bh * s_q + offs_m, lse, mask=offs_m < s_q)
    if ROW_MAX:  # m_i is the running max of the base-2 scores: back to natural units
        tl.store(RM + bh * s_q + offs_m, m_i * 0.6931471805599453, mask=offs_m < s_q)


# -- configurations ------------------------------------------------------------------------------
#
# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) per tile width (module docstring), chosen
# (tools/compile_kernels.py) to compile on sm_80 and sm_90 without register spills; every list
# has a config of <= 99 KB by the estimate (sm_86/sm_89). fp32: FMA products keep every operand
# in registers, so small tiles and 8 warps.

_FWD_16BIT = {
    64: ((128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4)),
    128: ((128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2)),
    256: ((64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 3), (64, 32, 8, 2), (32, 32, 4, 2)),
}
_FWD_FP32 = {
    64: ((64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2), (64, 16, 8, 2)),
    128: ((32, 16, 8, 2), (16, 32, 8, 2), (16, 64, 8, 1)),
    256: ((16, 32, 8, 2), (32, 16, 8, 2), (16, 16, 8, 2)),
}


def fwd_configs(head_dim: int, dtype: torch.dtype, interpret: bool = INTERPRET) -> list[triton.Config]:
    """The forward's autotuning configs for this head dim and dtype (with a value head size of
    its own, callers pass the wider of the two); under the interpreter (``interpret``) one small
    config."""
    if interpret:
        return [tile_config(*INTERPRET_TILES)]
    table = _FWD_FP32 if dtype == torch.float32 else _FWD_16BIT
    return [tile_config(*t) for t in table[config_width(head_dim)]]


def fwd_shared_bytes(config: triton.Config, width: int, element_size: int, v_width: int | None = None) -> int:
    """Estimated shared memory of a forward config: the q tile (``width``, q/k's tile width),
    ``max(2, num_stages)`` buffers of the streamed k tiles and v tiles (``v_width``, v's tile
    width, default ``width``) (compiled 16-bit tiles take num_stages on sm_90, one fewer on
    sm_80; fp32 ones about one), and the probability tile p staged for its product.
    tools/compile_kernels.py checks it is never below the compiled figure (it is 3-25% above
    for 16-bit tiles on sm_90, up to 2x for fp32)."""
    bm, bn, v_width = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], v_width or width
    return (bm * width + max(2, config.num_stages) * bn * (width + v_width) + bm * bn) * element_size


def _mask_n(args) -> bool:
    return bool(args["CAUSAL"]) or args["s_k"] % args["BLOCK_N"] != 0


_fwd = triton.heuristics({"MASK_N": _mask_n})(_fwd_kernel)  # no mask on an unmasked, whole-tile loop


def _tuned_fwd(head_dim: int, dtype: torch.dtype, v_dim: int | None = None):
    """The autotuned forward for a head dim, value head dim (default the same) and dtype: one
    autotuner per (head dim, value head dim, dtype), so V_DIM need not be in its key.
    ``triton.autotune`` times the configs that fit the GPU the first time it meets a key (head
    dim, causal, s_q and s_k rounded to powers of two, and the dtypes of the tensors) and
    caches the fastest per key for the process. Under MEGALITE_KERNEL_TUNING=fixed: one
    config, the first that fits the current GPU."""
    return _build_fwd(head_dim, v_dim or head_dim, dtype, fixed_limit())


@functools.lru_cache(maxsize=None)
def _build_fwd(head_dim: int, v_dim: int, dtype: torch.dtype, limit: int | None):
    width, v_width, size = block_d(head_dim), block_d(v_dim), dtype.itemsize
    nbytes = lambda c, element_size: fwd_shared_bytes(c, width, element_size, v_width)  # noqa: E731
    return autotune(fwd_configs(max(head_dim, v_dim), dtype), list(TUNING_KEY),
                    shared_memory_pruner("Q", nbytes, width_arg=None), lambda c: nbytes(c, size), limit)(_fwd)


@on_input_device
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                            q_offset: int = 0, k_offset: int = 0, scale: float | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            doc_start: torch.Tensor | None = None, doc_end: torch.Tensor | None = None,
                            tile_count: torch.Tensor | None = None, row_max: torch.Tensor | None = None):
    """(out, lse): out (b, heads, s_q, d_v) in q's dtype (d_v: v's head size, which may differ from
    q's and k's d), laid out (s_q, b, heads, d_v) in memory (module docstring), lse (b, heads, s_q) float32
    natural log; no autograd. q, k, v of any strides with a unit last stride are read in place
    (e.g. permuted views of a fused qkv); others are copied. Tiles: autotuned on a GPU (see
    ``fwd_configs``), or the ones given (``block_m``/``block_n``/``num_warps``/``num_stages``;
    what is not given comes from the first config). Packed documents: ``doc_start`` (b, s_q),
    absolute positions (``attention_reference``): key tiles wholly before a query tile's first
    document are skipped, so the work is the documents' causal squares, not the sequence's;
    ``doc_end`` is the backward's hint and unused here. ``tile_count``: an int32 tensor that
    gets one added per key tile computed (tests, benchmarks). ``row_max`` (QK-clip): a float32
    (b, heads, s_q) tensor that gets each query row's largest visible logit ``scale q.k``
    (-inf for a row that sees no key), the running max the online softmax keeps anyway."""
    check_attention_inputs(q, k, v)
    check_documents("flash_attention_forward", causal, q, k, doc_start, doc_end)
    q, k, v = unit_last_stride(q), seq_strided(k), seq_strided(v)  # q's offsets are int64
    b, heads, s_q, d = q.shape
    groups, s_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    config = None
    if block_m or block_n or num_warps or num_stages:
        config = explicit_config(fwd_configs(max(d, d_v), q.dtype), block_m, block_n, num_warps, num_stages)
    out = torch.empty((s_q, b, heads, d_v), device=q.device, dtype=q.dtype).permute(1, 2, 0, 3)
    lse = torch.empty((b, heads, s_q), device=q.device, dtype=torch.float32)
    if row_max is not None and (tuple(row_max.shape) != (b, heads, s_q) or row_max.dtype != torch.float32
                                or not row_max.is_contiguous()):
        raise ValueError(f"row_max must be a contiguous float32 {(b, heads, s_q)}, got "
                         f"{tuple(row_max.shape)} {row_max.dtype}.")
    if out.numel() == 0:
        if row_max is not None:
            row_max.fill_(float("-inf"))
        return out, lse.fill_(float("-inf"))
    grid = lambda meta: split_grid("flash_attention_forward", triton.cdiv(s_q, meta["BLOCK_M"]), b * heads)  # noqa
    launch_tiles(_fwd, None if config else _tuned_fwd(d, q.dtype, d_v), config, grid,
                 q, k, v, out, lse, document_starts(doc_start, k_offset, q), tile_counter(q, tile_count),
                 *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], s_q, s_k,
                 int(q_offset) - int(k_offset), scale * LOG2E, heads, groups, b * heads, seq_key(s_q), seq_key(s_k),
                 lse if row_max is None else row_max,  # (unused without ROW_MAX)
                 HEAD_DIM=d, V_DIM=d_v, BLOCK_D=block_d(d), BLOCK_DV=block_d(d_v), CAUSAL=bool(causal),
                 DOCS=doc_start is not None, ROW_MAX=row_max is not None,
                 COUNT=tile_count is not None, UPCAST=INTERPRET,
                 PREC="ieee" if q.dtype == torch.float32 else "tf32", GRID_Y=_utils.MAX_GRID_Y)
    return out, lse


def forward_tiles(doc_start: torch.Tensor | None, s: int, block_m: int, block_n: int) -> int:
    """Key tiles the causal forward computes for one (batch row, head) of a self-attention over
    ``s`` tokens (q_offset = k_offset = 0), by the kernel's own loop bounds: query tile m runs
    from the key tile holding its first row's document start to its diagonal. Without
    documents sum_m (m + 1); with documents about sum_d T_d (T_d + 1) / 2 over the documents'
    tiles. For benchmarks and the planner, on the host (``doc_start``: one row, any device)."""
    starts = None if doc_start is None else doc_start.reshape(-1).tolist()
    total = 0
    for start_m in range(0, s, block_m):
        hi = min(s, start_m + block_m)
        lo = 0 if starts is None else starts[start_m] // block_n * block_n
        total += -(-(hi - lo) // block_n)
    return total


class _FlashAttention(torch.autograd.Function):
    """Saves (q, k, v, out, lse); the backward recomputes the probabilities block by block.
    A gradient reaching lse enters as ``delta_i - dlse_i`` (d lse_i / d s_ij = p_ij), so
    partial attentions can be merged with ``merge_attention`` under autograd."""

    @staticmethod
    def forward(ctx, q, k, v, causal, q_offset, k_offset, scale, doc_start, doc_end, row_max=None):
        out, lse = flash_attention_forward(q, k, v, causal, q_offset, k_offset, scale,
                                           doc_start=doc_start, doc_end=doc_end, row_max=row_max)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # an unused lse brings no gradient, not zeros
        ctx.args = (causal, q_offset, k_offset, scale)
        ctx.documents = dict(doc_start=doc_start, doc_end=doc_end)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = flash_attention_backward(q, k, v, out, dout, lse, *ctx.args, dlse=dlse, **ctx.documents)
        return dq, dk, dv, None, None, None, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    q_offset: int = 0, k_offset: int = 0, softmax_scale: float | None = None,
                    return_lse: bool = False, doc_start: torch.Tensor | None = None,
                    doc_end: torch.Tensor | None = None, row_max: torch.Tensor | None = None):
    """softmax(scale q k^T + mask) v with autograd; ``(out, lse)`` when ``return_lse``.
    ``doc_start`` / ``doc_end``: packed documents; ``row_max``: each row's largest visible
    logit, written (``flash_attention_forward``)."""
    out, lse = _FlashAttention.apply(q, k, v, causal, q_offset, k_offset, softmax_scale, doc_start, doc_end,
                                     row_max)
    return (out, lse) if return_lse else out
