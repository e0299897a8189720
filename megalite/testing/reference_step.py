"""The plain reference train step the equivalence tests and benchmarks compare against.

megalite trains through :class:`~megalite.data_parallel.zero.DistributedOptimizer` (gradients
reduced in buckets during the backward, the update on fp32 shards, no host sync). This module
keeps the textbook version for comparison: ``torch.optim.AdamW`` on the model's own parameters,
and after the backward one flat all-reduce per kind of gradient:

- sequence-parallel partial gradients (norms, row-parallel biases): sum over TP;
- tied embedding copies (first and last pipeline stage): sum over the embedding group;
- every other gradient: mean over DP x CP; expert gradients: sum over expert-DP, / (DP x CP);

then the global gradient norm (squares over TP x PP, TP-replicated ones counted once), clipping
and the step, skipped when the norm is not finite (one host sync). :func:`train_step` runs
megalite's step when handed a DistributedOptimizer, so a test can drive either with one call.
"""
from __future__ import annotations

import torch

from megalite.config import TrainConfig
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.moe.balancing import balance_after_step
from megalite.parallel import comm
from megalite.parallel.sharding import is_expert, is_tensor_parallel, sum_local_tied_copies
from megalite.observe.step_values import LossScaler, StepResult
from megalite.train.step import as_chunks, data_parallel_mean, forward_backward, lr_at, moe_stats
from megalite.train.step import train_step as distributed_train_step


def build_optimizer(model, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW; biases and norm parameters are not decayed (as in GPT-2 / Megatron)."""
    decay, no_decay = [], []
    named = [np for chunk in as_chunks(model) for np in chunk.named_parameters()]
    for name, param in named:
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": t.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def is_finite(x: torch.Tensor) -> bool:
    """Whether a scalar is finite; a meta tensor has no value and counts as finite."""
    return x.device.type == "meta" or bool(torch.isfinite(x).item())


def _allreduce_flat(tensors: list[torch.Tensor], group, average: bool) -> None:
    """All-reduce a list of tensors as one flat buffer (one collective), in place."""
    if not tensors or comm.group_size(group) == 1:
        return
    flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group)
    if average:
        flat /= comm.group_size(group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def data_parallel_allreduce_gradients(params, group) -> None:
    """Average gradients over the data-parallel group: one all-reduce of all gradients
    flattened into one buffer (sum, then divide by DP). Its conjugate is nothing: the
    forward pass of data parallelism involves no communication. (The bucketed DDP of the
    data-parallel issue overlaps this with backward; this is the simple reference.)"""
    _allreduce_flat([p.grad for p in params if p.grad is not None and not is_expert(p)], group, average=True)


def expert_allreduce_gradients(params, expert_group, divisor: int) -> None:
    """Expert parameters: sum over the expert-data-parallel group (the ranks holding the same
    experts), divided by DP x CP like every other gradient. Each owner's gradient already
    collects its expert-parallel group's tokens (the backward all-to-all), so the sum over
    the replicas covers every token of the stage once (see :mod:`megalite.moe.layer`)."""
    grads = [p.grad for p in params if p.grad is not None and is_expert(p)]
    _allreduce_flat(grads, expert_group, average=False)
    for g in grads:
        g.div_(divisor)


def sequence_parallel_allreduce_gradients(params, tp_group) -> None:
    """Sum over TP the gradients of parameters replicated over TP that saw only this rank's
    sequence shard (``param.sequence_parallel``: norms, row-parallel biases, position
    embeddings). Each rank's gradient is the partial sum over its s/TP positions; the true
    gradient is the sum over all positions. Without this the replicas drift apart."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    _allreduce_flat(grads, tp_group, average=False)


def global_grad_norm(params, model_parallel_group=None, tp_rank: int = 0, ep_group=None) -> torch.Tensor:
    """L2 norm of the gradient of the whole model, in fp32.

    Squares are summed locally over TP-split parameters, and over TP-replicated ones on TP
    rank 0 only (they are identical on every TP rank: counting them TP times would inflate
    the norm), then all-reduced over the model-parallel group (TP x PP). The last stage's
    copy of a tied embedding is skipped: the first stage counts it. Expert parameters are
    summed over the expert-parallel group first (each rank holds other experts), which gives
    the stage's experts on every rank; TP rank 0 adds them."""
    device = params[0].device if params else None
    total = torch.zeros((), dtype=torch.float32, device=device)
    experts = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is None or getattr(p, "embedding_copy", False):
            continue
        if is_expert(p):
            experts += p.grad.detach().float().pow(2).sum()
        elif is_tensor_parallel(p) or tp_rank == 0:
            total += p.grad.detach().float().pow(2).sum()
    comm.all_reduce(experts, ep_group)
    if tp_rank == 0:
        total += experts
    return comm.all_reduce(total, model_parallel_group).sqrt()


def clip_gradients(params, max_norm: float, norm: torch.Tensor) -> None:
    if max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coeff)


