"""Fused softmax cross-entropy over a (slice of a) large vocabulary, with a torch reference.

Per row z (logits) with target t: ``loss = log sum_v exp(z_v) - z_t``. The probabilities are
never stored: a stats kernel streams the vocabulary in blocks, keeping the online pair
(m, s) with ``m = max_v z_v`` and ``s = sum_v exp(z_v - m)``, and picks up ``z_t``.

Vocabulary slices (tensor parallelism): a rank holds the columns
``[vocab_start, vocab_start + V_local)``. Its stats (m_r, s_r, t_r) treat columns at or above
the real ``vocab_size`` (padding) as -inf and give ``t_r = 0`` unless the target lies in the
slice. The ranks combine them exactly with

    M = max_r m_r    (all-reduce MAX)
    S = sum_r s_r exp(m_r - M),   z_t = sum_r t_r    (all-reduce SUM)
    loss = M + log S - z_t,       lse = M + log S

and the backward kernel writes ``d loss / d z_v = (exp(z_v - lse) - [v = t]) * grad_loss``
on each slice alone. Rows whose target is ``ignore_index`` get loss 0 and gradient 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megalite.kernels._utils import INTERPRET, check_float, check_grid, check_tensors, on_input_device


# Reductions call tl.reduce with the combine functions tl.sum / tl.max use: identical when
# compiled, and it skips a jit-wrapper call that costs milliseconds in the CPU interpreter.

@triton.jit
def _ce_stats_kernel(Z, TARGET, MAX, SUMEXP, TLOGIT, n_rows, n_cols, stride_row, vocab_start,
                     vocab_size, ignore_index, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    base = Z + rows.to(tl.int64)[:, None] * stride_row
    target = tl.load(TARGET + rows, mask=row_ok, other=ignore_index)
    local_t = (target - vocab_start)[:, None]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.full([BLOCK_R], 0.0, tl.float32)
    t_logit = tl.full([BLOCK_R], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = row_ok[:, None] & ((cols < n_cols) & (cols + vocab_start < vocab_size))[None, :]
        z = tl.load(base + cols[None, :], mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.reduce(z, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # only padding so far
        s = s * tl.exp(m - m_safe) + tl.reduce(tl.exp(z - m_safe[:, None]), 1,
                                               tl.standard._sum_combine)
        m = m_new
        hit = valid & (cols[None, :] == local_t)
        t_logit += tl.reduce(tl.where(hit, z, 0.0), 1, tl.standard._sum_combine)
    tl.store(MAX + rows, m, mask=row_ok)
    tl.store(SUMEXP + rows, s, mask=row_ok)
    tl.store(TLOGIT + rows, tl.where(target == ignore_index, 0.0, t_logit), mask=row_ok)


@triton.jit
def _ce_grad_kernel(Z, TARGET, LSE, GRAD, DZ, n_rows, n_cols, stride_row, vocab_start, vocab_size,
                    ignore_index, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    target = tl.load(TARGET + rows, mask=row_ok, other=ignore_index)
    g = tl.load(GRAD + rows, mask=row_ok, other=0.0).to(tl.float32)
    g = tl.where(target == ignore_index, 0.0, g)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    valid = row_ok[:, None] & ((cols < n_cols) & (cols + vocab_start < vocab_size))[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(Z + rows64 * stride_row + cols[None, :], mask=valid, other=float("-inf"))
    p = tl.exp(z.to(tl.float32) - lse[:, None])
    onehot = tl.where(cols[None, :] == (target - vocab_start)[:, None], 1.0, 0.0)
    dz = (p - onehot) * g[:, None]
    tl.store(DZ + rows64 * n_cols + cols[None, :], dz.to(DZ.dtype.element_ty),
             mask=row_ok[:, None] & (cols < n_cols)[None, :])


def _tiles(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_R rows, BLOCK_V vocabulary columns, num_warps) per program step."""
    if INTERPRET:
        return 32, 256, 1
    return 1, 4096 if n_cols >= 4096 else 1024, 8


def _rows(logits: torch.Tensor, target: torch.Tensor, what: str):
    check_tensors(what, logits, target)
    check_float(what, logits)
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"{what}: target shape {tuple(target.shape)} must equal logits shape "
                         f"{tuple(logits.shape)} without its last (vocabulary) dim.")
    z = logits.reshape(-1, logits.shape[-1])
    if z.stride(-1) != 1:
        z = z.contiguous()
    return z, target.reshape(-1).contiguous()


@on_input_device
def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                        vocab_size: int | None = None, ignore_index: int = -100):
    """Per-row fp32 (row_max, sum_exp relative to row_max, target_logit) of this vocabulary
    slice (see module docstring), each of shape ``logits.shape[:-1]``."""
    z, t = _rows(logits, target, "cross_entropy_stats")
    rows, n = z.shape
    vocab_size = vocab_start + n if vocab_size is None else vocab_size
    stats = torch.empty((3, rows), device=z.device, dtype=torch.float32)
    block_r, block_v, warps = _tiles(n)
    if rows:
        _ce_stats_kernel[check_grid("cross_entropy_stats", (triton.cdiv(rows, block_r),))](
            z, t, stats[0], stats[1], stats[2], rows, n, z.stride(0), vocab_start, vocab_size,
            ignore_index, BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps)
    return tuple(x.view(logits.shape[:-1]) for x in stats)


@on_input_device
def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                       grad_loss: torch.Tensor, vocab_start: int = 0, vocab_size: int | None = None,
                       ignore_index: int = -100) -> torch.Tensor:
    """d loss / d logits on this slice given the global ``lse`` per row, in logits' dtype."""
    z, t = _rows(logits, target, "cross_entropy_grad")
    rows, n = z.shape
    vocab_size = vocab_start + n if vocab_size is None else vocab_size
    dz = torch.empty((rows, n), device=z.device, dtype=logits.dtype)
    block_r, block_v, warps = _tiles(n)
    if rows and n:
        _ce_grad_kernel[check_grid("cross_entropy_grad", (triton.cdiv(rows, block_r), triton.cdiv(n, block_v)))](
            z, t, lse.reshape(-1).float().contiguous(), grad_loss.reshape(-1).contiguous(), dz, rows,
            n, z.stride(0), vocab_start, vocab_size, ignore_index, BLOCK_R=block_r,
            BLOCK_V=block_v, num_warps=warps)
    return dz.view(logits.shape)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, vocab_size):
        row_max, sum_exp, t_logit = cross_entropy_stats(logits, target, 0, vocab_size, ignore_index)
        lse = row_max + torch.log(sum_exp)
        loss = (lse - t_logit).masked_fill(target == ignore_index, 0.0)
        ctx.save_for_backward(logits, target, lse)
        ctx.args = (vocab_size, ignore_index)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        vocab_size, ignore_index = ctx.args
        grad = cross_entropy_grad(logits, target, lse, grad_loss, 0, vocab_size, ignore_index)
        return grad, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  vocab_size: int | None = None) -> torch.Tensor:
    """Per-token fp32 losses (shape ``target.shape``, no reduction) with autograd; columns at
    or above ``vocab_size`` (padding, default none) are excluded from the softmax."""
    return _CrossEntropy.apply(logits, target, ignore_index, vocab_size)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                            vocab_size: int | None = None) -> torch.Tensor:
    """Per-token losses from torch's cross_entropy in fp32 (float64 stays float64)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if vocab_size is not None and vocab_size < z.shape[-1]:
        z = z[..., :vocab_size]
    loss = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), target.reshape(-1),
                                             ignore_index=ignore_index, reduction="none")
    return loss.view(target.shape)
