"""The context-parallel communication types (Megatron's ``--cp-comm-type`` names), defined once.

Every module that names a CP type reads it here: the flag's choices, the rules of
:mod:`.checks`, the dispatch of :mod:`.attention`, the traffic theory of :mod:`.traffic`, the
planner's candidates and printed flags. :func:`cp_comm_type` is the one place an unknown name is
refused, with one message.

A type is described by what its exchange needs (C = CP ranks, H = heads per TP rank):

- ``all_to_all``: it swaps the sequence shard for a head shard over an all-to-all group, so that
  group's size must divide H, and the group should sit inside a node (``a2a``: all C ranks);
- ``hierarchical``: it splits the CP group into A x B = C (all-to-all over the inner A, the ring
  over the outer B; ``--hierarchical-context-parallel-sizes A B``), so the grid makes the
  ``cp_inner`` and ``cp_outer`` groups for it (``a2a+p2p``).
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.errors import ConfigError


@dataclass(frozen=True)
class CPCommType:
    name: str  # the --cp-comm-type value
    summary: str  # how it moves K/V (the flag's help and the docs say more)
    all_to_all: bool = False  # has an all-to-all group whose size must divide the heads per TP rank
    hierarchical: bool = False  # splits the CP group A x B (inner all-to-all, outer ring)


CP_TYPES = (
    CPCommType("p2p", "ring of K/V blocks"),
    CPCommType("a2a", "Ulysses all-to-all", all_to_all=True),
    CPCommType("allgather", "allgather of K/V"),
    CPCommType("a2a+p2p", "all-to-all inside, ring across", all_to_all=True, hierarchical=True),
)
CP_COMM_TYPES = tuple(t.name for t in CP_TYPES)  # the flag's choices, in this order
DEFAULT_CP_COMM_TYPE = CP_TYPES[0].name
HIERARCHICAL = next(t.name for t in CP_TYPES if t.hierarchical)  # a2a+p2p
_BY_NAME = {t.name: t for t in CP_TYPES}


def cp_comm_type(name: str) -> CPCommType:
    """The type called ``name``; an unknown name is refused here, and only here."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ConfigError(f"--cp-comm-type {name!r} is unknown. Fix: use one of "
                          f"{', '.join(CP_COMM_TYPES)}.") from None


def is_hierarchical(name: str) -> bool:
    """Whether the type splits the CP group into inner x outer (A x B) groups."""
    return cp_comm_type(name).hierarchical