def embedding_allreduce_gradients(params, embedding_group) -> None:
    """Tied embeddings under pipeline parallelism: the first stage (input embedding) and the
    last stage (output layer) each hold a copy of the word embedding; each copy's gradient
    is only its own use, the true gradient is their sum. All-reduce over the embedding group
    (first + last stage) so both copies take the same step and stay equal."""
    grads = [p.grad for p in params if getattr(p, "tied_embedding", False) and p.grad is not None]
    if sum_local_tied_copies(grads):
        return
    _allreduce_flat(grads, embedding_group, average=False)



def reduce_gradients(params, grid=None) -> None:
    """After backward, once per step: sequence-parallel partial gradients over TP, tied
    embedding copies over the first/last stage, then the average over DP(xCP)."""
    if grid is None:
        return
    sequence_parallel_allreduce_gradients(params, grid.tp_group)
    embedding_allreduce_gradients(params, grid.embedding_group)
    data_parallel_allreduce_gradients(params, grid.dp_cp_group)
    expert_allreduce_gradients(params, grid.edp_group, grid.layout.dp * grid.layout.cp)


def train_step(model, optimizer, micro_batches, t: TrainConfig, iteration: int,
               scaler: LossScaler, grid=None, trace=None) -> StepResult:
    """One optimizer step over this rank's micro-batches of one global batch: megalite's step
    (:func:`megalite.train.step.train_step`) for a DistributedOptimizer, else the plain
    reference with a ``torch.optim`` optimizer (gradients reduced after the backward, the
    norm read on the host to skip a non-finite step)."""
    if isinstance(optimizer, DistributedOptimizer):
        return distributed_train_step(model, optimizer, micro_batches, t, iteration, scaler, grid, trace)
    params = [p for chunk in as_chunks(model) for p in chunk.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    extra: dict = {}
    loss = forward_backward(model, micro_batches, t, scaler.scale, grid, trace, extra=extra)
    reduce_gradients(params, grid)
    if scaler.enabled:
        for p in params:
            if p.grad is not None:
                p.grad.div_(scaler.scale)
    norm = global_grad_norm(params, grid.mp_group if grid else None, grid.tp_rank if grid else 0,
                            grid.ep_group if grid else None)
    found_inf = not is_finite(norm)  # torch.optim.AdamW cannot skip on the device: one sync
    scaler.update(found_inf)
    lr = lr_at(iteration, t)
    if not found_inf:
        clip_gradients(params, t.clip_grad, norm)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    balance_after_step(as_chunks(model), grid)  # the expert biases move even on a skipped step, as megalite's
    loss, mtp = data_parallel_mean(loss, extra.get("mtp_loss"), grid)
    return StepResult(loss, norm, lr, scaler.scale, found_inf, moe=moe_stats(model, micro_batches, grid), mtp_loss=mtp)
