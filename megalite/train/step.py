"""The train step: micro-batch accumulation, gradient reduction, clipping, loss scaling, LR.

One optimizer step consumes one *global* batch = micro batch x DP x accumulation steps.
Each rank runs ``M = global / (micro * DP)`` micro-batches; micro-batch m's loss is the
mean over its tokens, and its backward is scaled by 1/M, so the accumulated gradient is
the gradient of the mean over micro-batches. Gradients are then averaged over the
data-parallel group (all-reduce sum / DP), giving the gradient of the global-batch mean
(micro-batches hold equally many tokens, so this is the token mean as well).

A micro-batch's loss is over its trained tokens (``loss_mask``: 0 on EOD tokens with
--eod-mask-loss, on prompts in SFT). Under context parallelism each of the C ranks holds part of
the micro-batch's tokens, and the C ranks' losses are averaged (with the gradients, over DP x CP):
rank r's loss is ``sum_r(loss * mask) / (N / C)``, N the micro-batch's trained tokens over the
whole sequence, so the average over the C ranks is ``sum(loss * mask) / N``, the serial loss,
also when the ranks hold different numbers of trained tokens. N is counted on each rank from the
whole micro-batch before it is sliced (every CP rank holds it): no communication, no host sync.

Multi-token prediction (:mod:`megalite.model.mtp`): the micro-batch's loss is
``L_main + (lambda / D) * sum_k L_k``, each depth's ``L_k`` its masked mean over its own trained
tokens N_k (under CP the same rule: ``sum_r / (N_k / C)``, N_k counted before slicing); the
depths' shifted targets and masks are built on the whole sequence before the CP split. The
reported loss is the main one (Megatron's "lm loss"); the depths' mean ``sum_k L_k / D`` is
reported apart as ``mtp_loss``, averaged like it.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from megalite.config import TrainConfig
from megalite.context_parallel.data import context_parallel_slice
from megalite.data_parallel.update_rule import DEFAULT_RULE, UpdateRule
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.device import host_value
from megalite.layers.documents import batch_documents
from megalite.model.qk_clip import after_step as qk_clip_after_step
from megalite.model.qk_clip import start_step as start_qk_clip_step
from megalite.model.mtp import MTP_LABELS, MTP_LOSS_MASK, MTPLosses, mtp_depths, with_mtp_targets
from megalite.moe.stats import start_step as start_moe_step
from megalite.moe.balancing import balance_after_step
from megalite.moe.stats import step_stats as moe_step_stats
from megalite.parallel import comm
from megalite.resilience.fault_injection import LOSS_FACTOR
from megalite.pipeline.executor import ScheduleExecutor
from megalite.pipeline.plan import resolve_schedule
from megalite.pipeline.trace import Trace
from megalite.observe.step_values import LossScaler, StepResult
from megalite.observe.timers import Clock, StepTimers


def lr_at(iteration: int, t: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``lr_warmup_iters``, then decay to ``min_lr`` at
    ``lr_decay_iters`` (cosine: min + (lr-min) * (1 + cos(pi * progress)) / 2)."""
    warmup, decay_iters = t.lr_warmup_iters, t.lr_decay_iters or t.train_iters
    if warmup > 0 and iteration < warmup:
        return t.lr * (iteration + 1) / warmup
    if t.lr_decay_style == "constant":
        return t.lr
    progress = min(1.0, (iteration - warmup) / max(1, decay_iters - warmup))
    if t.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr + (t.lr - t.min_lr) * coeff


def build_data_parallel_optimizer(model, t: TrainConfig, grid, rule: UpdateRule = DEFAULT_RULE):
    """The optimizer of pretrain_gpt.py: DDP / ZeRO over the grid's DP group, with the model's
    weights cast to bf16/fp16 under mixed precision (fp32 master weights in the optimizer), and
    ``rule`` (AdamW unless named) updating the fp32 shards."""
    param_dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    grad_dtype = torch.float32 if t.accumulate_allreduce_grads_in_fp32 else param_dtype
    return DistributedOptimizer(as_chunks(model), t, grid, stage=t.zero_stage, bucket_size=t.ddp_bucket_size,
                                overlap=t.overlap_grad_reduce, offload=t.offload_optimizer,
                                param_dtype=param_dtype, grad_dtype=grad_dtype, rule=rule)


