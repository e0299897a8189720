"""Flash attention backward in Triton, from the saved log-sum-exp (no stored probabilities).

With ``p_ij = exp(s_ij - lse_i)``, ``s_ij = scale q_i . k_j`` over visible keys (q_i, k_j of the
q/k head size d; v_j, o_i, do_i of the value head size d_v, which may differ: dq and dk come
back of size d, dv of size d_v; delta is a row sum over d_v):

    dv_j = sum_i p_ij do_i
    dp_ij = do_i . v_j
    ds_ij = p_ij (dp_ij - delta_i),   delta_i = do_i . o_i  (= sum_j p_ij dp_ij)
    dq_i = scale sum_j ds_ij k_j,     dk_j = scale sum_i ds_ij q_i

Three kernels: ``delta`` (row sums of do * o), ``dk/dv`` (one program per key block,
looping over the query blocks of every query head of its group, so GQA sums inside the
program, no atomics) and ``dq`` (one program per query block, looping over key blocks).
They take the (batch, head, sequence) strides of q, k, v, out, dout and the (batch, head)
strides of lse and delta: inputs with a unit last stride are read in place (the model's
views of a fused qkv, ring attention's chunks along the sequence); gradients are contiguous.

Tiles, as for the forward (``flash_attention.py``): on a GPU each of the three kernels is
autotuned over its own few configs per dtype class and tile width (``dkdv_configs``,
``dq_configs``, ``delta_configs``, in ``attention_bwd_tiles.py``), pruned by the device's shared memory (the
``*_shared_bytes`` estimates, checked against the compiled figures by
tools/compile_kernels.py), keyed on (head dim, causal, s_q and s_k rounded up to powers of
two, dtypes) and cached by ``triton.autotune`` per key (one config under
MEGALITE_KERNEL_TUNING=fixed); one small config under the interpreter; explicit tiles bypass
the autotuner. Grids are (tiles, b * heads) (dk/dv: b * groups), the second spilling onto a
third axis past CUDA's 65,535 (``_utils.split_grid``).

Ring attention: the pair (q block, k/v block) may be any piece of a longer attention. Pass
the *global* lse and the global out and do (or their ``delta``), and the result is that
pair's exact contribution to dq, dk, dv: sum it over the key/value blocks. A gradient on
lse itself (when partial results were merged under autograd) enters as ``delta - dlse``.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from megalite.kernels import _utils
from megalite.kernels._utils import (INTERPRET, autotune, block_d, check_attention_inputs, check_backward_shapes,
                                     document_starts, explicit_config, fixed_limit, tile_counter, launch_tiles,
                                     on_input_device, seq_key, seq_strided, shared_memory_pruner, split_grid,
                                     unit_last_stride)
from megalite.kernels.attention_bwd_tiles import (delta_configs, delta_shared_bytes, dkdv_configs,  # noqa: F401
                                                  dkdv_shared_bytes, dq_configs, dq_shared_bytes)
from megalite.kernels.attention_reference import check_documents

LOG2E = 1.4426950408889634
TUNING_KEY = ("HEAD_DIM", "CAUSAL", "DOCS", "SQ_KEY", "SK_KEY")  # + the tensors' dtypes, added by triton.autotune


@triton.jit(do_not_specialize=["n_bh"])  # b * heads: no variant per value class
def _delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_os, stride_db, stride_dh, stride_ds, s_q, heads,
                  n_bh, SQ_KEY, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  GRID_Y: tl.constexpr):
    bh = tl.program_id(1) + tl.program_id(2) * GRID_Y  # (batch, head): axes 1 and 2 (split_grid)
    if bh >= n_bh:
        return
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < s_q) & (offs_d[None, :] < HEAD_DIM)
    r64 = rows.to(tl.int64)[:, None]
    o = tl.load(O + b * stride_ob + h * stride_oh + r64 * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + r64 * stride_ds + offs_d[None, :], mask=mask, other=0.0)
    prod = o.to(tl.float32) * do.to(tl.float32)
    row_sums = tl.reduce(prod, 1, tl.standard._sum_combine)
    tl.store(DELTA + bh.to(tl.int64) * s_q + rows, row_sums, mask=rows < s_q)


@triton.jit(do_not_specialize=["n_bg"])  # b * groups: no variant per value class
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DS, DE, TILES, DK, DV, stride_qb, stride_qh, stride_qs, stride_kb,
                 stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os, stride_lb,
                 stride_lh, stride_eb, stride_eh, s_q, s_k, delta_pos, qk_scale, scale, heads, groups, n_bg,
                 SQ_KEY, SK_KEY, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 CAUSAL: tl.constexpr, DOCS: tl.constexpr, COUNT: tl.constexpr,
                 UPCAST: tl.constexpr, PREC: tl.constexpr, GRID_Y: tl.constexpr):
    # One program: BLOCK_N keys of group g of batch b, over the query blocks of the group's
    # heads. stride_o*: dout's; stride_l*, stride_e*: lse's and delta's (sequence stride 1).
    # DOCS: DS per query row its document's first key index, DE per key its document's end
    # as a query index (no query from there on sees it). TILES (COUNT): one per query tile.
    # HEAD_DIM (BLOCK_D): q's, k's and dk's head size; V_DIM (BLOCK_DV): v's, do's and dv's.
    start_n = tl.program_id(0) * BLOCK_N
    bg = tl.program_id(1) + tl.program_id(2) * GRID_Y  # (batch, group): axes 1 and 2 (split_grid)
    if bg >= n_bg:
        return
    b = (bg // groups).to(tl.int64)
    g = (bg % groups).to(tl.int64)
    per_group = heads // groups
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < V_DIM
    k_mask = (offs_n[:, None] < s_k) & d_ok
    v_mask = (offs_n[:, None] < s_k) & dv_ok
    n64 = offs_n.to(tl.int64)[:, None]
    k_ptrs = K + b * stride_kb + g * stride_kh + n64 * stride_ks + offs_d[None, :]
    v_ptrs = V + b * stride_vb + g * stride_vh + n64 * stride_vs + offs_dv[None, :]
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    q_rel = offs_m0[:, None] * stride_qs + offs_d[None, :]  # within a query block; int32 is enough
    do_rel = offs_m0[:, None] * stride_os + offs_dv[None, :]
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
    lo = 0
    if CAUSAL:  # query i sees key start_n iff i >= start_n - delta_pos
        lo = tl.maximum(start_n - delta_pos, 0) // BLOCK_M * BLOCK_M
    hi = s_q
    if DOCS:  # keys' document ends never decrease: the tile's last key's document ends last
        last = tl.minimum(start_n + BLOCK_N, s_k) - 1
        hi = tl.maximum(tl.minimum(tl.load(DE + b * s_k + last), s_q), 0)
    for hq in range(0, per_group):
        h = g * per_group + hq
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_ob + h * stride_oh
        lse_base = LSE + b * stride_lb + h * stride_lh
        dlt_base = DELTA + b * stride_eb + h * stride_eh
        for start_m in range(lo, hi, BLOCK_M):
            if COUNT:
                tl.atomic_add(TILES, 1)
            offs_m = start_m + offs_m0
            m_ok = offs_m[:, None] < s_q
            row0 = tl.cast(start_m, tl.int64)
            q = tl.load(q_base + row0 * stride_qs + q_rel, mask=m_ok & d_ok, other=0.0)
            do = tl.load(do_base + row0 * stride_os + do_rel, mask=m_ok & dv_ok, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_base + offs_m, mask=offs_m < s_q, other=0.0)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            dlt = tl.load(dlt_base + offs_m, mask=offs_m < s_q, other=0.0)
            visible = (offs_m[None, :] < s_q) & (offs_n[:, None] < s_k)
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + delta_pos)
            if DOCS:
                doc_row = tl.load(DS + b * s_q + offs_m, mask=offs_m < s_q, other=0)
                visible = visible & (offs_n[:, None] >= doc_row[None, :])
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (BLOCK_N, BLOCK_M)
            p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds_t = p_t * (dp_t - dlt[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)
    # contiguous; the tile's base in int64, its rows (BLOCK_N x HEAD_DIM or V_DIM) in int32
    rows = bg.to(tl.int64) * s_k + start_n
    out = rows * HEAD_DIM + tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=k_mask)
    out = rows * V_DIM + tl.arange(0, BLOCK_N)[:, None] * V_DIM + offs_dv[None, :]
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit(do_not_specialize=["n_bh"])  # b * heads: no variant per value class
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DS, DE, TILES, DQ, stride_qb, stride_qh, stride_qs, stride_kb,
               stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os, stride_lb,
               stride_lh, stride_eb, stride_eh, s_q, s_k, delta_pos, qk_scale, scale, heads, groups, n_bh,
               SQ_KEY, SK_KEY, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               CAUSAL: tl.constexpr, DOCS: tl.constexpr, COUNT: tl.constexpr,
               UPCAST: tl.constexpr, PREC: tl.constexpr, GRID_Y: tl.constexpr):
    # DS, DE, TILES as in the dk/dv kernel (DE unused here): the forward's key-tile bounds.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1) + tl.program_id(2) * GRID_Y  # (batch, head): axes 1 and 2 (split_grid)
    if bh >= n_bh:
        return
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    g = (h // (heads // groups)).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < V_DIM
    q_mask = (offs_m[:, None] < s_q) & d_ok
    m64 = offs_m.to(tl.int64)[:, None]
    q_ptrs = Q + b * stride_qb + h * stride_qh + m64 * stride_qs + offs_d[None, :]
    do_ptrs = DO + b * stride_ob + h * stride_oh + m64 * stride_os + offs_dv[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    do = tl.load(do_ptrs, mask=(offs_m[:, None] < s_q) & dv_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_m, mask=offs_m < s_q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dlt = tl.load(DELTA + b * stride_eb + h * stride_eh + offs_m, mask=offs_m < s_q, other=0.0)
    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    k_rel = offs_n0[:, None] * stride_ks + offs_d[None, :]  # within a key block; int32 is enough
    v_rel = offs_n0[:, None] * stride_vs + offs_dv[None, :]
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    hi = s_k
    if CAUSAL:
        hi = tl.maximum(tl.minimum(s_k, start_m + BLOCK_M + delta_pos), 0)
    lo = 0
    if DOCS:  # as in the forward: from the tile's first row's document start
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
        visible = (offs_n[None, :] < s_k) & (offs_m[:, None] < s_q)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + delta_pos)
        if DOCS:
            visible = visible & (offs_n[None, :] >= doc_row[:, None])
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - dlt[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    # contiguous; the tile's base in int64, its rows (BLOCK_M x HEAD_DIM) in int32
    out = (bh.to(tl.int64) * s_q + start_m) * HEAD_DIM + tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


# The configurations and their shared-memory estimates: attention_bwd_tiles.py.


def _tuned(kind: str, head_dim: int, dtype: torch.dtype, v_dim: int | None = None):
    """The autotuned ``kind`` kernel ("dkdv", "dq" or "delta") for a head dim (q/k's; delta's is
    out's), a value head dim ``v_dim`` (default the same) and dtype: one autotuner per (head
    dim, value head dim, dtype), so V_DIM need not be in its key.
    ``triton.autotune`` times the configs that fit the GPU's shared memory the first time it
    meets a key (head dim, causal, s_q and s_k rounded to powers of two, and the tensors'
    dtypes) and caches the fastest per key for the process. Under
    MEGALITE_KERNEL_TUNING=fixed: one config, the first that fits the current GPU."""
    return _build(kind, head_dim, v_dim or head_dim, dtype, fixed_limit())


@functools.lru_cache(maxsize=None)
def _build(kind: str, head_dim: int, v_dim: int, dtype: torch.dtype, limit: int | None):
    width, v_width, size = block_d(head_dim), block_d(v_dim), dtype.itemsize
    if kind == "delta":
        fn, configs, key, tensor = _delta_kernel, delta_configs(head_dim, dtype), ["HEAD_DIM", "SQ_KEY"], "O"
        nbytes = lambda c, element_size: delta_shared_bytes(c, width, element_size)  # noqa: E731
    else:
        fn, configs, shared = ((_dkdv_kernel, dkdv_configs, dkdv_shared_bytes) if kind == "dkdv"
                               else (_dq_kernel, dq_configs, dq_shared_bytes))
        configs, key, tensor = configs(max(head_dim, v_dim), dtype), list(TUNING_KEY), "Q"
        nbytes = lambda c, element_size: shared(c, width, element_size, v_width)  # noqa: E731
    return autotune(configs, key, shared_memory_pruner(tensor, nbytes, width_arg=None),
                    lambda c: nbytes(c, size), limit)(fn)


@on_input_device
def attention_delta(out: torch.Tensor, dout: torch.Tensor, *, block_m: int | None = None,
                    num_warps: int | None = None) -> torch.Tensor:
    """delta_i = sum_d do_id o_id in float32, shape out.shape[:-1]. 4-D (b, heads, s, d) inputs
    with a unit last stride are read in place; rows per program autotuned (or ``block_m``)."""
    if out.shape != dout.shape:
        raise ValueError(f"attention_delta: out {tuple(out.shape)} and dout {tuple(dout.shape)} must match.")
    shape = out.shape
    if out.dim() != 4:
        out, dout = out.reshape(1, 1, -1, shape[-1]), dout.reshape(1, 1, -1, shape[-1])
    out, dout = unit_last_stride(out), unit_last_stride(dout)
    b, heads, s, d = out.shape
    delta = torch.empty((b, heads, s), device=out.device, dtype=torch.float32)
    if delta.numel():
        config = None
        if block_m or num_warps:
            first = delta_configs(d, out.dtype)[0]
            config = triton.Config(dict(BLOCK_M=block_m or first.kwargs["BLOCK_M"]),
                                   num_warps=num_warps or first.num_warps, num_stages=1)
        grid = lambda meta: split_grid("attention_delta", triton.cdiv(s, meta["BLOCK_M"]), b * heads)  # noqa: E731
        launch_tiles(_delta_kernel, None if config else _tuned("delta", d, out.dtype), config, grid,
                     out, dout, delta, *out.stride()[:3], *dout.stride()[:3], s, heads, b * heads, seq_key(s),
                     HEAD_DIM=d, BLOCK_D=block_d(d), GRID_Y=_utils.MAX_GRID_Y)
    return delta.view(shape[:-1])


def _seq_strides(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(t, stride_b, stride_h) of a (b, heads, s) float32 tensor with a unit sequence stride."""
    t = t.float()
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


