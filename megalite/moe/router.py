"""Top-k router with the load-balancing auxiliary loss, z-loss and capacity.

The softmax router (below) is the default; sigmoid scores, group-limited top-k, the routed
scaling factor and the expert bias of DeepSeek-V3 are :mod:`megalite.moe.scoring`'s (with
sigmoid scores the aux loss's ``p`` is the scores normalised over the experts per token).

For tokens ``x`` (T, h) and router weight ``W`` (E, h)::

    logits = x W^T                      (T, E), computed in fp32, autocast or not
    p      = softmax(logits)            over the E experts
    (v, i) = topk(p, k)                 the k chosen experts of each token
    w      = v / sum_j v_j              weights renormalized over the chosen k

Renormalizing over the chosen k is Mixtral's choice (``softmax -> topk -> /sum``): the
combined output is a convex combination of the k experts whatever k is. (GShard / Switch with
k=1 keep the raw probability instead; with k=1 renormalizing would make every weight 1 and
cut the router out of the main loss gradient, so for k=1 we keep ``w = v``.)

Load-balancing loss (Switch Transformer, GShard; Megatron's ``switch_load_balancing_loss``)::

    f_e = (number of the T*k top-k assignments that chose e) / (T*k)     not differentiable
    P_e = mean_t p[t, e]                                                  differentiable
    aux = E * sum_e f_e * P_e                   (= 1 under perfectly uniform routing)

``f_e`` counts the assignments *before* capacity dropping (what the router asked for).

z-loss (ST-MoE): ``z = mean_t logsumexp(logits[t])^2``, keeps the logits small.

**fp32 under autocast.** Autocast casts ``linear``'s inputs to its 16-bit dtype whatever they
are, so ``F.linear(x.float(), W.float())`` alone would give bf16 logits: top-k would choose
among rounded probabilities and the z-loss square rounded log-sum-exps. The logits, softmax,
top-k and both losses are computed with autocast disabled for the input's device type.

**Over a token group.** The tokens of one micro-batch may be spread over several ranks: under
sequence parallelism each TP rank holds s/TP positions, under context parallelism each CP
rank holds its chunks of every sequence. The router is given that ``token_group`` (Megatron
reduces its load-balancing statistics over the same TP x CP ranks) and computes the losses of
the *whole micro-batch*, exactly as the serial model does:

- ``f_e`` from the assignment counts all-reduced over the group (E integers; no gradient, so
  no conjugate), divided by the group's ``T_global * k`` assignments;
- this rank returns its **share** of each loss: ``aux = E * sum_e f_e * (sum_{local t} p[t,e])
  / T_global`` and ``z = sum_{local t} lse_t^2 / T_global``. The shares sum over the group to
  the micro-batch's losses, and since each share is linear in the local probabilities, the
  gradient of a share with respect to this rank's tokens is the gradient of the whole loss:
  no differentiable collective is needed. (How a share enters the backward so that it adds
  up the way the main loss does is the caller's business: see :mod:`megalite.moe.layer`.)

Different micro-batches (data-parallel ranks, also when they are one expert-parallel group)
are routed independently, as the serial model routes each micro-batch: expert parallelism
moves tokens to the experts but never changes which experts they pick.

**Capacity.** ``capacity_factor=None`` is dropless. With a factor ``cf``, each expert keeps at
most ``C = ceil(cf * T_global * k / E)`` assignments of the micro-batch. Assignments are served
first come, first served in the serial order of the micro-batch's tokens (the flattened
(s, b) order of the serial model; within a token, its 1st choice before its 2nd). Over a token
group, each rank passes ``token_index``, its tokens' places in that order (the rank-order
concatenation when omitted); the ids are all-gathered (T_global*k integers), every rank runs
the same first-come count over the whole micro-batch and keeps its own rows. So the same
assignments are dropped under any layout as in the serial model. Under the fake process
group the all-gather writes nothing (on a GPU its buffer is garbage, used as indices): there
every rank is taken to have routed as this one, in rank order. A dropped assignment gets
weight 0 and is not sent to any expert; the kept weights are *not* renormalized (a token
whose choices are all dropped passes through the residual only).
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.device import is_fake
from megalite.moe.scoring import choose_experts, router_scores, topk_weights
from megalite.moe.settings import check_routing
from megalite.parallel import comm


class RouterOutput(NamedTuple):
    weights: torch.Tensor           # (T, k) combine weights, 0 where dropped
    expert_ids: torch.Tensor        # (T, k) int64 global expert ids
    aux_loss: torch.Tensor          # scalar: this rank's share of E * sum_e f_e P_e (module docstring)
    z_loss: torch.Tensor            # scalar: this rank's share of mean logsumexp(logits)^2
    tokens_per_expert: torch.Tensor  # (E,) int64: kept assignments of this rank's tokens
    kept: torch.Tensor              # (T, k) bool: False where capacity dropped the assignment


def capacity(capacity_factor: float, tokens: int, topk: int, num_experts: int) -> int:
    """``ceil(cf * T * k / E)``: assignments an expert keeps (T: global tokens)."""
    return int(math.ceil(capacity_factor * (tokens * topk) / num_experts))


def expert_counts(expert_ids: torch.Tensor, num_experts: int, kept: torch.Tensor | None = None):
    """(E,) int64 number of (kept) assignments per expert; on the ids' device, meta-safe
    (a scatter-add rather than ``bincount``, whose output shape would depend on the data)."""
    ids = expert_ids.reshape(-1)
    ones = torch.ones_like(ids) if kept is None else kept.reshape(-1).to(ids.dtype)
    return torch.zeros(num_experts, dtype=ids.dtype, device=ids.device).scatter_add_(0, ids, ones)


def first_come_kept(ids: torch.Tensor, num_experts: int, cap: float) -> torch.Tensor:
    """(T, k) bool: whether each assignment is among the first ``cap`` to its expert, in token
    order then choice order."""
    flat = ids.reshape(-1)
    onehot = F.one_hot(flat, num_experts)  # (T*k, E) ints; O(T*k*E), fine at these sizes
    position = onehot.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1
    return (position.double() < cap).view_as(ids)


def full_precision(device: torch.device):
    """Autocast off for ``device``'s type (a no-op context where autocast does not exist: meta)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class TopKRouter(nn.Module):
    """``forward(x (T, h), token_group=None, token_index=None) -> RouterOutput``; see the
    module docstring. ``score_function``, ``num_groups`` / ``group_topk``, ``scaling_factor``:
    the scores, the group-limited choice and the weights of :mod:`megalite.moe.scoring`
    (defaults: the softmax router above). ``expert_bias``: aux-loss-free balancing
    (:mod:`megalite.moe.balancing`): an fp32 buffer ``expert_bias`` (E,) added to the scores for
    the choice only, and ``bias_tokens`` (E,) int64, the assignments counted since its last
    update (the layer counts training forwards)."""

    def __init__(self, hidden: int, num_experts: int, topk: int, capacity_factor: float | None = None,
                 score_function: str = "softmax", num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, expert_bias: bool = False):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor}")
        problem = check_routing(num_experts, topk, num_groups, group_topk, score_function)
        if problem:
            raise ValueError(problem)
        self.num_experts, self.topk, self.capacity_factor = num_experts, topk, capacity_factor
        self.score_function, self.num_groups, self.group_topk = score_function, num_groups, group_topk
        self.scaling_factor = scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("bias_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        else:
            self.expert_bias = self.bias_tokens = None

    def _apply(self, fn, recurse=True):
        """``.to(bf16)`` / ``.half()`` leave the expert bias fp32 (its 1e-3 steps would round away)."""
        bias = self.expert_bias
        out = super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:  # the fp32 values, on the new device
            self.expert_bias = bias.to(self.expert_bias.device)
        return out

    def forward(self, x: torch.Tensor, token_group=None, token_index: torch.Tensor | None = None) -> RouterOutput:
        E, k = self.num_experts, self.topk
        T, G = x.shape[0], comm.group_size(token_group)
        t_global = T * G  # every rank of the group holds as many tokens
        with full_precision(x.device):
            logits = F.linear(x.float(), self.weight.float())  # (T, E) fp32
            scores = router_scores(logits, self.score_function)
            ids = choose_experts(scores, k, self.expert_bias, self.num_groups, self.group_topk)
            weights = topk_weights(scores, ids, self.scaling_factor)
            # the aux loss's P_e: a distribution over the experts (sigmoid scores normalised per token)
            probs = scores if self.score_function == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
            requested = expert_counts(ids, E)  # (E,) this rank's assignments, before dropping
            total = comm.all_reduce(requested.clone(), token_group)  # the micro-batch's (no gradient)
            f = total.to(probs.dtype) / max(1, t_global * k)
            aux_loss = E * (f * probs.sum(dim=0)).sum() / max(1, t_global)
            z_loss = torch.logsumexp(logits, dim=-1).square().sum() / max(1, t_global)

        if self.capacity_factor is None:
            kept = torch.ones_like(ids, dtype=torch.bool)
        else:
            cap = float(capacity(self.capacity_factor, t_global, k, E))
            if G == 1:
                kept = first_come_kept(ids, E, cap)
            else:
                rank = comm.group_rank(token_group)
                if token_index is None:
                    token_index = torch.arange(rank * T, (rank + 1) * T, device=ids.device)
                all_ids = comm.all_gather_dim0(ids, token_group)  # (T_global, k), rank order
                all_index = comm.all_gather_dim0(token_index.to(ids.device), token_group)
                if is_fake():  # nothing was gathered (module docstring)
                    all_ids = ids.repeat(G, 1)
                    all_index = torch.arange(t_global, device=ids.device)
                ordered = torch.empty_like(all_ids).index_copy_(0, all_index, all_ids)  # serial order
                kept = first_come_kept(ordered, E, cap).index_select(0, token_index.to(ids.device))
            weights = weights * kept.to(weights.dtype)
        tokens_per_expert = expert_counts(ids, E, kept)
        return RouterOutput(weights, ids, aux_loss, z_loss, tokens_per_expert, kept)
