"""The grid's arithmetic: every rank's (tp, cp, dp, pp) coordinate and the ranks of each group.

Rank order, fastest-varying first, is tp, cp, dp, pp::

    rank = tp + TP * (cp + CP * (dp + DP * pp))

so consecutive ranks form a tensor-parallel group (inside one node's NVLink) while
pipeline stages and data-parallel replicas span nodes (InfiniBand).

Experts (mixture of experts, :mod:`megalite.moe`) have a second order over the same ranks,
Megatron's ``etp-ep-edp-pp`` with expert-tensor-parallel size 1: inside one pipeline stage,
with ``i = tp + TP * (cp + CP * dp)`` the rank's place among the stage's TP*CP*DP ranks::

    i = ep + EP * edp

so an expert-parallel group is EP consecutive ranks (inside a node while EP <= GPUs per node,
where its all-to-alls run), and the expert-data-parallel group (the ranks holding the same
experts, which reduce their gradients) strides by EP.

Hierarchical context parallelism (``--cp-comm-type a2a+p2p``, sizes A x B = CP) splits each CP
group twice: ``cp_inner`` is A consecutive CP ranks (cp // A equal: the all-to-all group,
T*A consecutive global ranks, inside a node when T*A divides the GPUs per node), ``cp_outer``
the B ranks with equal cp % A (the ring). With A = 1 or A = CP one of them is the CP group
itself and the other is groups of one: no new communicator. A changes which communicators
exist, not any rank's coordinate, shard or random streams, so a run may change it on resume:
it is not part of the layout a checkpoint records (:meth:`GridLayout.record`).

:class:`GridLayout` is pure arithmetic (no processes), so layouts of any size can be tested;
:mod:`megalite.parallel.grid` creates the torch.distributed groups from its lists.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from megalite.config_types import ParallelConfig, validate_layout

DIMS = ("tp", "cp", "dp", "pp")

# Group kinds and the dimensions that vary inside one group of that kind.
GROUP_DIMS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "dp_cp": ("cp", "dp"),  # gradient reduction when CP > 1
    "pp": ("pp",),
    "mp": ("tp", "pp"),  # model parallel: all ranks holding one copy of the model
    "tp_cp": ("tp", "cp"),  # all ranks working on one sequence's copy of a stage
    "stage": ("tp", "cp", "dp"),  # every rank of one pipeline stage (FP8 amax reduction)
}
# ep: the ranks whose tokens meet in one expert all-to-all; edp: the ranks holding the same
# experts (their gradients are summed). Created only for a model with experts.
EXPERT_KINDS = ("ep", "edp")
# Hierarchical context parallelism: the all-to-all (inner) and ring (outer) parts of a CP group.
CP_HIERARCHY_KINDS = ("cp_inner", "cp_outer")
# "stage" last: where its ranks equal another kind's group (one communicator), traffic is
# named after the other kind.
GROUP_ORDER = (("tp", "cp", "dp", "dp_cp", "pp", "mp", "tp_cp", "embedding") + EXPERT_KINDS
               + CP_HIERARCHY_KINDS + ("stage",))


@dataclass(frozen=True)
class Coord:
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class GridLayout:
    """Sizes of the four dimensions; maps ranks to coordinates and lists groups."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1  # expert-parallel size (a divisor of TP*CP*DP)
    experts: bool = False  # whether the model has experts (then the ep/edp groups exist)
    cp_inner: int = 1  # A of hierarchical CP, for the cp_inner / cp_outer groups (module docstring)

    def record(self) -> dict:
        """The layout as a checkpoint records and compares it: every field that decides a
        rank's coordinate, shards or random streams; not ``cp_inner``, which only decides
        which communicators exist (so a run may change its CP communication on resume)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cp_inner"}

    def grid_sizes(self) -> dict:
        """The grid's own fields by name (a subclass, such as the planner's Layout, adds the
        run's choices): ``GridLayout(**layout.grid_sizes())`` is the rank mapping alone."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GridLayout)}

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int, experts: bool = False) -> "GridLayout":
        """The layout of a validated config (the inner size of hierarchical CP from
        ``--hierarchical-context-parallel-sizes``, which validate() accepts only with a2a+p2p)."""
        validate_layout(parallel, world_size)
        sizes = parallel.hierarchical_context_parallel_sizes
        return cls(
            tp=parallel.tensor_model_parallel_size,
            cp=parallel.context_parallel_size,
            dp=parallel.data_parallel_size(world_size),
            pp=parallel.pipeline_model_parallel_size,
            ep=parallel.expert_model_parallel_size,
            experts=experts,
            cp_inner=sizes[0] if sizes else 1,
        )

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ranks of one stage holding the same experts."""
        return self.tp * self.cp * self.dp // self.ep

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, dim: str) -> int:
        return getattr(self, dim)

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        for dim, value in zip(DIMS, (tp, cp, dp, pp)):
            if not 0 <= value < self.size(dim):
                raise ValueError(f"{dim} coordinate {value} outside [0, {self.size(dim)})")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return Coord(tp, cp, dp, pp)

    def groups(self, kind: str) -> list[list[int]]:
        """All groups of one kind, each a sorted rank list; together they partition the world
        (except 'embedding', whose groups are the first and last pipeline stage)."""
        if kind == "embedding":
            return self._embedding_groups()
        if kind in EXPERT_KINDS:
            return self._expert_groups(kind)
        if kind in CP_HIERARCHY_KINDS:
            return self._cp_hierarchy_groups(kind, self.cp_inner)
        varying = GROUP_DIMS[kind]
        fixed = [d for d in DIMS if d not in varying]
        result = []
        for fixed_values in itertools.product(*(range(self.size(d)) for d in reversed(fixed))):
            base = dict(zip(reversed(fixed), fixed_values))
            ranks = []
            for varying_values in itertools.product(*(range(self.size(d)) for d in varying)):
                ranks.append(self.rank_of(**base, **dict(zip(varying, varying_values))))
            result.append(sorted(ranks))
        return result

    def _embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline: they hold the tied word embedding
        (input and output) and all-reduce its gradient. With PP=1 a group is one rank."""
        result = []
        for pp_group in self.groups("pp"):
            result.append(sorted({pp_group[0], pp_group[-1]}))
        return result

    def _expert_groups(self, kind: str) -> list[list[int]]:
        """Per pipeline stage (ranks ``pp*N .. pp*N + N-1``, N = TP*CP*DP): EP groups are runs of
        EP consecutive ranks, EDP groups take every EP-th rank. None without experts."""
        if not self.experts:
            return []
        n, ep = self.tp * self.cp * self.dp, self.ep
        result = []
        for pp in range(self.pp):
            base = pp * n
            if kind == "ep":
                result += [[base + b * ep + j for j in range(ep)] for b in range(n // ep)]
            else:
                result += [[base + j + ep * b for b in range(n // ep)] for j in range(ep)]
        return result

    def _cp_hierarchy_groups(self, kind: str, a: int) -> list[list[int]]:
        """Each CP group (ranks in CP-coordinate order) cut into runs of A (inner), or into
        the A strided sets of its members with equal coordinate mod A (outer)."""
        if a < 1 or self.cp % a != 0:
            raise ValueError(f"inner context-parallel size {a} does not divide CP {self.cp}")
        result = []
        for ranks in self.groups("cp"):  # sorted by rank, i.e. by CP coordinate
            if kind == "cp_inner":
                result += [ranks[j:j + a] for j in range(0, self.cp, a)]
            else:
                result += [ranks[i::a] for i in range(a)]
        return result

    def expert_coord(self, rank: int) -> tuple[int, int]:
        """(ep rank, edp rank) of a rank: its place in its EP group and in its EDP group."""
        i = rank % (self.tp * self.cp * self.dp)
        return i % self.ep, i // self.ep

    def group_of(self, kind: str, rank: int) -> list[int]:
        for ranks in self.groups(kind):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is in no {kind} group")

    def neighbours(self, rank: int) -> dict[str, int]:
        """Previous/next rank along the pipeline and the context-parallel ring (wrapping)."""
        c = self.coord(rank)
        at = lambda **kw: self.rank_of(**{**c.__dict__, **kw})
        return {
            "pp_prev": at(pp=(c.pp - 1) % self.pp),
            "pp_next": at(pp=(c.pp + 1) % self.pp),
            "cp_prev": at(cp=(c.cp - 1) % self.cp),
            "cp_next": at(cp=(c.cp + 1) % self.cp),
        }

    def describe(self, gpus_per_node: int | None = None) -> str:
        """A readable table: rank, node, local rank and the four coordinates."""
        cp_inner = self.cp_inner
        per_node = gpus_per_node or self.world_size
        experts = (f"; experts: EP {self.ep} x EDP {self.edp} per stage (order ep, edp)"
                   if self.experts else "")
        hierarchy = (f"; CP {self.cp} = {cp_inner} all-to-all x {self.cp // cp_inner} ring"
                     if 1 < cp_inner < self.cp else "")
        lines = [
            f"grid: world={self.world_size} = TP {self.tp} x CP {self.cp} x DP {self.dp} x PP {self.pp}"
            f" ({per_node} per node, {-(-self.world_size // per_node)} node(s)){experts}{hierarchy}",
            f"{'rank':>5} {'node':>5} {'local':>6} {'tp':>3} {'cp':>3} {'dp':>3} {'pp':>3}"
            + (f" {'ep':>3} {'edp':>3}" if self.experts else ""),
        ]
        for rank in range(self.world_size):
            c = self.coord(rank)
            row = (f"{rank:>5} {rank // per_node:>5} {rank % per_node:>6} "
                   f"{c.tp:>3} {c.cp:>3} {c.dp:>3} {c.pp:>3}")
            if self.experts:
                ep, edp = self.expert_coord(rank)
                row += f" {ep:>3} {edp:>3}"
            lines.append(row)
        return "\n".join(lines)
