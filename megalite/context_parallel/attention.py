"""Context-parallel attention, four ways (Megatron's ``--cp-comm-type`` names).

Each rank of the CP group (C ranks) holds a load-balanced shard of the sequence
(``context_parallel.data``); every way computes exact attention of its queries over the
whole sequence, and all give the same numbers up to rounding:

- ``p2p``: the ring (:mod:`.ring_attention`). K/V blocks travel round the C ranks, C steps per
  layer, each transfer overlapping a block of compute; memory O(s/C); point-to-point only,
  so it crosses nodes well. The default.
- ``a2a``: DeepSpeed-Ulysses (:mod:`.ulysses`). Four all-to-alls (q, k, v in, out back) give
  each rank all of the sequence for heads/C of the heads; needs the heads per TP rank
  divisible by C. Moves the least data inside a node.
- ``allgather``: K and V all-gathered (:mod:`.allgather`), the queries stay local. The
  simplest to combine with any mask; holds the full K/V while a layer computes.
- ``a2a+p2p``: hierarchical, all-to-all inside an inner group of A ranks (inside a node), the
  ring across the outer group of B = C/A (``--hierarchical-context-parallel-sizes A B``).

Packed documents (``documents``): the whole sequence's ``doc_start`` / ``doc_end`` (b, s) in
absolute positions, on every rank (``context_parallel_slice`` leaves them whole); each way
hands them to its blocks with absolute offsets (see each module's docstring).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megalite.context_parallel.allgather import allgather_attention
from megalite.context_parallel.comm_types import CP_COMM_TYPES, cp_comm_type  # noqa: F401 - re-exported
from megalite.context_parallel.ring_attention import ring_attention
from megalite.context_parallel.ulysses import ulysses_attention
from megalite.layers.documents import Documents


class ContextParallelGroups(NamedTuple):
    """The process groups context-parallel attention talks over. ``group``: all C ranks;
    ``inner`` / ``outer``: for a2a+p2p, the all-to-all group (A ranks, consecutive CP ranks,
    inside a node) and the ring group (B ranks, one of each inner group); else None."""
    group: object
    inner: object = None
    outer: object = None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               groups: ContextParallelGroups, comm_type: str = "p2p", *,
                               causal: bool = True, backend: str = "auto",
                               documents: Documents | None = None,
                               logit_max: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's queries (b, heads, s_local, d) over the whole sequence's keys and
    values (b, groups, s_local, d; v's head size may differ, and the output has it), by
    ``comm_type`` (see the module docstring); ``documents``: packed documents of the whole
    sequence, or None; ``logit_max``: (heads,) float32, raised in place to each head's largest
    visible logit of this rank's share of the work (QK-clip; the max over the CP group, taken
    after the step, is the whole sequence's)."""
    kind = cp_comm_type(comm_type)  # refuses an unknown type
    if kind.hierarchical:
        if groups.inner is None and groups.outer is None:
            raise ValueError(f"{kind.name} context parallelism needs the inner and outer groups "
                             "(--hierarchical-context-parallel-sizes)")
        return ulysses_attention(q, k, v, groups.inner, groups.outer, causal=causal, backend=backend,
                                 documents=documents, logit_max=logit_max)
    if comm_type == "p2p":
        return ring_attention(q, k, v, groups.group, causal=causal, backend=backend, documents=documents,
                              logit_max=logit_max)
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, groups.group, None, causal=causal, backend=backend, documents=documents,
                                 logit_max=logit_max)
    return allgather_attention(q, k, v, groups.group, causal=causal, backend=backend, documents=documents,
                               logit_max=logit_max)
