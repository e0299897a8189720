"""Grouped GEMM in Triton for mixture-of-experts expert MLPs: forward and backward, one launch
each, with the torch loop of matmuls as the reference.

Rows ``x`` (N, K) are sorted by group (expert): group e owns rows ``[o_e, o_{e+1})`` with
offsets ``o_0 = 0``, ``o_{e+1} = o_e + c_e``, ``o_E = N`` (c_e rows, possibly 0). The weights
``w`` (E, Nout, K) are stacked in ``nn.Linear`` layout (out x in). Per group e:

    forward:   y[o_e:o_{e+1}]  = x[o_e:o_{e+1}] @ w[e]^T                     (N, Nout)
    backward:  dx[o_e:o_{e+1}] = dy[o_e:o_{e+1}] @ w[e]                      (N, K)
               dw[e]           = dy[o_e:o_{e+1}]^T @ x[o_e:o_{e+1}]          (Nout, K)

An empty group costs nothing forward and gets dw[e] = 0 (never None).

Tile assignment (``_gmm_kernel``, used for y and dx): the row tiles of all groups form one
list, group by group: group e has ``t_e = ceil(c_e / BLOCK_M)`` tiles (none when empty) and
they are numbered from ``T_e = t_0 + ... + t_{e-1}``. Every program loads the E + 1 offsets
(a device tensor), takes the prefix sum ``T`` with ``tl.cumsum`` and finds the group of its
row tile m as ``e = #{e' : T_{e'+1} <= m}`` (a vectorized search over E values, cheap next to
the tile's matmul); the tile covers rows ``o_e + (m - T_e) BLOCK_M`` up to at most ``o_{e+1}``
(rows of the next group are masked). So one launch serves every group, and nothing on the
host needs the counts: the grid is ``sum_e t_e`` row tiles times ``ceil(Nout / BLOCK_N)``
column tiles when the counts are host ints, or the bound ``floor((N + E (BLOCK_M - 1)) /
BLOCK_M)`` row tiles when only a device tensor is given (programs past the real tiles
return at once). Program ids are swizzled in bands of ``GROUP_M`` row tiles so that
neighbouring programs share weight and row tiles in L2. dx uses the same kernel with the
weight read transposed (``w.transpose(1, 2)``, passed by its strides).

dw (``_gmm_dw_kernel``): a grid of Nout x K output tiles times E (one axis: E may pass CUDA's
65,535 cap of axis 1); each program walks over its
group's rows in steps of BLOCK_M, accumulating ``dy_tile^T @ x_tile`` in fp32, and stores its
tile (zeros for an empty group). No atomics: every dw element is written by one program.

Accumulation in fp32; inputs fp32, fp16 or bf16 (x and w of one dtype; outputs in that
dtype). Under the CPU interpreter every load is upcast to fp32 (bf16 is wrong there
otherwise); on a GPU 16-bit tiles go to the tensor cores as they are and fp32 tiles use exact
("ieee") products, as torch's default fp32 matmul (TF32 off). Tiles: one small config under
the interpreter; on a GPU a few ``triton.autotune`` configs keyed on (Nout, K, rows per group
rounded to a power of two), pruned to those whose pipelined tiles fit the device's shared
memory (sm_80/sm_90 keep all; GPUs with ~100 KB or less keep the smaller ones); under
MEGALITE_KERNEL_TUNING=fixed the first config that fits, alone.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megalite.kernels._utils import (INTERPRET, autotune, check_float, check_grid, check_tensors, fixed_limit,
                                     next_power_of_2, on_input_device, shared_memory_pruner)


@triton.jit
def _gmm_kernel(X, W, Y, OFFSETS, n_groups, N_OUT, K, stride_we, stride_wn, stride_wk, M_HINT,
                BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
                PREC: tl.constexpr):
    # y[r, n] = sum_k x[r, k] W[e, n, k] for the rows r of group e; W given by its strides.
    # M_HINT (rows per group, rounded) is only an autotuning key.
    grp = tl.arange(0, BLOCK_E)
    in_range = grp < n_groups
    start = tl.load(OFFSETS + grp, mask=in_range, other=0)
    end = tl.load(OFFSETS + grp + 1, mask=in_range, other=0)
    tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)                     # T_{e+1}
    tiles_m = tl.reduce(tiles, 0, tl.standard._sum_combine)
    tiles_n = tl.cdiv(N_OUT, BLOCK_N)
    pid = tl.program_id(0)
    if pid >= tiles_m * tiles_n:                        # past the real tiles (device counts)
        return
    band = GROUP_M * tiles_n                            # swizzle: GROUP_M row tiles per band
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % band) % band_m
    tile_n = (pid % band) // band_m
    g = tl.reduce((tiles_end <= tile_m).to(tl.int32), 0, tl.standard._sum_combine)
    own = grp == g
    row0 = tl.reduce(tl.where(own, start + (tile_m - tiles_end + tiles) * BLOCK_M, 0), 0,
                     tl.standard._sum_combine)
    row_end = tl.reduce(tl.where(own, end, 0), 0, tl.standard._sum_combine)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    x_rows = X + rows.to(tl.int64)[:, None] * K
    w_cols = W + g.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks.to(tl.int64)[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PREC)
    tl.store(Y + rows.to(tl.int64)[:, None] * N_OUT + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gmm_dw_kernel(DY, X, DW, OFFSETS, N_OUT, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    # dw[e, n, k] = sum over the rows r of group e of dy[r, n] x[r, k]. One grid axis: program
    # pid is output tile pid % (tiles_n tiles_k) of group pid // (tiles_n tiles_k).
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(N_OUT, BLOCK_N) * tiles_k
    pid = tl.program_id(0)
    g = pid // tiles
    tile_n = (pid % tiles) // tiles_k
    tile_k = (pid % tiles) % tiles_k
    row0 = tl.load(OFFSETS + g)
    row_end = tl.load(OFFSETS + g + 1)
    ns = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = ns < N_OUT
    k_ok = ks < K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for m0 in range(row0, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        dy_t = tl.load(DY + rows.to(tl.int64)[None, :] * N_OUT + ns[:, None],
                       mask=n_ok[:, None] & row_ok[None, :], other=0.0)      # (BLOCK_N, BLOCK_M)
        x = tl.load(X + rows.to(tl.int64)[:, None] * K + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)         # (BLOCK_M, BLOCK_K)
        if UPCAST:
            dy_t = dy_t.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(dy_t, x, input_precision=PREC)
    tl.store(DW + g.to(tl.int64) * N_OUT * K + ns.to(tl.int64)[:, None] * K + ks[None, :],
             acc.to(DW.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


# -- configurations ------------------------------------------------------------------------------

def _config(bm: int, bn: int, bk: int, warps: int, stages: int, **extra) -> triton.Config:
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **extra), num_warps=warps,
                         num_stages=stages)


def mm_configs(dtype: torch.dtype) -> list[triton.Config]:
    """Tiles of ``_gmm_kernel`` (y and dx): BLOCK_M rows x BLOCK_N outputs, BLOCK_K deep.
    16-bit: the two largest fit only sm_80/sm_90 shared memory (~144, 128 KB pipelined);
    fp32 ("ieee" products, FMA) smaller tiles."""
    if INTERPRET:
        return [_config(32, 32, 32, 1, 1, GROUP_M=4)]
    if dtype == torch.float32:
        return [_config(*c, GROUP_M=8) for c in ((64, 64, 32, 4, 3), (128, 64, 32, 4, 3),
                                                 (64, 128, 32, 4, 3))]
    return [_config(*c, GROUP_M=8) for c in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4),
                                             (128, 128, 32, 4, 4), (64, 128, 32, 4, 4),
                                             (64, 64, 64, 4, 3))]


def dw_configs(dtype: torch.dtype) -> list[triton.Config]:
    """Tiles of ``_gmm_dw_kernel``: a BLOCK_N x BLOCK_K tile of dw[e], BLOCK_M rows per step."""
    if INTERPRET:
        return [_config(32, 32, 32, 1, 1)]
    if dtype == torch.float32:
        return [_config(*c) for c in ((32, 64, 64, 4, 3), (32, 128, 64, 4, 3), (32, 64, 128, 4, 3))]
    return [_config(*c) for c in ((64, 128, 128, 8, 3), (32, 128, 128, 4, 4), (64, 128, 64, 4, 3),
                                  (64, 64, 64, 4, 3))]


def shared_bytes(config: triton.Config, element_size: int) -> int:
    """Estimated shared memory of a config: num_stages buffers of one row tile and one weight
    (or x) tile."""
    kw = config.kwargs
    if "GROUP_M" in kw:
        tiles = kw["BLOCK_M"] * kw["BLOCK_K"] + kw["BLOCK_K"] * kw["BLOCK_N"]
    else:
        tiles = kw["BLOCK_N"] * kw["BLOCK_M"] + kw["BLOCK_M"] * kw["BLOCK_K"]
    return config.num_stages * tiles * element_size


# Early pruning for the autotuner: the configs whose pipelined tiles fit the GPU of X. Triton
# calls it with a list and a dict (unhashable: no lru_cache here; the limit is cached per device).
_fitting = shared_memory_pruner("X", shared_bytes, width_arg=None)


def _tuned(kind: str, dtype: torch.dtype):
    """The autotuned kernel for ``kind`` ("mm" or "dw") and a dtype (one config under the
    interpreter: the autotuner then runs it without benchmarking). Under
    MEGALITE_KERNEL_TUNING=fixed: one config, the first that fits the current GPU."""
    return _build(kind, dtype, fixed_limit())


@functools.lru_cache(maxsize=None)
def _build(kind: str, dtype: torch.dtype, limit: int | None):
    if kind == "mm":
        fn, configs, key = _gmm_kernel, mm_configs(dtype), ["N_OUT", "K", "M_HINT", "stride_wk"]
    else:
        fn, configs, key = _gmm_dw_kernel, dw_configs(dtype), ["N_OUT", "K"]
    return autotune(configs, key, _fitting, lambda c: shared_bytes(c, dtype.itemsize), limit)(fn)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # 16-bit inputs: ignored by tl.dot


# -- launchers -----------------------------------------------------------------------------------

def group_offsets(counts_or_offsets, n_groups: int, n_rows: int, device) -> tuple[torch.Tensor, tuple | None]:
    """(offsets, counts): offsets an int32 tensor of n_groups + 1 on ``device``, counts the host
    ints when they are known without a device sync (else None).

    ``counts_or_offsets``: a sequence or 1-D integer tensor of n_groups counts, or of
    n_groups + 1 offsets (0, ..., n_rows). Host values are checked; a tensor already on a GPU
    is trusted (checking it would wait for the GPU)."""
    values = counts_or_offsets
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"grouped_linear: group counts must be a 1-D integer tensor, got "
                             f"{values.dtype} of shape {tuple(values.shape)}.")
        if values.device.type != "cpu":
            if values.numel() not in (n_groups, n_groups + 1):
                raise ValueError(f"grouped_linear: {values.numel()} group counts for {n_groups} groups "
                                 f"(expected {n_groups} counts or {n_groups + 1} offsets).")
            v = values.to(device=device, dtype=torch.int32)
            if v.numel() == n_groups:
                v = F.pad(torch.cumsum(v, 0, dtype=torch.int32), (1, 0))
            return v.contiguous(), None
        values = values.tolist()
    values = [int(v) for v in values]
    if len(values) == n_groups:
        counts = values
    elif len(values) == n_groups + 1 and values[0] == 0:
        counts = [b - a for a, b in zip(values[:-1], values[1:])]
    else:
        raise ValueError(f"grouped_linear: {len(values)} group counts for {n_groups} groups (expected "
                         f"{n_groups} counts, or {n_groups + 1} offsets starting at 0).")
    if min(counts, default=0) < 0 or sum(counts) != n_rows:
        raise ValueError(f"grouped_linear: group counts {counts} must be >= 0 and sum to the {n_rows} rows.")
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    host = torch.tensor(offsets, dtype=torch.int32)
    if torch.device(device).type == "cuda":  # pinned + non_blocking: no wait for the GPU
        return host.pin_memory().to(device, non_blocking=True), tuple(counts)
    return host.to(device), tuple(counts)


def _check(what: str, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    check_tensors(what, x, w, offsets)
    check_float(what, x, w)
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"{what}: expected x (N, K) and w (E, Nout, K), got x {tuple(x.shape)} and "
                         f"w {tuple(w.shape)}.")
    if x.dtype != w.dtype:
        raise TypeError(f"{what}: x and w must share a dtype, got {x.dtype} and {w.dtype}.")
    if offsets.shape != (w.shape[0] + 1,) or offsets.dtype != torch.int32:
        raise ValueError(f"{what}: offsets must be int32 of shape ({w.shape[0] + 1},), got "
                         f"{offsets.dtype} {tuple(offsets.shape)} (see group_offsets).")


@on_input_device
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                   counts: tuple | None = None) -> torch.Tensor:
    """y (N, Nout) with ``y[o_e:o_{e+1}] = x[o_e:o_{e+1}] @ w[e]^T``; w (E, Nout, K) of any
    strides (``w.transpose(1, 2)`` gives the dx product). No autograd. ``counts`` (host ints),
    when given, sizes the grid exactly."""
    _check("grouped_matmul", x, w, offsets)
    x = x.contiguous()
    n, k = x.shape
    n_groups, n_out = w.shape[0], w.shape[1]
    y = torch.empty((n, n_out), device=x.device, dtype=x.dtype)
    if n == 0 or n_out == 0:
        return y
    if k == 0:
        return y.zero_()

    def grid(meta):
        bm = meta["BLOCK_M"]
        tiles_m = (sum((c + bm - 1) // bm for c in counts) if counts is not None
                   else (n + n_groups * (bm - 1)) // bm)
        return check_grid("grouped_matmul", (tiles_m * triton.cdiv(n_out, meta["BLOCK_N"]),))

    _tuned("mm", x.dtype)[grid](
        x, w, y, offsets, n_groups, n_out, k, w.stride(0), w.stride(1), w.stride(2),
        min(4096, next_power_of_2(max(1, n // n_groups))), BLOCK_E=max(16, next_power_of_2(n_groups)),
        UPCAST=INTERPRET, PREC=_precision(x.dtype))
    return y


@on_input_device
def grouped_weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dw (E, Nout, K) with ``dw[e] = dy[o_e:o_{e+1}]^T @ x[o_e:o_{e+1}]`` (zero for an empty
    group), in x's dtype; E = len(offsets) - 1."""
    check_tensors("grouped_weight_grad", dy, x, offsets)
    check_float("grouped_weight_grad", dy, x)
    dy, x = dy.contiguous(), x.contiguous()
    n_groups, (n, n_out), k = offsets.numel() - 1, dy.shape, x.shape[1]
    if x.shape[0] != n or dy.dtype != x.dtype:
        raise ValueError(f"grouped_weight_grad: dy {tuple(dy.shape)} {dy.dtype} and x {tuple(x.shape)} "
                         f"{x.dtype} must have the same rows and dtype.")
    if n == 0 or n_out == 0 or k == 0:
        return torch.zeros((n_groups, n_out, k), device=x.device, dtype=x.dtype)
    dw = torch.empty((n_groups, n_out, k), device=x.device, dtype=x.dtype)
    grid = lambda meta: check_grid("grouped_weight_grad", (  # noqa: E731
        triton.cdiv(n_out, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"]) * n_groups,))
    _tuned("dw", x.dtype)[grid](dy, x, dw, offsets, n_out, k, UPCAST=INTERPRET, PREC=_precision(x.dtype))
    return dw


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, counts):
        ctx.save_for_backward(x, w, offsets)
        ctx.counts = counts
        return grouped_matmul(x, w, offsets, counts)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_matmul(dy, w.transpose(1, 2), offsets, ctx.counts) if ctx.needs_input_grad[0] else None
        dw = grouped_weight_grad(dy, x, offsets) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts_or_offsets) -> torch.Tensor:
    """``y[rows of e] = F.linear(x[rows of e], w[e])`` for rows x (N, K) sorted by group and
    stacked weights w (E, Nout, K), with autograd; returns (N, Nout).

    ``counts_or_offsets``: E counts or E + 1 offsets, host ints (a list, or a CPU tensor) or a
    GPU tensor (no host sync; the grid is then sized by a bound). Build the offsets once with
    :func:`group_offsets` to reuse them across calls."""
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_linear: expected x (N, K) and w (E, Nout, K), got x "
                         f"{tuple(x.shape)} and w {tuple(w.shape)}.")
    offsets, counts = group_offsets(counts_or_offsets, w.shape[0], x.shape[0], x.device)
    return _GroupedLinear.apply(x, w, offsets, counts)


def grouped_linear_reference(x: torch.Tensor, w: torch.Tensor, counts_or_offsets) -> torch.Tensor:
    """The torch loop: one ``F.linear`` per group (empty ones too, so every w[e] gets a
    gradient, zero when the group has no rows)."""
    offsets, _ = group_offsets(counts_or_offsets, w.shape[0], x.shape[0], "cpu")
    bounds = offsets.tolist()
    return torch.cat([F.linear(x[a:b], w[e]) for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
