"""Aux-loss-free load balancing (DeepSeek-V3; Megatron's ``--moe-router-enable-expert-bias``).

Each MoE layer's router holds a bias ``b`` (E,), fp32, added to the scores for choosing the
experts only (:mod:`megalite.moe.scoring`): the combine weights and the gradients never see it,
and no optimizer touches it (a buffer, not a parameter). After each optimizer step::

    n_e    = assignments routed to expert e over the whole global batch (every micro-batch of
             every data-parallel rank, every sequence / context shard), kept ones
    nbar   = (1/E) sum_e n_e
    b_e   += rate * sign(nbar - n_e)          (underloaded experts up, overloaded down; 0 if equal)

**The same on every rank and every layout.** The counts are integers, summed exactly: this rank's
count since the last update (``router.bias_tokens``, added by each training forward, not by the
recomputation inside backward) is all-reduced over the pipeline stage's ranks (TP x CP x DP:
every rank of a stage holds different tokens, since MoE under TP needs sequence parallelism; EP
groups lie inside the stage). Every rank then applies the same fp32 update to the same bias, so
the biases stay bit-identical whatever the layout. One int64 all-reduce of (MoE layers x E)
numbers per stage per step; nothing is read on the host.
"""
from __future__ import annotations

import torch

from megalite.moe.layer import MoELayer
from megalite.parallel import comm


def biased_layers(chunks) -> list[MoELayer]:
    """This rank's MoE layers that have an expert bias, in a fixed order (chunk, then module)."""
    return [m for chunk in chunks for m in chunk.modules()
            if isinstance(m, MoELayer) and m.router.expert_bias is not None]


@torch.no_grad()
def bias_step(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """``bias += rate * sign(mean(counts) - counts)`` in place (the module docstring's rule)."""
    counts = counts.to(torch.float64)
    bias.add_(torch.sign(counts.mean() - counts).to(bias.dtype), alpha=rate)


@torch.no_grad()
def balance_after_step(chunks, grid) -> None:
    """The train step's call after the optimizer's: with ``--moe-router-enable-expert-bias``,
    :func:`update_expert_biases` over the pipeline stage's ranks; nothing otherwise."""
    cfg = chunks[0].cfg
    if cfg.num_experts and cfg.moe_router_enable_expert_bias:
        update_expert_biases(chunks, cfg.moe_router_bias_update_rate, getattr(grid, "stage_group", None))


def update_expert_biases(chunks, rate: float, group=None) -> None:
    """After the optimizer step: the global batch's loads (this rank's counts all-reduced over
    ``group``, the stage's TP x CP x DP ranks) nudge each layer's bias; the counts restart.
    A collective over ``group`` when any layer has a bias (every rank of a stage has the same
    layers)."""
    layers = biased_layers(chunks)
    if not layers:
        return
    counts = torch.stack([layer.router.bias_tokens for layer in layers])  # (layers, E) int64
    comm.all_reduce(counts, group)
    for layer, count in zip(layers, counts):
        bias_step(layer.router.expert_bias, count, rate)
        layer.router.bias_tokens.zero_()
