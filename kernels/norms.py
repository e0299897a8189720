"""Fused LayerNorm and RMSNorm in Triton, forward and backward, with torch references.

Per row x of n features (statistics in fp32, output in x's dtype):

    LayerNorm: mu = mean(x), rstd = 1 / sqrt(mean((x - mu)^2) + eps), xhat = (x - mu) rstd,
               y = xhat w + b
    RMSNorm:   rstd = 1 / sqrt(mean(x^2) + eps), xhat = x rstd, y = xhat w

Backward with g = w dy (elementwise), c1 = mean(xhat g), c2 = mean(g):

    LayerNorm: dx = rstd (g - xhat c1 - c2)      RMSNorm: dx = rstd (g - xhat c1)
    dw = sum_rows dy xhat,  db = sum_rows dy

Up to ``WHOLE_ROW_MAX`` features, each program step takes a tile of rows, each row whole in
one padded block (not only powers of two); the backward's programs walk over row tiles keeping
fp32 partial sums of dw, db in registers. Wider rows (hidden sizes of 16k and more) would spill
registers that way: there one program walks one row in column chunks of ``CHUNK`` (mean, then
squared deviations, then y; in backward c1/c2, then dx), re-reading the row rather than holding
it, and the backward adds its dw/db partial sums into its own row of a global buffer. Either
way the partial sums are added with a torch sum (deterministic, no atomics). Any leading
shape: rows = x.numel() / n.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megalite.kernels._utils import INTERPRET, check_float, check_grid, check_tensors, next_power_of_2, on_input_device

WHOLE_ROW_MAX = 8192  # features up to which a row is held whole in registers
CHUNK = 2048  # columns per step of the chunked kernels (fp32: 8 per thread at 8 warps)


# Reductions call tl.reduce with the combine function tl.sum uses: identical when compiled,
# and it skips a jit-wrapper call that costs milliseconds per call in the CPU interpreter.

@triton.jit
def _norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, n_rows, n_cols, eps, RMS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    ptrs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(X + ptrs, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.reduce(x, 1, tl.standard._sum_combine) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=rows < n_rows)
    rstd = 1.0 / tl.sqrt(tl.reduce(xc * xc, 1, tl.standard._sum_combine) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)
    y = xc * rstd[:, None] * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + ptrs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, n_rows, n_cols, n_tiles,
                     RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.full([BLOCK_R, BLOCK], 0.0, tl.float32)
    db = tl.full([BLOCK_R, BLOCK], 0.0, tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        ptrs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(X + ptrs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + ptrs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)[:, None]
        if RMS:
            xhat = x * rstd
        else:
            mean = tl.load(MEAN + rows, mask=rows < n_rows, other=0.0)[:, None]
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = w * dy
        c1 = tl.reduce(xhat * g, 1, tl.standard._sum_combine)[:, None] / n_cols
        if RMS:
            dx = (g - xhat * c1) * rstd
        else:
            c2 = tl.reduce(g, 1, tl.standard._sum_combine)[:, None] / n_cols
            dx = (g - xhat * c1 - c2) * rstd
        tl.store(DX + ptrs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PART + pid * n_cols + cols, tl.reduce(dw, 0, tl.standard._sum_combine), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + pid * n_cols + cols, tl.reduce(db, 0, tl.standard._sum_combine),
                 mask=col_ok)


@triton.jit
def _norm_fwd_chunked_kernel(X, W, B, Y, MEAN, RSTD, n_cols, eps, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                             CHUNK: tl.constexpr):
    """One row per program, walked in column chunks: its mean (LayerNorm), then the sum of
    squared deviations, then y; each pass re-reads the row (from L2 at these sizes) instead of
    holding it in registers."""
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * n_cols, Y + row * n_cols
    offs = tl.arange(0, CHUNK)
    mean = 0.0
    if not RMS:
        total = tl.zeros([CHUNK], tl.float32)
        for start in range(0, n_cols, CHUNK):
            total += tl.load(x_row + start + offs, mask=start + offs < n_cols, other=0.0).to(tl.float32)
        mean = tl.reduce(total, 0, tl.standard._sum_combine) / n_cols
        tl.store(MEAN + row, mean)
    squares = tl.zeros([CHUNK], tl.float32)
    for start in range(0, n_cols, CHUNK):
        ok = start + offs < n_cols
        xc = tl.where(ok, tl.load(x_row + start + offs, mask=ok, other=0.0).to(tl.float32) - mean, 0.0)
        squares += xc * xc
    rstd = 1.0 / tl.sqrt(tl.reduce(squares, 0, tl.standard._sum_combine) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    for start in range(0, n_cols, CHUNK):
        ok = start + offs < n_cols
        x = tl.load(x_row + start + offs, mask=ok, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * tl.load(W + start + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(B + start + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_row + start + offs, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _norm_bwd_chunked_kernel(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, n_rows, n_cols,
                             RMS: tl.constexpr, HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr):
    """Rows pid, pid + P, ...: per row a pass for c1 = mean(xhat g) (and c2 = mean(g)), then a
    pass writing dx and adding dy xhat (dy) into this program's own row of DW_PART (DB_PART):
    partial sums in global memory rather than registers, still without atomics."""
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    for row in range(pid, n_rows, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * n_cols
        rstd = tl.load(RSTD + row)
        mean = 0.0 if RMS else tl.load(MEAN + row)
        acc1 = tl.zeros([CHUNK], tl.float32)
        acc2 = tl.zeros([CHUNK], tl.float32)
        for start in range(0, n_cols, CHUNK):
            ok = start + offs < n_cols
            x = tl.load(X + base + start + offs, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(DY + base + start + offs, mask=ok, other=0.0).to(tl.float32) * \
                tl.load(W + start + offs, mask=ok, other=0.0).to(tl.float32)
            acc1 += tl.where(ok, (x - mean) * rstd, 0.0) * g
            acc2 += g
        c1 = tl.reduce(acc1, 0, tl.standard._sum_combine) / n_cols
        c2 = 0.0 if RMS else tl.reduce(acc2, 0, tl.standard._sum_combine) / n_cols
        for start in range(0, n_cols, CHUNK):
            ok = start + offs < n_cols
            x = tl.load(X + base + start + offs, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(DY + base + start + offs, mask=ok, other=0.0).to(tl.float32)
            xhat = tl.where(ok, (x - mean) * rstd, 0.0)
            g = dy * tl.load(W + start + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(DX + base + start + offs, ((g - xhat * c1 - c2) * rstd).to(DX.dtype.element_ty), mask=ok)
            part = DW_PART + pid * n_cols + start + offs
            tl.store(part, tl.load(part, mask=ok, other=0.0) + dy * xhat, mask=ok)
            if HAS_BIAS:
                part_b = DB_PART + pid * n_cols + start + offs
                tl.store(part_b, tl.load(part_b, mask=ok, other=0.0) + dy, mask=ok)


def _check(what: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tensors(what, x, weight, *([bias] if bias is not None else []))
    check_float(what, x, weight)
    n = x.shape[-1]
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"{what}: weight and bias must have shape ({n},) (the last dim of x), got "
                         f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}.")


def _tiles(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK, BLOCK_R, num_warps): a tile of BLOCK_R rows by the whole padded row. Under the
    interpreter many rows per tile (each program step costs the same whatever its size)."""
    block = next_power_of_2(n_cols)
    if INTERPRET:
        return block, max(1, min(64, 8192 // block)), 1
    return block, max(1, min(16, 4096 // block)), min(16, max(4, block // 512))


def _chunk(n: int, chunk: int | None) -> int | None:
    """Columns per step of the chunked kernels, or None for the whole-row kernels."""
    if chunk is not None:
        return chunk
    return CHUNK if n > WHOLE_ROW_MAX else None


@on_input_device
def norm_forward(x, weight, bias, eps: float, rms: bool, chunk: int | None = None):
    """(y, mean, rstd) for x (rows, n) contiguous; mean is empty for RMSNorm. ``chunk``: force
    the chunked kernel with this many columns per step (default: only above WHOLE_ROW_MAX)."""
    rows, n = x.shape
    block, block_r, warps = _tiles(n)
    y = torch.empty_like(x)
    mean = torch.empty(0 if rms else rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    chunk = _chunk(n, chunk)
    if rows and chunk is not None:
        _norm_fwd_chunked_kernel[check_grid("norm_forward", (rows,))](
            x, weight, bias if bias is not None else weight, y, rstd if rms else mean, rstd, n, float(eps),
            RMS=rms, HAS_BIAS=bias is not None, CHUNK=chunk, num_warps=1 if INTERPRET else 8)
    elif rows:
        _norm_fwd_kernel[check_grid("norm_forward", (triton.cdiv(rows, block_r),))](
            x, weight, bias if bias is not None else weight, y, rstd if rms else mean, rstd, rows, n,
            float(eps), RMS=rms, HAS_BIAS=bias is not None, BLOCK_R=block_r, BLOCK=block,
            num_warps=warps)
    return y, mean, rstd


@on_input_device
def norm_backward(dy, x, weight, has_bias: bool, mean, rstd, rms: bool, chunk: int | None = None):
    """(dx, dw, db) with dw, db in the weight's dtype (db None without a bias)."""
    rows, n = x.shape
    block, block_r, warps = _tiles(n)
    chunk = _chunk(n, chunk)
    n_tiles = triton.cdiv(rows, block_r) if chunk is None else rows
    programs = max(1, min(n_tiles, 1 if INTERPRET else 4 * _sm_count(x.device)))
    dx = torch.empty_like(x)
    dw_part = torch.zeros((programs, n), device=x.device, dtype=torch.float32)
    db_part = torch.zeros((programs, n), device=x.device, dtype=torch.float32) if has_bias else dw_part
    if rows and chunk is not None:
        _norm_bwd_chunked_kernel[(programs,)](x, weight, dy, dx, rstd if rms else mean, rstd, dw_part, db_part,
                                              rows, n, RMS=rms, HAS_BIAS=has_bias, CHUNK=chunk,
                                              num_warps=1 if INTERPRET else 8)
    elif rows:
        _norm_bwd_kernel[(programs,)](x, weight, dy, dx, rstd if rms else mean, rstd, dw_part,
                                      db_part, rows, n, n_tiles, RMS=rms, HAS_BIAS=has_bias,
                                      BLOCK_R=block_r, BLOCK=block, num_warps=warps)
    db = db_part.sum(0).to(weight.dtype) if has_bias else None
    return dx, dw_part.sum(0).to(weight.dtype), db


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class _FusedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        y, mean, rstd = norm_forward(x2, weight.contiguous(), bias, eps, rms)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.has_bias = rms, bias is not None
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        dx, dw, db = norm_backward(dy2, x2, weight.contiguous(), ctx.has_bias, mean, rstd, ctx.rms)
        return dx.view(dy.shape), dw, db, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim of x (any leading shape), with autograd."""
    _check("layer_norm", x, weight, bias)
    return _FusedNorm.apply(x, weight, bias, eps, False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape), with autograd."""
    _check("rms_norm", x, weight, None)
    return _FusedNorm.apply(x, weight, None, eps, True)


def layer_norm_reference(x, weight, bias, eps: float = 1e-5) -> torch.Tensor:
    """torch LayerNorm with fp32 statistics (float64 stays float64), output in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    w, b = weight.to(acc), None if bias is None else bias.to(acc)
    return torch.nn.functional.layer_norm(x.to(acc), (x.shape[-1],), w, b, eps).to(x.dtype)


def rms_norm_reference(x, weight, eps: float = 1e-5) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight with fp32 statistics, output in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(acc)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(acc)).to(x.dtype)
