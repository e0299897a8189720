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

from megalite.kernels._utils import INTERPRET, check_float, check_tensors


@triton.jit
def _ce_stats_kernel(Z, TARGET, MAX, SUMEXP, TLOGIT, n_cols, stride_row, vocab_start, vocab_size,
                     ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_row
    target = tl.load(TARGET + row)
    local_t = target - vocab_start
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t_logit = tl.zeros([], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = (cols < n_cols) & (cols + vocab_start < vocab_size)
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # slice of padding so far
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), 0)
        m = m_new
        t_logit += tl.sum(tl.where(valid & (cols == local_t), z, 0.0), 0)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TLOGIT + row, tl.where(target == ignore_index, 0.0, t_logit))


@triton.jit
def _ce_grad_kernel(Z, TARGET, LSE, GRAD, DZ, n_cols, stride_row, vocab_start, vocab_size,
                    ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    target = tl.load(TARGET + row)
    g = tl.where(target == ignore_index, 0.0, tl.load(GRAD + row).to(tl.float32))
    valid = (cols < n_cols) & (cols + vocab_start < vocab_size)
    z = tl.load(Z + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.load(LSE + row))
    dz = (p - tl.where(cols == target - vocab_start, 1.0, 0.0)) * g
    tl.store(DZ + row * n_cols + cols, dz.to(DZ.dtype.element_ty), mask=cols < n_cols)


def _block_v(n_cols: int) -> int:
    return 256 if INTERPRET else 4096 if n_cols >= 4096 else 1024


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


def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                        vocab_size: int | None = None, ignore_index: int = -100):
    """Per-row fp32 (row_max, sum_exp relative to row_max, target_logit) of this vocabulary
    slice (see module docstring), each of shape ``logits.shape[:-1]``."""
    z, t = _rows(logits, target, "cross_entropy_stats")
    rows, n = z.shape
    vocab_size = vocab_start + n if vocab_size is None else vocab_size
    stats = torch.empty((3, rows), device=z.device, dtype=torch.float32)
    if rows:
        _ce_stats_kernel[(rows,)](z, t, stats[0], stats[1], stats[2], n, z.stride(0), vocab_start,
                                  vocab_size, ignore_index, BLOCK_V=_block_v(n),
                                  num_warps=1 if INTERPRET else 8)
    return tuple(x.view(logits.shape[:-1]) for x in stats)


def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                       grad_loss: torch.Tensor, vocab_start: int = 0, vocab_size: int | None = None,
                       ignore_index: int = -100) -> torch.Tensor:
    """d loss / d logits on this slice given the global ``lse`` per row, in logits' dtype."""
    z, t = _rows(logits, target, "cross_entropy_grad")
    rows, n = z.shape
    vocab_size = vocab_start + n if vocab_size is None else vocab_size
    dz = torch.empty((rows, n), device=z.device, dtype=logits.dtype)
    if rows and n:
        block = _block_v(n)
        _ce_grad_kernel[(rows, triton.cdiv(n, block))](
            z, t, lse.reshape(-1).float().contiguous(), grad_loss.reshape(-1).contiguous(), dz, n,
            z.stride(0), vocab_start, vocab_size, ignore_index, BLOCK_V=block,
            num_warps=1 if INTERPRET else 8)
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
