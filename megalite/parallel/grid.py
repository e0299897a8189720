"""The process grid: a rank's torch.distributed process groups over the grid's layout.

The layout (:class:`GridLayout`: the rank order ``rank = tp + TP * (cp + CP * (dp + DP * pp))``,
each rank's coordinate, the expert and hierarchical-CP orders, and the ranks of every group) is
pure arithmetic, in :mod:`megalite.parallel.grid_layout`; its names are importable from here too.
:class:`ProcessGrid` creates the torch.distributed groups. Every rank must call ``new_group``
for every group, in the same order, even the groups it is not in: ``ProcessGrid`` does that by
walking the same lists on every rank.
"""
from __future__ import annotations

import os

from megalite.config_types import ConfigError, ParallelConfig
from megalite.parallel.grid_layout import (CP_HIERARCHY_KINDS, DIMS, EXPERT_KINDS, GROUP_DIMS,  # noqa: F401 - re-exported
                                           GROUP_ORDER, Coord, GridLayout)


def gpus_per_node_from_env(world_size: int) -> int:
    """GPUs (processes) per node as torchrun reports it; single node if unknown."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


class ProcessGrid:
    """A rank's view of the layout, with its torch.distributed process groups.

    Attributes: ``layout``, ``rank``, ``coord``, and for each kind in GROUP_ORDER the group
    object (``tp_group``, ``dp_group``, ...) and its ranks (``tp_ranks``, ...).
    """

    def __init__(self, layout: GridLayout, rank: int, gpus_per_node: int | None = None,
                 backend: str | None = None, timeout=None):
        import torch.distributed as dist

        self.layout = layout
        self.rank = rank
        self.coord = layout.coord(rank)
        self.gpus_per_node = gpus_per_node or layout.world_size
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and dist.get_world_size() != layout.world_size:
            raise ConfigError(f"the process group has {dist.get_world_size()} ranks but the grid "
                              f"{layout} needs {layout.world_size}.")
        groups = create_groups(layout, rank, backend, timeout) if distributed else {}
        for kind in GROUP_ORDER:
            if kind in EXPERT_KINDS and not layout.experts:
                setattr(self, f"{kind}_group", None)
                setattr(self, f"{kind}_ranks", [rank])
                continue
            ranks = layout.group_of(kind, rank) if kind != "embedding" else self._embedding_ranks(layout, rank)
            setattr(self, f"{kind}_group", groups.get(kind))  # a group of one is None: nothing to send
            setattr(self, f"{kind}_ranks", ranks or [rank])
        # Host-side control values (stop flags) travel on gloo, never through a GPU stream.
        self.control_group = _control_group(timeout) if distributed else None
        self.neighbours = layout.neighbours(rank)

    @staticmethod
    def _embedding_ranks(layout: GridLayout, rank: int) -> list[int]:
        for ranks in layout.groups("embedding"):
            if rank in ranks:
                return ranks
        return []  # a middle pipeline stage is in no embedding group

    # Convenience accessors, so model and training code never compute ranks themselves.
    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def cp_rank(self) -> int:
        return self.coord.cp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def ep_rank(self) -> int:
        return self.layout.expert_coord(self.rank)[0]

    @property
    def edp_rank(self) -> int:
        return self.layout.expert_coord(self.rank)[1]

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.layout.pp - 1

    @property
    def cp_hierarchy(self) -> tuple:
        """(inner, outer) groups of hierarchical context parallelism (None = one rank),
        what ``megalite.context_parallel.attention.ContextParallelGroups`` takes after the CP group."""
        return self.cp_inner_group, self.cp_outer_group

    def describe(self) -> str:
        return self.layout.describe(self.gpus_per_node)


_GROUPS: dict = {}  # the current world's groups, for grids built more than once in one world


def forget_groups() -> None:
    """Drop the cached groups of the world that ended (``launch.leave_world``): the last
    reference megalite holds to them, so their communicators are freed now."""
    _GROUPS.clear()


def group_plan(layout: GridLayout) -> list[tuple[str, list[list[int]]]]:
    """For each kind in GROUP_ORDER, its groups of more than one rank (a group of one needs
    no communicator). The groups of one kind never overlap."""
    return [(kind, [g for g in layout.groups(kind) if len(g) > 1]) for kind in GROUP_ORDER]


def create_groups(layout: GridLayout, rank: int, backend=None, timeout=None) -> dict:
    """This rank's process group of every kind (None where it is in no group of 2+ ranks).
    Two kinds with the same groups share one communicator.

    - NCCL with the default group bound to a GPU (``device_id``): ``split_group`` once per
      kind, called by every rank with the kind's whole partition: one ``ncclCommSplit`` per
      kind rather than one communicator bootstrap (and, for non-members, one split) per group.
    - gloo and fake: ``new_group(..., use_local_synchronization=True)`` for this rank's own
      groups only: no store round trip for every rank of the world per group.
    """
    import torch.distributed as dist

    from megalite.device import register_meta

    if _GROUPS.get("world") is not dist.group.WORLD:  # a new world: the old groups are gone
        _GROUPS.clear()
        _GROUPS["world"] = dist.group.WORLD
    split = (dist.get_backend() == "nccl" and backend in (None, "nccl")
             and getattr(dist.group.WORLD, "bound_device_id", None) is not None and hasattr(dist, "split_group"))
    out = {}
    for kind, partition in group_plan(layout):
        if not partition:
            out[kind] = None
            continue
        if split:
            key = ("split",) + tuple(map(tuple, partition))
            if key not in _GROUPS:  # every rank calls, with the same partition
                _GROUPS[key] = dist.split_group(split_ranks=partition, timeout=timeout)
            out[kind] = _GROUPS[key]
            continue
        mine = next((g for g in partition if rank in g), None)
        if mine is None:
            out[kind] = None
            continue
        # Named after the rank list, so one rank list is created once per world.
        key = tuple(mine)
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(mine, backend=backend, timeout=timeout, use_local_synchronization=True)
            register_meta(_GROUPS[key])
        out[kind] = _GROUPS[key]
    return out


def _control_group(timeout):
    """A gloo group over the world for host-side values: the default group itself when it is
    gloo (or fake), a new gloo group when the default is NCCL."""
    import torch.distributed as dist

    if dist.get_backend() in ("gloo", "fake"):
        return None  # None = the default group
    return dist.new_group(backend="gloo", timeout=timeout)


def build_grid(parallel: ParallelConfig, world_size: int, rank: int,
               gpus_per_node: int | None = None, timeout=None, experts: bool = False) -> ProcessGrid:
    """Validate the layout against the world and the machine, then build the groups
    (``timeout``: a timedelta for every collective on them; torch's default otherwise;
    ``experts``: the model has experts, so the ep/edp groups are made too)."""
    gpus_per_node = gpus_per_node or gpus_per_node_from_env(world_size)
    layout = GridLayout.from_config(parallel, world_size, experts)
    return ProcessGrid(layout, rank, gpus_per_node, timeout=timeout)
