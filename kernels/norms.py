"""Fused LayerNorm and RMSNorm in Triton, forward and backward, with torch references.

Per row x of n features (statistics in fp32, output in x's dtype):

    LayerNorm: mu = mean(x), rstd = 1 / sqrt(mean((x - mu)^2) + eps), xhat = (x - mu) rstd,
               y = xhat w + b
    RMSNorm:   rstd = 1 / sqrt(mean(x^2) + eps), xhat = x rstd, y = xhat w

Backward with g = w dy (elementwise), c1 = mean(xhat g), c2 = mean(g):

    LayerNorm: dx = rstd (g - xhat c1 - c2)      RMSNorm: dx = rstd (g - xhat c1)
    dw = sum_rows dy xhat,  db = sum_rows dy

The forward runs one row per program (the whole row in one block, any n up to 65536, not
only powers of two). The backward gives each program a run of rows; it keeps fp32 partial
sums of dw, db over its rows, which are then added with a torch sum (deterministic, no
atomics). Any leading shape: rows = x.numel() / n.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megalite.kernels._utils import INTERPRET, check_float, check_tensors, next_power_of_2

MAX_HIDDEN = 65536


@triton.jit
def _norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, n_cols, eps, RMS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, 0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, n_rows, n_cols, rows_per_program,
                     RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    first = pid.to(tl.int64) * rows_per_program  # int64 row index: rows * n may pass 2^31
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        g = w * dy
        c1 = tl.sum(xhat * g, 0) / n_cols
        if RMS:
            dx = (g - xhat * c1) * rstd
        else:
            dx = (g - xhat * c1 - tl.sum(g, 0) / n_cols) * rstd
        tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * n_cols + cols, db, mask=mask)


def _check(what: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tensors(what, x, weight, *([bias] if bias is not None else []))
    check_float(what, x, weight)
    n = x.shape[-1]
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"{what}: weight and bias must have shape ({n},) (the last dim of x), got "
                         f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}.")
    if n > MAX_HIDDEN:
        raise ValueError(f"{what}: hidden size {n} is above {MAX_HIDDEN}, the largest one row per "
                         f"program can hold. Fix: use the torch norm (no --fused-kernels).")


def _warps(block: int) -> int:
    return 1 if INTERPRET else min(16, max(1, block // 256))


def norm_forward(x, weight, bias, eps: float, rms: bool):
    """(y, mean, rstd) for x (rows, n) contiguous; mean is empty for RMSNorm."""
    rows, n = x.shape
    block = next_power_of_2(n)
    y = torch.empty_like(x)
    mean = torch.empty(0 if rms else rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    if rows:
        _norm_fwd_kernel[(rows,)](x, weight, bias if bias is not None else weight, y,
                                  rstd if rms else mean, rstd,
                                  n, float(eps), RMS=rms, HAS_BIAS=bias is not None, BLOCK=block,
                                  num_warps=_warps(block))
    return y, mean, rstd


def norm_backward(dy, x, weight, has_bias: bool, mean, rstd, rms: bool):
    """(dx, dw, db) with dw, db in the weight's dtype (db None without a bias)."""
    rows, n = x.shape
    block = next_power_of_2(n)
    programs = max(1, min(rows, 8 if INTERPRET else 4 * _sm_count(x.device)))
    per_program = triton.cdiv(rows, programs) if rows else 1
    programs = triton.cdiv(rows, per_program) if rows else 1
    dx = torch.empty_like(x)
    dw_part = torch.zeros((programs, n), device=x.device, dtype=torch.float32)
    db_part = torch.zeros((programs, n), device=x.device, dtype=torch.float32) if has_bias else dw_part
    if rows:
        _norm_bwd_kernel[(programs,)](x, weight, dy, dx, mean if not rms else rstd, rstd, dw_part,
                                      db_part, rows, n, per_program, RMS=rms, HAS_BIAS=has_bias,
                                      BLOCK=block, num_warps=_warps(block))
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
