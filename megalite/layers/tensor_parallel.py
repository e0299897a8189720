"""Tensor-parallel layers. With a TP group of one rank (or none) they are plain layers.

Activations are sequence-first ``(s, b, h)``. Under sequence parallelism (SP) the
activations outside attention and MLP are sharded along ``s`` over the TP group.

- :class:`ColumnParallelLinear`: ``Y = X A^T`` with ``A`` split on the output dim; rank r
  computes ``Y_r = X A_r^T`` (its columns of Y). Input enters with ``copy_to_tp``
  (bwd all-reduce) or, under SP, through :func:`sequence_parallel_linear` (fwd all-gather,
  bwd reduce-scatter, keeping only the sequence shard: the full input is gathered again in
  backward, as Megatron does).
- :class:`RowParallelLinear`: ``A`` split on the input dim; rank r computes the partial
  ``X_r A_r^T`` from its slice of X; partials are summed with ``reduce_from_tp``
  (all-reduce) or, under SP, ``reduce_scatter_to_sp``. The bias is added after the sum.
- :class:`VocabParallelEmbedding`: rows (vocabulary) split over TP; ids outside a rank's
  range look up zeros; the partial embeddings are summed (or reduce-scattered under SP).
- :func:`vocab_parallel_cross_entropy`: loss from vocabulary-sliced logits without ever
  materializing the full logits on one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.parallel import comm
from megalite.parallel.comm import group_rank, group_size
from megalite.parallel.sharding import TPSplit, mark_sequence_parallel, mark_tensor_parallel
from megalite.layers.weight_grad import embedding, linear, mark_deferred, sequence_parallel_split_linear


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class _SequenceParallelLinear(torch.autograd.Function):
    """y = X W^T + b with X = all-gather of the sequence shards x (dim 0) over TP.

    Only the shard x is kept for backward, not X (TP times larger): backward gathers X again,
    overlapped with the input-gradient GEMM, then reduce-scatters dX, overlapped with the
    weight-gradient GEMM (the conjugate of the forward all-gather)::

        X  = all-gather(x)   (async)  |  dX = dy W
        dx = reduce-scatter(dX) (async)  |  dW = dy^T X,  db = sum dy
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(comm.all_gather_dim0(x, group), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        group, world = ctx.group, group_size(ctx.group)
        x = x.contiguous()
        with comm.category("communication"):
            full = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        gathering = comm.all_gather_async(full, x, group)
        dfull = dy.matmul(weight.to(dy.dtype))
        gathering.wait()
        with comm.category("communication"):
            dx = torch.empty_like(x, dtype=dfull.dtype)
        reducing = comm.reduce_scatter_async(dx, dfull.contiguous(), group)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().matmul(full.reshape(-1, full.shape[-1]).to(dy.dtype)).to(weight.dtype)
        db = dy2.sum(0) if ctx.has_bias else None
        reducing.wait()
        return dx.to(x.dtype), dw, db, None


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group) -> torch.Tensor:
    """all-gather(x) W^T + b from this rank's sequence shard x (see _SequenceParallelLinear)."""
    if group_size(group) == 1:
        return linear(x, weight, bias)
    split = sequence_parallel_split_linear(x, weight, bias, group)  # zero-bubble: dW deferred
    return split if split is not None else _SequenceParallelLinear.apply(x, weight, bias, group)


