"""The pipeline schedules megalite knows, each described once: what it is called, how many model
chunks a rank holds, where those chunks sit in the model, whether its backward is split into B
(input gradient) and W (weight gradient), and whether the flag and the planner offer it.

Every other module asks a :class:`Schedule` (``schedule("zbv").v_shape``,
``schedule(name).chunks_per_rank(vpp)``) or the resolved schedule
(:func:`megalite.pipeline.plan.resolve_schedule`) instead of comparing names, so a new schedule
is one entry here, naming its operation order (a function of :mod:`megalite.pipeline.orders`).

- ``gpipe``, ``1f1b``: the classical schedules, one chunk per rank (``vpp`` chunks when
  --num-layers-per-virtual-pipeline-stage interleaves them: ``interleaved``, the order either
  runs with V > 1 (:meth:`Schedule.run_name`), a trace and display name, not a flag value).
- ``zb-h1``: 1F1B's order with the W's deferred into its idle slots; one chunk per rank.
- ``zbv``: two chunks per rank in a V, rank p holding global chunks p and 2P-1-p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megalite.pipeline.orders import (gpipe_order, interleaved_order, one_f_one_b_order, zb_h1_order,
                                      zbv_order)


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule's properties (module docstring)."""
    name: str  # the --pipeline-schedule value (or the trace key, for interleaved)
    display: str  # the name timelines and reports print
    split_backward: bool = False  # B and W run apart: a zero-bubble schedule
    fused_1f1b: bool = False  # 1F1B's order with B and W fused: P - p micro-batches in flight, closed forms
    v_shape: bool = False  # two chunks per rank, rank p holding p and 2P-1-p
    flag_value: bool = True  # accepted by --pipeline-schedule
    planned: bool = False  # considered by the planner when PP > 1
    order: Callable = one_f_one_b_order  # (P, M, rank, V) -> the rank's operations (megalite.pipeline.orders)
    closed_bubble: bool = False  # bubble (P-1)/(V*M+P-1) with F = B = W (the classical backward); else simulated
    micro_groups: bool = False  # micro-batches go round the ring in groups of P: M must be a multiple of P
    interleaves: bool = False  # with V > 1 chunks per rank it runs the interleaved order instead
    any_chunks: bool = False  # its order runs any number V of chunks per rank

    def chunks_per_rank(self, virtual: int = 1) -> int:
        """Model chunks a rank holds: 2 for the V, else ``virtual`` (the interleaving's V)."""
        return 2 if self.v_shape else virtual

    def pipeline_chunks(self, P: int, virtual: int = 1) -> int:
        """Model chunks of the whole pipeline of ``P`` ranks."""
        return P * self.chunks_per_rank(virtual)

    def global_chunk(self, P: int, rank: int, chunk: int) -> int:
        """Position in the model (0 = embedding ... last = loss) of a rank's local chunk."""
        if self.v_shape:
            return rank if chunk == 0 else 2 * P - 1 - rank
        return chunk * P + rank

    def owner(self, P: int, g: int) -> tuple[int, int]:
        """(rank, local chunk) holding global chunk ``g``."""
        if self.v_shape:
            return (g, 0) if g < P else (2 * P - 1 - g, 1)
        return g % P, g // P

    def local_chunks(self, P: int, rank: int, virtual: int = 1) -> tuple[int, ...]:
        """The global chunks a rank holds, in local order."""
        return tuple(self.global_chunk(P, rank, c) for c in range(self.chunks_per_rank(virtual)))

    def run_name(self, virtual: int = 1) -> str:
        """The schedule that runs with ``virtual`` chunks per rank: 1f1b (and gpipe) interleave them."""
        return "interleaved" if self.interleaves and virtual > 1 else self.name

    @property
    def one_chunk_split(self) -> bool:
        """1F1B's order with W deferred (zb-h1): B/W split on one chunk per rank, whose bubble
        and held micro-batches have closed forms once M >= P."""
        return self.split_backward and not self.v_shape


_ALL = (
    Schedule("1f1b", "1F1B", fused_1f1b=True, planned=True, order=one_f_one_b_order, closed_bubble=True,
             interleaves=True),
    Schedule("gpipe", "GPipe", order=gpipe_order, closed_bubble=True, interleaves=True),
    Schedule("interleaved", "interleaved 1F1B", flag_value=False, order=interleaved_order, closed_bubble=True,
             micro_groups=True, any_chunks=True),
    Schedule("zb-h1", "ZB-H1", split_backward=True, planned=True, order=zb_h1_order),
    Schedule("zbv", "ZBV", split_backward=True, v_shape=True, planned=True, order=zbv_order),
)
_BY_NAME = {s.name: s for s in _ALL}

SCHEDULES = tuple(s.name for s in _ALL if s.flag_value)  # the --pipeline-schedule choices
ZERO_BUBBLE = tuple(s.name for s in _ALL if s.split_backward)  # B and W apart
PLANNED_SCHEDULES = tuple(s.name for s in _ALL if s.planned)  # what the planner compares for PP > 1
DEFAULT_SCHEDULE = "1f1b"
DISPLAY_NAMES = {s.name: s.display for s in _ALL}  # trace key -> printed name


def schedule(name: str) -> Schedule:
    """The schedule called ``name`` (a --pipeline-schedule value or ``interleaved``). An
    unknown name is described as the classical 1F1B, as every site treated one before this
    table existed; :func:`megalite.pipeline.checks.check_pipeline_schedule` refuses it in a
    configuration."""
    return _BY_NAME.get(name) or Schedule(name, name, closed_bubble=True, interleaves=True)
