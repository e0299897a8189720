"""Pipeline schedules by name: the operation lists, placement, simulation and bubble of a
--pipeline-schedule value, each read from its resolved :class:`PipelineSchedule`
(:mod:`megalite.pipeline.plan`), for callers that hold a name (the planner, the tools, the tests).

The orders themselves live in :mod:`megalite.pipeline.orders` (what F, B, W and BW are, and how
each schedule orders them), the schedules' facts in :mod:`megalite.pipeline.schedule_kinds`.
:func:`simulate` reports each operation's start and end with given F/B/W times: the theory for
the bubble and the in-flight counts, and the order in which the pipeline's messages are produced,
which :mod:`megalite.pipeline.executor` posts in (the same order on both ends of every link, so
the exchange cannot deadlock, see there).
"""
from __future__ import annotations

from megalite.pipeline.orders import Op, gpipe_ops, interleaved_ops, one_f_one_b_ops, zbv_ops  # noqa: F401 (re-exported)
from megalite.pipeline.plan import PipelineSchedule, Simulation, resolve_schedule  # noqa: F401 (re-exported)
from megalite.pipeline.schedule_kinds import ZERO_BUBBLE  # noqa: F401 (re-exported)


def num_chunks(schedule: str, virtual: int = 1) -> int:
    """Model chunks per rank: 2 for zbv, ``virtual`` for the interleaved schedule, else 1."""
    return resolve_schedule(schedule, 1, virtual).V


def global_chunk(schedule: str, P: int, rank: int, chunk: int) -> int:
    """Position in the model (0 = embedding ... P*V-1 = loss) of a rank's local chunk."""
    return resolve_schedule(schedule, P).global_chunk(rank, chunk)


def owner(schedule: str, P: int, V: int, g: int) -> tuple[int, int]:
    """(rank, local chunk) holding global chunk ``g``."""
    return resolve_schedule(schedule, P, V).owner(g)


def rank_ops(schedule: str, P: int, M: int, rank: int, virtual: int = 1) -> list[Op]:
    """This rank's operations, in order."""
    return list(resolve_schedule(schedule, P, virtual).ops(M, rank))


def simulate(schedule: str, P: int, M: int, times: dict | None = None, virtual: int = 1) -> Simulation:
    """:meth:`PipelineSchedule.simulate` of the named schedule."""
    return resolve_schedule(schedule, P, virtual).simulate(M, times)


def theory_bubble(schedule: str, P: int, M: int, virtual: int = 1, times: dict | None = None) -> float:
    """:meth:`PipelineSchedule.theory_bubble` of the named schedule (the one definition)."""
    return resolve_schedule(schedule, P, virtual).theory_bubble(M, times)
