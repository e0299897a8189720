"""The schedule table (:mod:`megalite.pipeline.schedule_kinds`) against what the schedules do.

Each schedule's properties are written once, in that table; every other module reads them. So
the table must describe what runs: the chunks per rank and their placement are those of the
operation lists the executor runs, a schedule splits its backward exactly when its lists hold W
operations, and the flag's choices and the planner's chunk placement are the table's. A table
entry that disagreed with its schedule would silently mislead the planner, the checks and the
executor at once; these tests see it.
"""
from __future__ import annotations

import pytest

from megalite.arguments import build_parser
from megalite.pipeline.op_lists import rank_ops
from megalite.pipeline.schedule_kinds import SCHEDULES, ZERO_BUBBLE, schedule
from megalite.planner.pipeline import local_chunks, num_chunks

P, M = 4, 8


@pytest.mark.parametrize("name", SCHEDULES)
def test_table_describes_the_operation_lists(name):
    """Chunks per rank, B/W split and placement read from the table equal the op lists'."""
    kind = schedule(name)
    for rank in range(P):
        ops = rank_ops(name, P, M, rank)
        assert {op.chunk for op in ops} == set(range(kind.chunks_per_rank()))
        assert any(op.kind == "W" for op in ops) == kind.split_backward
        assert (name in ZERO_BUBBLE) == kind.split_backward
        placed = [kind.global_chunk(P, rank, c) for c in range(kind.chunks_per_rank())]
        assert [kind.owner(P, g) for g in placed] == [(rank, c) for c in range(len(placed))]
        assert local_chunks(name, P, rank) == tuple(placed)  # the planner's placement is the table's
    every = sorted(g for rank in range(P) for g in local_chunks(name, P, rank))
    assert every == list(range(num_chunks(name, P)))  # each global chunk on exactly one rank


def test_flag_choices_are_the_table():
    """--pipeline-schedule accepts exactly the table's flag values, in order, default 1f1b."""
    action = next(a for a in build_parser()._actions if a.dest == "pipeline_schedule")
    assert tuple(action.choices) == SCHEDULES
    assert action.default == "1f1b"