@on_input_device
def flash_attention_backward(q, k, v, out, dout, lse, causal: bool = True, q_offset: int = 0,
                             k_offset: int = 0, scale: float | None = None, *, delta=None,
                             dlse=None, block_m: int | None = None, block_n: int | None = None,
                             num_warps: int | None = None, num_stages: int | None = None,
                             grad_dtype: torch.dtype | None = None, doc_start: torch.Tensor | None = None,
                             doc_end: torch.Tensor | None = None, tile_count: torch.Tensor | None = None):
    """(dq, dk, dv) for one (q, k/v) pair given the global ``lse`` (b, heads, s_q) and either
    the global ``out``/``dout`` or their precomputed ``delta`` (see module docstring).
    Gradients come back contiguous in the inputs' dtypes, or in ``grad_dtype`` (ring attention
    asks for float32: it sums C blocks' contributions, and rounding each to 16 bits first would
    add C roundings; the kernels accumulate in fp32 either way); dk, dv summed over each group's
    query heads. q, k, v, out, dout (and lse, delta) of any strides with a unit last stride are
    read in place. Tiles: autotuned on a GPU per kernel (``dkdv_configs``, ``dq_configs``), or
    the ones given, for both kernels (what is not given comes from each kernel's first config).
    Packed documents: ``doc_start`` (b, s_q) and ``doc_end`` (b, s_k), absolute positions
    (``attention_reference``); the dq kernel skips key tiles before a query tile's first
    document, the dk/dv kernel query tiles past its last key's document end (without
    ``doc_end`` it only masks). ``tile_count``: one added per tile pair computed, both kernels."""
    check_attention_inputs(q, k, v)
    check_backward_shapes("flash_attention_backward", q, out, dout, lse, delta, v.shape[3])
    check_documents("flash_attention_backward", causal, q, k, doc_start, doc_end)
    q, k, v, dout = seq_strided(q), seq_strided(k), seq_strided(v), seq_strided(dout)
    b, heads, s_q, d = q.shape
    groups, s_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if delta is None:
        delta = attention_delta(out, dout)
    if dlse is not None:
        delta = delta - dlse.float()
    (lse, *lse_strides), (delta, *delta_strides) = _seq_strides(lse), _seq_strides(delta)
    dq = torch.empty((b, heads, s_q, d), device=q.device, dtype=grad_dtype or q.dtype)
    dk = torch.empty((b, groups, s_k, d), device=k.device, dtype=grad_dtype or k.dtype)
    dv = torch.empty((b, groups, s_k, d_v), device=v.device, dtype=grad_dtype or v.dtype)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    explicit = bool(block_m or block_n or num_warps or num_stages)
    if doc_start is not None and doc_end is None:  # no skip hint: every query from the diagonal on
        doc_end = torch.full((b, s_k), s_q + int(q_offset), dtype=torch.int32, device=q.device)
    tensors = (q, k, v, dout, lse, delta, document_starts(doc_start, k_offset, q),
               document_starts(doc_end, q_offset, q), tile_counter(q, tile_count))
    args = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lse_strides,
            *delta_strides, s_q, s_k, int(q_offset) - int(k_offset), scale * LOG2E, scale, heads, groups)
    keys = (seq_key(s_q), seq_key(s_k))
    consts = dict(HEAD_DIM=d, V_DIM=d_v, BLOCK_D=block_d(d), BLOCK_DV=block_d(d_v), CAUSAL=bool(causal),
                  DOCS=doc_start is not None,
                  COUNT=tile_count is not None, UPCAST=INTERPRET,
                  PREC="ieee" if q.dtype == torch.float32 else "tf32", GRID_Y=_utils.MAX_GRID_Y)
    tiles = (block_m, block_n, num_warps, num_stages)
    config = explicit_config(dkdv_configs(max(d, d_v), q.dtype), *tiles) if explicit else None
    grid = lambda meta: split_grid("attention dk/dv", triton.cdiv(s_k, meta["BLOCK_N"]), b * groups)  # noqa: E731
    launch_tiles(_dkdv_kernel, None if config else _tuned("dkdv", d, q.dtype, d_v), config, grid,
                 *tensors, dk, dv, *args, b * groups, *keys, **consts)
    config = explicit_config(dq_configs(max(d, d_v), q.dtype), *tiles) if explicit else None
    grid = lambda meta: split_grid("attention dq", triton.cdiv(s_q, meta["BLOCK_M"]), b * heads)  # noqa: E731
    launch_tiles(_dq_kernel, None if config else _tuned("dq", d, q.dtype, d_v), config, grid,
                 *tensors, dq, *args, b * heads, *keys, **consts)
    return dq, dk, dv
