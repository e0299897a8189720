"""Router scores, the experts a token picks and their weights (softmax or DeepSeek-V3's sigmoid).

For a token's logits ``l`` (E experts), with ``b`` the expert bias (zeros without
aux-loss-free balancing, :mod:`megalite.moe.balancing`)::

    softmax:  s_e = exp(l_e) / sum_j exp(l_j)
    sigmoid:  s_e = 1 / (1 + exp(-l_e))                  (each expert scored on its own)

    chosen    = the k experts of largest s_e + b_e       (b steers the choice only)
    w_e       = s_e / sum_{j in chosen} s_j               for e in chosen (k > 1; k = 1 keeps s_e)
    w_e      *= routed scaling factor                     (default 1: no multiplication at all)

**Group-limited top-k** (DeepSeek-V3's node-limited routing; Megatron's ``--moe-router-num-groups``
/ ``--moe-router-group-topk``): the E experts are split into G contiguous groups of E/G. A
group's score is the sum of the two largest ``s_e + b_e`` inside it (the one largest when a
group has one expert); only the ``group_topk`` best groups are kept, and the k experts are chosen
among the kept groups' experts (the others are masked to -inf). So a token's experts live on at
most ``group_topk`` groups (nodes, when a group is a node's experts under EP).

Ties go as ``torch.topk`` breaks them; with real-valued scores they do not happen.
"""
from __future__ import annotations

import torch

from megalite.moe.settings import SCORE_FUNCTIONS


def router_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """(T, E) scores from fp32 logits: softmax over the experts, or each logit's sigmoid."""
    if score_function == "softmax":
        return logits.softmax(dim=-1)
    if score_function == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"router score function {score_function!r}: expected one of {SCORE_FUNCTIONS}")


def group_limited_topk(selection: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """(T, k) expert ids: the k largest ``selection`` scores among the ``group_topk`` groups of
    largest top-2 sums (module docstring)."""
    T, E = selection.shape
    per_group = E // num_groups
    grouped = selection.view(T, num_groups, per_group)
    group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # (T, G)
    best = group_score.topk(group_topk, dim=-1).indices
    keep = torch.zeros(T, num_groups, dtype=torch.bool, device=selection.device).scatter_(1, best, True)
    masked = selection.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    return masked.topk(topk, dim=-1).indices


def choose_experts(scores: torch.Tensor, topk: int, expert_bias: torch.Tensor | None = None,
                   num_groups: int | None = None, group_topk: int | None = None) -> torch.Tensor:
    """(T, k) expert ids chosen by ``scores + expert_bias`` (plain or group-limited top-k)."""
    selection = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    if num_groups:
        return group_limited_topk(selection, topk, num_groups, group_topk)
    return selection.topk(topk, dim=-1).indices


def topk_weights(scores: torch.Tensor, ids: torch.Tensor, scaling_factor: float | None = None) -> torch.Tensor:
    """(T, k) combine weights: the chosen scores over their sum (k > 1), times the factor."""
    top = scores.gather(1, ids)
    weights = top / top.sum(dim=-1, keepdim=True) if ids.shape[1] > 1 else top
    return weights * scaling_factor if scaling_factor is not None else weights
