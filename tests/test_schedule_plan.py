"""The resolved pipeline schedule (:mod:`megalite.pipeline.plan`) and the rule that only
``megalite/pipeline/`` looks at schedule names.

A schedule is resolved once from its name (:func:`resolve_schedule`); the executor, ZeRO's
reduction order, the timeline's theory and the tools ask the resolved object. These tests pin
what the object owns (placement, op lists, bubble, evaluation, reduction positions) against the
orders themselves, and scan the source outside ``megalite/pipeline/`` for comparisons with a
schedule name: one would mean a second place deciding what a schedule does.
"""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_pipeline import make_config, micro_batches  # noqa: E402

from megalite.config import validate  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.pipeline import executor  # noqa: E402
from megalite.pipeline.op_lists import theory_bubble  # noqa: E402
from megalite.pipeline.partition import build_model_chunks  # noqa: E402
from megalite.pipeline.plan import resolve_schedule  # noqa: E402
from megalite.pipeline.schedule_kinds import DISPLAY_NAMES, SCHEDULES, schedule  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.observe.timeline import schedule_theory  # noqa: E402
from megalite.train.step import evaluate  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = set(DISPLAY_NAMES) | set(DISPLAY_NAMES.values())  # flag values, trace keys, display names


def _names_in(node: ast.AST) -> list[str]:
    """The schedule names a compared operand spells: a string, or a tuple/list/set of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES]


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, name) of every ``==``, ``!=``, ``in``, ``not in`` or ``match`` case that compares
    with a schedule name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, n) for operand in [node.left, *node.comparators] for n in _names_in(operand)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, n) for n in _names_in(node.value)]
    return found


def test_the_scan_sees_a_comparison():
    planted = 'if t.pipeline_schedule == "zbv" or s in ("gpipe", "x") or "ZB-H1" != k: pass\n' \
              'match s:\n    case "interleaved": pass\n'
    assert [n for _, n in name_comparisons(planted)] == ["zbv", "gpipe", "ZB-H1", "interleaved"]
    assert name_comparisons('SCHEDULES = ("1f1b", "zbv")\nf(schedule="1f1b")\n') == []  # data, not a decision


def test_no_module_outside_pipeline_compares_schedule_names():
    """Only the resolution (megalite/pipeline/) turns a name into behaviour."""
    pipeline = ROOT / "megalite" / "pipeline"
    found = []
    for folder in (ROOT / "megalite", ROOT / "tools"):
        for path in sorted(folder.rglob("*.py")):
            if pipeline not in path.parents:
                found += [f"{path.relative_to(ROOT)}:{line} compares with {name!r}"
                          for line, name in name_comparisons(path.read_text())]
    assert not found, "ask the resolved schedule (megalite.pipeline.plan) instead:\n" + "\n".join(found)


def test_resolution():
    """1f1b with V > 1 runs the interleaved order; zbv holds 2 chunks whatever V says; evaluation
    keeps the placement and runs forward operations only."""
    assert resolve_schedule("1f1b", 4).name == "1f1b" and resolve_schedule("1f1b", 4, 2).name == "interleaved"
    assert resolve_schedule("zbv", 4, 1).V == 2 and resolve_schedule("zbv", 4, 2).V == 2
    assert resolve_schedule("gpipe", 4, 3).name == "interleaved" and resolve_schedule("gpipe", 4, 3).V == 3
    with pytest.raises(ValueError, match="one chunk per rank"):
        resolve_schedule("zb-h1", 4, 2)
    zbv = resolve_schedule("zbv", 4)
    ev = resolve_schedule("zbv", 4, evaluation=True)
    assert ev.forward_only and not ev.split_backward and zbv.split_backward
    assert [ev.global_chunk(r, c) for r in range(4) for c in range(2)] == \
        [zbv.global_chunk(r, c) for r in range(4) for c in range(2)]
    assert not resolve_schedule("1f1b", 4, 2).runs(6) and resolve_schedule("1f1b", 4, 2).runs(8)


CASES = [(name, P, V, M) for name in SCHEDULES for P in (2, 4) for V in (1, 2, 3) for M in (P, 2 * P, 2 * P + 1)
         if V == 1 or schedule(name).interleaves]


@pytest.mark.parametrize("name,P,V,M", CASES)
@pytest.mark.parametrize("evaluation", [False, True])
def test_every_operation_once_and_the_step_finishes(name, P, V, M, evaluation):
    """Each rank's list runs every (micro-batch, chunk) forward once and, training, its backward
    once (B and W apart exactly when the backward is split); the simulation finishes."""
    s = resolve_schedule(name, P, V, evaluation)
    if not s.runs(M):
        return
    kinds = ("F",) if evaluation else ("F", "B", "W") if s.split_backward else ("F", "BW")
    for rank in range(P):
        ops = s.ops(M, rank)
        assert sorted((o.kind, o.micro, o.chunk) for o in ops) == \
            sorted((k, m, c) for k in kinds for m in range(M) for c in range(s.V))
    s.simulate(M)  # raises when a rank would wait forever


@pytest.mark.parametrize("P,V,M", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 12), (2, 4, 6)])
def test_interleaved_simulation_is_the_closed_form(P, V, M):
    """The interleaved order's simulated bubble with F = B = W is (P-1)/(V*M+P-1), the closed
    form its theory_bubble reports."""
    s = resolve_schedule("1f1b", P, V)
    assert s.simulate(M).bubble() == pytest.approx(s.theory_bubble(M), rel=1e-12)
    assert theory_bubble("1f1b", P, M, V) == s.theory_bubble(M) == (P - 1) / (V * M + P - 1)


@pytest.mark.parametrize("name,V", [("1f1b", 1), ("1f1b", 2), ("gpipe", 1), ("zb-h1", 1), ("zbv", 2)])
def test_the_timeline_theory_is_the_schedules(name, V):
    """One theory bubble: the timeline reports the resolved schedule's."""
    s = resolve_schedule(name, 4, V)
    for M in (4, 8):
        assert schedule_theory(s.display, 4, M, V)[1] == s.theory_bubble(M)
        assert schedule_theory(name, 4, M, V)[1] == s.theory_bubble(M)


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "1f1b"])
def test_reduction_positions_follow_the_op_list(name):
    """op_positions: where each (kind, micro, chunk) sits in the rank's list; a classical BW
    stands for its B and its W."""
    s = resolve_schedule(name, 4)
    for rank in range(4):
        ops, position = s.ops(8, rank), s.op_positions(8, rank)
        for k, op in enumerate(ops):
            for kind in ("B", "W") if op.kind == "BW" else (op.kind,):
                assert position[(kind, op.micro, op.chunk)] == k
        assert len(position) == sum(2 if op.kind == "BW" else 1 for op in ops)