def autocast_context(t: TrainConfig, device_type: str = "cpu"):
    """Mixed precision on the model's device type: matmuls in bf16/fp16, while autocast keeps
    norms, softmax and the loss in fp32 (docs/gpus.md, precision policy). A meta dry run
    has no autocast: the weights are already in the 16-bit dtype there."""
    if device_type == "meta" or not (t.bf16 or t.fp16):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16 if t.bf16 else torch.float16)


def model_device(chunks) -> torch.device:
    """The device of a model (or list of chunks): where every tensor it meets is made."""
    return next(as_chunks(chunks)[0].parameters()).device


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp_min(1.0)


def as_chunks(model) -> list[torch.nn.Module]:
    """A model is one module or a list of pipeline model chunks (virtual stages)."""
    return list(model) if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]


def stage_forward(chunk, input_tensor, batch, t: TrainConfig):
    """Run one model chunk on one micro-batch: embed (first stage) or continue from the
    received activation; the loss chunk returns per-token losses."""
    with autocast_context(t, model_device(chunk).type):
        extra = {MTP_LABELS: batch[MTP_LABELS]} if chunk.post_process and MTP_LABELS in batch else {}
        return chunk(batch["tokens"] if chunk.pre_process else None, batch["position_ids"],
                     labels=batch["labels"] if chunk.post_process else None, hidden=input_tensor,
                     documents=batch_documents(batch), **extra)


# The batch key of a micro-batch's loss denominator under context parallelism (module docstring).
LOSS_TOKENS = "loss_tokens_per_cp_rank"
MTP_LOSS_TOKENS = "mtp_loss_tokens_per_cp_rank"  # the same, per MTP depth: (D,)


def depth_losses(mtp: torch.Tensor, batch) -> torch.Tensor:
    """Each MTP depth's loss (D,): the mean of its (b, s, D) per-token losses over its trained
    tokens, or under CP this rank's share ``sum / (N_k / C)``."""
    mask = batch[MTP_LOSS_MASK].float()
    sums = (mtp.float() * mask).sum((0, 1))
    return sums / (batch[MTP_LOSS_TOKENS] if MTP_LOSS_TOKENS in batch else mask.sum((0, 1)).clamp_min(1.0))


def stage_loss(losses, batch, record: list | None = None) -> torch.Tensor:
    """The micro-batch's loss: the mean over its trained tokens; under CP this rank's share of
    it, ``sum(loss * mask) / (N / C)`` (see the module docstring); with MTP (``losses`` an
    :class:`MTPLosses`) plus lambda / D times the depths' losses. ``record``: gets (main loss,
    the depths' mean or None), detached, for the report."""
    mtp = None
    if isinstance(losses, MTPLosses):
        losses, per_token, weight = losses
        mtp = depth_losses(per_token, batch)
    if LOSS_TOKENS not in batch:
        loss = masked_mean(losses.float(), batch["loss_mask"])
    else:
        loss = (losses.float() * batch["loss_mask"].float()).sum() / batch[LOSS_TOKENS]
    factor = batch.get(LOSS_FACTOR)  # an injected spike (--inject-fault spike@N)
    loss = loss if factor is None else loss * factor
    if record is not None:
        record.append((loss.detach(), None if mtp is None else mtp.detach().mean()))
    return loss if mtp is None else loss + weight * mtp.sum()


def activation_shape(chunk, micro_batch_size: int) -> tuple[int, int, int]:
    """(s, b, h) of the activations between pipeline stages (s/TP under sequence parallel)."""
    cfg = chunk.cfg
    seq = cfg.seq_length // chunk.cp_size  # context parallel: this rank's part of the sequence
    seq //= comm.group_size(chunk.tp_group) if chunk.sequence_parallel else 1
    return (seq, micro_batch_size, cfg.hidden_size)


def context_parallel_batches(micro_batches, grid):
    """Each CP rank keeps its load-balanced part of every sequence (see context_parallel.data),
    and the micro-batch's trained tokens per CP rank, N / C, counted over the whole sequence
    before slicing (the loss denominator, see the module docstring; a device scalar)."""
    if grid is None or grid.layout.cp == 1:
        return micro_batches

    cp = grid.layout.cp
    return [{**context_parallel_slice(b, grid.cp_rank, cp),
             LOSS_TOKENS: b["loss_mask"].float().sum().clamp_min(1.0) / cp,
             **({MTP_LOSS_TOKENS: b[MTP_LOSS_MASK].float().sum((0, 1)).clamp_min(1.0) / cp}
                if MTP_LOSS_MASK in b else {})} for b in micro_batches]


