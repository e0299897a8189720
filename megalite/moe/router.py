"""Top-k softmax router with the load-balancing auxiliary loss, z-loss and capacity.

For tokens ``x`` (T, h) and router weight ``W`` (E, h)::

    logits = x W^T                      (T, E), computed in fp32
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

**Over an expert-parallel group** whose ranks hold different tokens (EP ranks are DP ranks),
the "global batch" is the concatenation of the ranks' tokens in rank order. One all-gather of
the per-rank, per-expert assignment counts (E integers per rank; no gradient, so no conjugate)
gives every rank

- ``f_e`` over the global batch, and
- the number of assignments to each expert on lower ranks (for capacity, below).

The aux loss a rank returns is ``E * sum_e f_e(global) * P_e(local)``. It is linear in the
local probabilities, so the mean of the ranks' values is exactly the serial aux loss of the
whole batch, and under the data-parallel convention (objective = mean over ranks of each rank's
loss, gradients averaged over ranks) its gradient is exactly the serial one -- no differentiable
collective needed. When every rank holds the same tokens it equals the serial value outright.
The z-loss is a per-token mean, so the same holds for it with no communication at all.

**Capacity.** ``capacity_factor=None`` is dropless. With a factor ``cf``, each expert keeps at
most ``C = ceil(cf * T_global * k / E)`` assignments, where ``T_global`` is the number of tokens
over the whole EP group (the batch before EP splitting). Assignments are served first come,
first served in global token order (token ``t`` of rank ``r`` is token ``r*T + t``; within a
token, its 1st choice before its 2nd). A dropped assignment gets weight 0 and is not sent to
any expert; the kept weights are *not* renormalized (a token whose choices are all dropped
passes through the residual only). Since positions are counted in global order, the same
assignments are dropped under any EP size as in the serial layer over the whole batch.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.parallel import comm


class RouterOutput(NamedTuple):
    weights: torch.Tensor           # (T, k) combine weights, 0 where dropped
    expert_ids: torch.Tensor        # (T, k) int64 global expert ids
    aux_loss: torch.Tensor          # scalar: E * sum_e f_e P_e  (see module docstring)
    z_loss: torch.Tensor            # scalar: mean logsumexp(logits)^2
    tokens_per_expert: torch.Tensor  # (E,) int64: kept assignments of this rank's tokens
    kept: torch.Tensor              # (T, k) bool: False where capacity dropped the assignment


def capacity(capacity_factor: float, tokens: int, topk: int, num_experts: int) -> int:
    """``ceil(cf * T * k / E)``: assignments an expert keeps (T: global tokens)."""
    return int(math.ceil(capacity_factor * (tokens * topk) / num_experts))  # as forward computes it


def expert_counts(expert_ids: torch.Tensor, num_experts: int, kept: torch.Tensor | None = None):
    """(E,) int64 number of (kept) assignments per expert; on the ids' device, meta-safe
    (a scatter-add rather than ``bincount``, whose output shape would depend on the data)."""
    ids = expert_ids.reshape(-1)
    ones = torch.ones_like(ids) if kept is None else kept.reshape(-1).to(ids.dtype)
    return torch.zeros(num_experts, dtype=ids.dtype, device=ids.device).scatter_add_(0, ids, ones)


class TopKRouter(nn.Module):
    """``forward(x (T, h), ep_group=None) -> RouterOutput``; see the module docstring."""

    def __init__(self, hidden: int, num_experts: int, topk: int, capacity_factor: float | None = None):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor}")
        self.num_experts, self.topk, self.capacity_factor = num_experts, topk, capacity_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor, ep_group=None) -> RouterOutput:
        E, k = self.num_experts, self.topk
        T = x.shape[0]
        logits = F.linear(x.float(), self.weight.float())  # (T, E) fp32
        probs = logits.softmax(dim=-1)
        top_p, ids = probs.topk(k, dim=-1)
        weights = top_p / top_p.sum(dim=-1, keepdim=True) if k > 1 else top_p

        requested = expert_counts(ids, E)  # (E,) this rank's assignments, before dropping
        if comm.group_size(ep_group) > 1:
            # (P, E): every rank's requested counts, rank order. No gradient flows here.
            per_rank = comm.all_gather_dim0(requested, ep_group).view(-1, E)
            rank = comm.group_rank(ep_group)
            total = per_rank.sum(0)
            before_me = per_rank[:rank].sum(0)
        else:
            total, before_me = requested, torch.zeros_like(requested)
        global_assignments = total.sum()  # = T_global * k
        f = total.to(probs.dtype) / global_assignments.clamp(min=1).to(probs.dtype)
        aux_loss = E * (f * probs.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()

        if self.capacity_factor is None:
            kept = torch.ones_like(ids, dtype=torch.bool)
        else:
            # global_assignments = T_global * k: every token makes exactly k assignments.
            cap = torch.ceil(self.capacity_factor * global_assignments.double() / E)
            flat = ids.reshape(-1)  # token order, then choice order
            onehot = F.one_hot(flat, E)  # (T*k, E); O(T*k*E) ints, fine for a first version
            position = onehot.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1
            position = position + before_me.gather(0, flat)  # place in the global order
            kept = (position.double() < cap).view_as(ids)
            weights = weights * kept.to(weights.dtype)
        tokens_per_expert = expert_counts(ids, E, kept)
        return RouterOutput(weights, ids, aux_loss, z_loss, tokens_per_expert, kept)