# -- every schedule and evaluation on the one executor ------------------------------------------
def _evaluation_worker(rank, world, layouts):
    """Per layout: evaluate() on the pipeline, and what the executor kept while it ran."""
    kept = []
    real = executor.ScheduleExecutor.run

    def run(self):
        real(self)
        kept.append((self.schedule.forward_only, self.max_in_flight, len(self.losses)))

    executor.ScheduleExecutor.run = run
    out = []
    try:
        for layout in layouts:
            config = make_config(**layout)
            config.train.global_batch_size = 2 * 4
            validate(config, world)
            grid = build_grid(config.parallel, world, rank)
            chunks = build_model_chunks(config, grid)
            for c in chunks:
                c.init_weights(3)
            kept.clear()
            out.append((evaluate(chunks, micro_batches(config.model, 4), config.train, grid), list(kept)))
    finally:
        executor.ScheduleExecutor.run = real
    return out


EVAL_LAYOUTS = [dict(layers=4, pp=2, schedule=s) for s in ("1f1b", "gpipe", "zb-h1", "zbv")] + \
    [dict(layers=4, pp=2, vp_layers=1)]


def test_evaluation_runs_on_the_one_executor_for_every_schedule():
    """evaluate() under every schedule (interleaved too) is one forward-only run of the executor
    that keeps no activation, and gives the serial loss."""
    serial = GPTModel(make_config(4).model)
    serial.init_weights(3)
    expected = evaluate(serial, micro_batches(make_config(4).model, 4), make_config(4).train)
    for rank, results in enumerate(run_world(_evaluation_worker, 2, EVAL_LAYOUTS)):
        for layout, (loss, kept) in zip(EVAL_LAYOUTS, results):
            assert loss == pytest.approx(expected, rel=1e-5), (layout, rank)
            assert kept == [(True, 0, 4 if rank == 0 and layout.get("schedule") == "zbv" or
                             rank == 1 and layout.get("schedule") != "zbv" else 0)], (layout, rank)
