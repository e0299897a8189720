"""How a tensor-parallel parameter relates to its full (TP=1) tensor.

A parameter split over TP carries ``param.tp_split = TPSplit(dim, sections)``: the full
tensor is cut along ``dim`` into ``sections`` equal sections (e.g. 2 for a fused
[gate; up] SwiGLU weight) and every section into TP equal chunks; rank r holds chunk r of
each section, concatenated. With one section this is a plain contiguous split.

Parameters replicated over TP that see only a sequence shard under sequence parallelism
(norm weights and biases, row-parallel biases, position embeddings) carry
``param.sequence_parallel = True``: their gradients are partial sums over the TP ranks'
sequence shards and must be all-reduced over TP before the optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.parallel.comm import all_gather_dim0, group_size


@dataclass(frozen=True)
class TPSplit:
    dim: int
    sections: int = 1


def shard_tensor(full: torch.Tensor, split: TPSplit, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor."""
    sections = full.chunk(split.sections, dim=split.dim)
    return torch.cat([s.chunk(size, dim=split.dim)[rank] for s in sections], dim=split.dim)


def unshard_tensors(shards: list[torch.Tensor], split: TPSplit) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order); inverse of shard_tensor."""
    per_rank = [s.chunk(split.sections, dim=split.dim) for s in shards]
    return torch.cat([torch.cat([chunks[k] for chunks in per_rank], dim=split.dim)
                      for k in range(split.sections)], dim=split.dim)


def mark_tensor_parallel(param: torch.nn.Parameter, full_shape, split: TPSplit, rank: int,
                         size: int) -> None:
    """Attach the split spec; ``init_weights`` draws ``full_shape`` and applies ``shard_fn``."""
    param.tp_split = split
    param.full_shape = tuple(full_shape)
    param.shard_fn = lambda full: shard_tensor(full, split, rank, size)


def mark_sequence_parallel(param: torch.nn.Parameter) -> None:
    param.sequence_parallel = True


def is_tensor_parallel(param) -> bool:
    return getattr(param, "tp_split", None) is not None


def is_expert(param) -> bool:
    """A stacked expert parameter (mixture of experts): this rank's E/EP experts, replicated over
    the expert-data-parallel ranks (see megalite.moe.layer), not over DP."""
    return getattr(param, "expert_parallel", False)


def gather_full(tensor: torch.Tensor, split: TPSplit | None, group) -> torch.Tensor:
    """All-gather the TP shards of ``tensor`` (a parameter or its gradient) into the full one."""
    if split is None or group_size(group) == 1:
        return tensor
    world = group_size(group)
    gathered = all_gather_dim0(tensor.detach().reshape(1, -1), group)
    return unshard_tensors([g.view_as(tensor) for g in gathered.chunk(world)], split)


def sum_local_tied_copies(grads: list[torch.Tensor]) -> bool:
    """Both copies of a tied embedding on this rank (ZBV: rank 0 holds the embedding chunk
    and the loss chunk): their sum, in place in both, replaces the embedding-group all-reduce
    (the group's other rank holds no copy). False when this rank holds one copy or none."""
    if len(grads) != 2:
        return False
    grads[0].add_(grads[1])
    grads[1].copy_(grads[0])
    return True