def prepared_batches(chunks, micro_batches, grid):
    """The micro-batches as this rank runs them: with the MTP depths' targets (whole sequence),
    then this rank's context-parallel part."""
    depths = mtp_depths(chunks[0].cfg)
    return context_parallel_batches([with_mtp_targets(b, depths) for b in micro_batches], grid)


def reported_losses(main: torch.Tensor, record: list, num_micro: int, pp_group=None,
                    mtp: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(main loss, MTP loss or None) of the step: ``main`` (the micro-batches' mean) and the
    records' MTP mean, summed over the pipeline group (only the last stage holds records); one
    collective, of the same size on every stage (``mtp``: the model has MTP depths, from its settings)."""
    if not mtp:
        return (main if pp_group is None else comm.all_reduce(main, pp_group)), None
    depths = torch.stack([r[1] for r in record]).sum() / num_micro if record else torch.zeros_like(main)
    both = torch.stack([main, depths])
    if pp_group is not None:
        comm.all_reduce(both, pp_group)
    return both[0], both[1]


def forward_backward(model, micro_batches, t: TrainConfig, loss_scale: float = 1.0, grid=None,
                     trace=None, timers: dict | None = None, extra: dict | None = None) -> torch.Tensor:
    """Accumulate gradients over the micro-batches; return the mean (main) loss (detached).

    Without pipeline parallelism: one micro-batch after another. With it: the schedule of
    ``t.pipeline_schedule`` (interleaved when there are several chunks); the loss, known on
    the last stage, is summed over the pipeline group so every stage reports it. ``extra``:
    gets ``mtp_loss`` (the MTP depths' mean loss, a device scalar) for a model with MTP."""
    chunks = as_chunks(model)
    device = model_device(chunks)
    num_micro = len(micro_batches)
    micro_batches = prepared_batches(chunks, micro_batches, grid)
    has_mtp = mtp_depths(chunks[0].cfg) > 0
    timers = StepTimers(Clock(device)) if timers is None else timers
    start_moe_step(chunks, loss_scale / num_micro)  # the aux losses' backward scale; fresh statistics
    record: list = []
    loss_fn = functools.partial(stage_loss, record=record)
    if grid is None or (grid.layout.pp == 1 and len(chunks) == 1):
        total = torch.zeros((), device=device)
        for batch in micro_batches:
            start = timers.mark()
            loss = loss_fn(stage_forward(chunks[0], None, batch, t), batch)
            middle = timers.mark()
            (loss * (loss_scale / num_micro)).backward()
            timers.add("forward", start, middle)
            timers.add("backward", middle, timers.mark())
            total += record[-1][0]  # the main loss (the whole loss without MTP)
        total, mtp = reported_losses(total / num_micro, record, num_micro, mtp=has_mtp)
        if extra is not None and mtp is not None:
            extra["mtp_loss"] = mtp
        return total

    trace = trace if trace is not None else Trace(timers.clock)  # its F/B/W events give the time split
    runner = ScheduleExecutor(resolve_schedule(t.pipeline_schedule, grid.layout.pp, len(chunks)), chunks,
                              micro_batches, grid, activation_shape(chunks[0], micro_batches[0]["tokens"].shape[0]),
                              lambda c, x, b: stage_forward(c, x, b, t), loss_fn, trace=trace,
                              loss_scale=loss_scale, dtype=next(chunks[0].parameters()).dtype, device=device)
    runner.run()
    timers.add_trace(trace)  # read with the step's other times, at the log line
    main = torch.stack([r[0] for r in record]).sum() / num_micro if record else torch.zeros((), device=device)
    total, mtp = reported_losses(main, record, num_micro, grid.pp_group, mtp=has_mtp)
    if extra is not None and mtp is not None:
        extra["mtp_loss"] = mtp
    return total


def moe_stats(model, micro_batches, grid) -> dict | None:
    dp = grid.layout.dp if grid is not None else 1
    return moe_step_stats(as_chunks(model), grid, len(micro_batches) * dp)


def clip_coefficient(norm: torch.Tensor, max_norm: float, found_inf: torch.Tensor) -> torch.Tensor | float:
    """``min(1, max_norm / (norm + 1e-6))`` on the device (1 where the norm is not finite, a
    step that is skipped anyway); 1.0 without clipping."""
    if max_norm <= 0:
        return 1.0
    coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return torch.where(found_inf, torch.ones_like(coeff), coeff)


def train_step(model, optimizer: DistributedOptimizer, micro_batches, t: TrainConfig, iteration: int,
               scaler: LossScaler, grid=None, trace=None) -> StepResult:
    """One step with the data-parallel optimizer (DDP / ZeRO): gradients are reduced in
    buckets during backward, then unscaled, measured, clipped and applied on the shards.
    No host sync: the inf/NaN skip, the clip coefficient and the loss scale are device
    values (see :mod:`megalite.observe.step_values`)."""
    optimizer.zero_grad(num_micro=len(micro_batches))
    start_qk_clip_step(as_chunks(model), t)  # a fresh per-head max logit for the forwards (QK-clip)
    timers = StepTimers(Clock(model_device(model)))
    extra: dict = {}
    loss = forward_backward(model, micro_batches, t, scaler.scale, grid, trace, timers, extra)
    start = timers.mark()
    optimizer.finish_grad_sync()
    middle = timers.mark()
    timers.add("grad_sync", start, middle)
    norm = optimizer.grad_norm(scaler.scale)
    found_inf = ~torch.isfinite(norm)
    scaler.update(found_inf)
    lr = lr_at(iteration, t)
    optimizer.step(lr, clip_coefficient(norm, t.clip_grad, found_inf), found_inf)
    balance_after_step(as_chunks(model), grid)  # aux-loss-free expert biases, from the step's loads
    max_logit = qk_clip_after_step(as_chunks(model), optimizer, grid, t)  # rescale over-threshold heads
    timers.add("optimizer", middle, timers.mark())
    loss, mtp = data_parallel_mean(loss, extra.get("mtp_loss"), grid)
    return StepResult(loss, norm, lr, scaler.scale, found_inf, timers, moe_stats(model, micro_batches, grid),
                      mtp_loss=mtp, max_attention_logit=max_logit)


def data_parallel_mean(loss: torch.Tensor, mtp: torch.Tensor | None, grid):
    """The step's loss (and MTP loss) averaged over DP x CP: one all-reduce."""
    if grid is None:
        return loss, mtp
    n = comm.group_size(grid.dp_cp_group)
    if mtp is None:
        comm.all_reduce(loss, grid.dp_cp_group)
        return loss / n, None
    both = comm.all_reduce(torch.stack([loss, mtp]), grid.dp_cp_group) / n
    return both[0], both[1]


@torch.no_grad()
def evaluate(model, batches, t: TrainConfig, grid=None) -> float:
    """Mean (main) loss over the given micro-batches, averaged over data-parallel ranks."""
    chunks = as_chunks(model)
    batches = prepared_batches(chunks, batches, grid)
    record: list = []
    loss_fn = functools.partial(stage_loss, record=record)
    for c in chunks:
        c.eval()
    if grid is None or (grid.layout.pp == 1 and len(chunks) == 1):
        for b in batches:
            loss_fn(stage_forward(chunks[0], None, b, t), b)
    else:

        runner = ScheduleExecutor(resolve_schedule(t.pipeline_schedule, grid.layout.pp, len(chunks), evaluation=True),
                                  chunks, batches, grid, activation_shape(chunks[0], batches[0]["tokens"].shape[0]),
                                  lambda c, x, b: stage_forward(c, x, b, t), loss_fn,
                                  dtype=next(chunks[0].parameters()).dtype, device=model_device(chunks))
        runner.run()
    for c in chunks:
        c.train()
    losses = [r[0] for r in record]
    total = torch.stack(losses).sum() / len(batches) if losses else torch.zeros((), device=model_device(chunks))
    if grid is not None:
        comm.all_reduce(total, grid.pp_group)
        comm.all_reduce(total, grid.dp_cp_group)
        total /= comm.group_size(grid.dp_cp_group)
    return host_value(total)