class ColumnParallelLinear(nn.Module):
    """Weight (out/TP, in) per rank; ``sections`` > 1 for fused weights such as [gate; up]."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, tp_group=None,
                 sequence_parallel: bool = False, gather_output: bool = False, sections: int = 1):
        super().__init__()
        self.tp_group, self.sequence_parallel, self.gather_output = tp_group, sequence_parallel, gather_output
        self.sections = sections
        tp, rank = group_size(tp_group), group_rank(tp_group)
        local_out = _divide(out_features, tp * sections, "output features / sections") * sections
        self.weight = mark_deferred(nn.Parameter(torch.empty(local_out, in_features)))
        mark_tensor_parallel(self.weight, (out_features, in_features), TPSplit(0, sections), rank, tp)
        if bias:
            self.bias = nn.Parameter(torch.zeros(local_out))
            mark_tensor_parallel(self.bias, (out_features,), TPSplit(0, sections), rank, tp)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = sequence_parallel_linear(x, self.weight, self.bias, self.tp_group)
        else:
            y = linear(comm.copy_to_tp(x, self.tp_group), self.weight, self.bias)
        if not self.gather_output:
            return y
        y = comm.gather_from_tp(y, self.tp_group)  # rank-major: [r0 s0, r0 s1, r1 s0, ...]
        if self.sections > 1:  # back to the full layout [s0 (all ranks), s1 (all ranks)]
            tp = group_size(self.tp_group)
            y = y.unflatten(-1, (tp, self.sections, -1)).transpose(-3, -2).flatten(-3)
        return y


class RowParallelLinear(nn.Module):
    """Weight (out, in/TP) per rank; bias replicated and added after the reduction."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, tp_group=None,
                 sequence_parallel: bool = False, input_is_parallel: bool = True):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.input_is_parallel = input_is_parallel
        tp, rank = group_size(tp_group), group_rank(tp_group)
        self.weight = mark_deferred(nn.Parameter(torch.empty(out_features, _divide(in_features, tp, "input features"))))
        mark_tensor_parallel(self.weight, (out_features, in_features), TPSplit(1), rank, tp)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
            if sequence_parallel:
                mark_sequence_parallel(self.bias)  # added to a sequence shard only
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.tp_group)
        partial = linear(x, self.weight)
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sp(partial, self.tp_group)
        else:
            y = comm.reduce_from_tp(partial, self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary is split over TP in contiguous ranges.

    ``forward`` returns the *reduced* embedding: all-reduce over TP, or under sequence
    parallelism a reduce-scatter that leaves this rank its sequence shard.
    """

    def __init__(self, padded_vocab_size: int, hidden_size: int, *, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        tp, rank = group_size(tp_group), group_rank(tp_group)
        self.local_vocab = _divide(padded_vocab_size, tp, "padded vocabulary")
        self.vocab_start = rank * self.local_vocab
        self.weight = mark_deferred(nn.Parameter(torch.empty(self.local_vocab, hidden_size)))
        mark_tensor_parallel(self.weight, (padded_vocab_size, hidden_size), TPSplit(0), rank, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        partial = embedding(local.masked_fill(outside, 0), self.weight)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(partial, self.tp_group)
        return comm.reduce_from_tp(partial, self.tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss_i = log(sum_v exp(z_iv)) - z_i,target, with the vocabulary split over TP.

    Forward: global row max m (all-reduce MAX) for stability; then one all-reduce (SUM) of
    the stacked [sum_v exp(z_iv - m), z_i,target - m], where only the rank owning the
    target contributes the target logit. Backward: d loss / d z_iv = softmax_iv - [v = t],
    computed on the local slice alone (no communication). Columns at or above
    ``vocab_size`` (padding) are masked to -inf, so they are never predicted.

    ``fused``: the Triton kernels of ``megalite.kernels.cross_entropy`` compute this slice's
    (row max, sum of exp, target logit) without materializing the softmax, and the backward
    from the saved logits and ``lse = M + log S``; the collectives are the same.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, ignore_index, group, fused=False):
        ctx.fused = fused
        if fused:
            return _fused_vocab_parallel_ce_forward(ctx, logits, target, vocab_start, vocab_size,
                                                    ignore_index, group)
        # One fp32 working copy, then everything in place (this runs on the full logits).
        z = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        local_vocab = z.shape[-1]
        if vocab_start + local_vocab > vocab_size:  # padding columns in this slice
            z[..., max(0, vocab_size - vocab_start):] = float("-inf")
        row_max = z.max(dim=-1).values
        if group_size(group) > 1:
            comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        z.sub_(row_max.unsqueeze(-1))
        ignored = target == ignore_index
        local_target = target - vocab_start
        mine = (local_target >= 0) & (local_target < local_vocab) & ~ignored
        safe_index = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
        target_logit = torch.where(mine, z.gather(-1, safe_index).squeeze(-1), torch.zeros_like(row_max))
        exp = z.exp_()
        stats = torch.stack([exp.sum(dim=-1), target_logit])
        if group_size(group) > 1:
            comm.all_reduce(stats, group)
        sum_exp, target_logit = stats[0], stats[1]
        loss = torch.log(sum_exp) - target_logit
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_index, mine, ignored)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.fused:
            from megalite.kernels.cross_entropy import cross_entropy_grad

            logits, target, lse = ctx.saved_tensors
            grad = cross_entropy_grad(logits, target, lse, grad_loss, *ctx.fused_args)
            return grad, None, None, None, None, None, None
        softmax, safe_index, mine, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, safe_index, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None, None


def _fused_vocab_parallel_ce_forward(ctx, logits, target, vocab_start, vocab_size, ignore_index,
                                     group):
    """loss = M + log S - z_t from the kernel's slice stats (m_r, s_r, t_r): M = max_r m_r
    (all-reduce MAX), then [S, z_t] = sum_r [s_r exp(m_r - M), t_r] (all-reduce SUM)."""
    from megalite.kernels.cross_entropy import cross_entropy_stats

    row_max, sum_exp, target_logit = cross_entropy_stats(logits, target, vocab_start, vocab_size,
                                                         ignore_index)
    global_max = row_max.clone()
    if group_size(group) > 1:
        comm.all_reduce(global_max, group, op=dist.ReduceOp.MAX)
    stats = torch.stack([sum_exp * torch.exp(row_max - global_max), target_logit])
    if group_size(group) > 1:
        comm.all_reduce(stats, group)
    lse = global_max + torch.log(stats[0])
    ctx.save_for_backward(logits, target, lse)
    ctx.fused_args = (vocab_start, vocab_size, ignore_index)
    return (lse - stats[1]).masked_fill(target == ignore_index, 0.0)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                 tp_group=None, ignore_index: int = -100,
                                 fused: bool = False) -> torch.Tensor:
    """Per-token loss from this rank's vocabulary slice of the logits (``(..., V/TP)``).

    ``vocab_size`` is the real vocabulary: padding columns never take probability mass.
    Tokens whose target is ``ignore_index`` get loss 0 and no gradient. ``fused``: compute
    with the Triton cross-entropy kernels (same result, no fp32 softmax kept for backward).
    """
    vocab_start = group_rank(tp_group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, ignore_index,
                                            tp_group, fused)
