#!/usr/bin/env python
"""Measured pipeline bubble against theory: 1F1B, interleaved 1F1B, ZB-H1 and ZBV.

Runs the real schedules and the real point-to-point exchange (gloo, P processes) over
stages whose compute is a sleep: per stage, forward F, input-gradient backward B and
weight-gradient backward W each take t (so the classical backward, B and W at once, 2t).
A schedule with two chunks per rank (interleaved with V = 2, ZBV) gives each chunk half a
stage: t/2 per operation. Sleeping stages do not compete for CPU cores, so P processes on
a 2-core machine behave like P devices and the trace measures the schedule itself.

Every schedule runs on :class:`ScheduleExecutor`, resolved once per case
(:func:`megalite.pipeline.plan.resolve_schedule`). Under a zero-bubble schedule a stage's backward sleeps only B and defers to
the weight-gradient store (``megalite.layers.weight_grad``) a W that sleeps W and returns
the gradient of the stage's parameter, as megalite's linears do.

Each case runs a warm-up step, then --repeat traced steps of which the shortest is kept
(the one least disturbed by other work on the machine). Prints, per schedule and M: the
measured bubble (idle fraction of the step, averaged over
ranks) beside the theory (:func:`megalite.observe.timeline.schedule_theory`), the idle time per
rank in ms (measured, and theory: M (F+B+W) * bubble / (1 - bubble), the work of a rank
being M (F+B+W) in every schedule), the step time, then ZB-H1 against 1F1B and ZBV against
interleaved (ratio of idle times and of fractions). One timeline picture per case:
OUT/pipeline_P{P}_M{M}_{schedule}.png (--format png svg for both; needs matplotlib).

    python tools/bench_pipeline_bubble.py [--stages 4] [--micro-batches 4 8 16] \\
        [--schedules 1f1b interleaved zb-h1 zbv] [--t-forward-ms 20] [--repeat 3] [--out docs/images]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from megalite.config import ParallelConfig  # noqa: E402
from megalite.layers.weight_grad import active_store  # noqa: E402
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.pipeline.executor import ScheduleExecutor  # noqa: E402
from megalite.pipeline.plan import resolve_schedule  # noqa: E402
from megalite.pipeline.trace import Trace  # noqa: E402
from megalite.observe.plotting import FORMATS, require_matplotlib  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.observe.timeline import NAMES, draw_timeline, idle_seconds, measured_bubble, schedule_theory  # noqa: E402
from tools.tool_errors import one_line_errors, positive  # noqa: E402

SHAPE = (4, 1, 8)
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")
VIRTUAL = {"interleaved": 2}  # the interleaving's chunks per rank in this benchmark
CHUNKS = {s: resolve_schedule(s, 2, VIRTUAL.get(s, 1)).V for s in SCHEDULES}  # per rank


def _resolved(schedule, P):
    return resolve_schedule(schedule, P, VIRTUAL.get(schedule, 1))


class _SleepScale(torch.autograd.Function):
    """y = x * scale after sleeping t_f. Backward: dx = dy * scale after sleeping t_b; the
    weight gradient d scale = sum(dy * x), after sleeping t_w, deferred to W when a
    zero-bubble schedule's store is active, else computed at once (the classical backward,
    t_b + t_w)."""

    @staticmethod
    def forward(ctx, x, scale, t_f, t_b, t_w):
        time.sleep(t_f)
        ctx.save_for_backward(x, scale)
        ctx.t_b, ctx.t_w, ctx.weight = t_b, t_w, scale
        return x * scale

    @staticmethod
    def backward(ctx, dy):
        x, scale = ctx.saved_tensors
        time.sleep(ctx.t_b)
        t_w = ctx.t_w

        def weight_grad():
            time.sleep(t_w)
            return (dy * x).sum()

        store = active_store()
        d_scale = store.defer(ctx.weight, weight_grad) if store is not None else weight_grad()
        return dy * scale, d_scale, None, None, None


class SleepStage(nn.Module):
    def __init__(self, pre_process, post_process, t_op):
        super().__init__()
        self.pre_process, self.post_process, self.t_op = pre_process, post_process, t_op
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _SleepScale.apply(x, self.scale, self.t_op, self.t_op, self.t_op)


def _places(schedule, P, rank):
    """Global chunks of this rank's local chunks (interleaved: 1f1b's placement with V chunks)."""
    return [_resolved(schedule, P).global_chunk(rank, c) for c in range(CHUNKS[schedule])]


def _chunks(schedule, P, rank, t):
    """This rank's sleep chunks; each of V chunks per rank takes t / V per operation."""
    V = CHUNKS[schedule]
    return [SleepStage(g == 0, g == P * V - 1, t / V) for g in _places(schedule, P, rank)]


def _forward(chunk, x, batch):
    y = chunk(batch["x"] if chunk.pre_process else x)
    return y.sum(-1) if chunk.post_process else y


def _loss(out, batch):
    return out.mean()


def _step(schedule, chunks, batches, grid, trace=None):
    resolved = _resolved(schedule, grid.layout.pp)
    ScheduleExecutor(resolved, chunks, batches, grid, SHAPE, _forward, _loss, trace=trace).run()


def _worker(rank, world, cases, t, repeat):
    """Every (schedule, M) case in one world: a warm-up step, then ``repeat`` traced ones."""
    grid = build_grid(ParallelConfig(pipeline_model_parallel_size=world), world, rank)
    out = []
    for schedule, m in cases:
        chunks = _chunks(schedule, world, rank, t)
        batches = [{"x": torch.ones(SHAPE)} for _ in range(m)]
        _step(schedule, chunks, batches, grid)
        steps = []
        for _ in range(repeat):
            trace = Trace()
            _step(schedule, chunks, batches, grid, trace)
            steps.append(trace.events)
        out.append(steps)
    return out


def _span(events):
    return max(e[4] for ev in events for e in ev) - min(e[3] for ev in events for e in ev)


def run_cases(P, cases, t, repeat=1, timeout=600):
    """{(schedule, M): events per rank} for every case, run in one gloo world of P ranks: of
    ``repeat`` steps the shortest, the one least disturbed by other work on the machine."""
    per_rank = run_world(_worker, P, cases, t, repeat, timeout=timeout)
    return {case: min(([per_rank[r][i][k] for r in range(P)] for k in range(repeat)), key=_span)
            for i, case in enumerate(cases)}


def summary(events, schedule, P, m, t):
    """Measured and theoretical bubble (fraction and idle ms per rank) and the step time."""
    V = CHUNKS[schedule]
    _, theory = schedule_theory(NAMES[schedule], P, m, V)
    span = _span(events)
    idle = idle_seconds(events)
    return {"measured": measured_bubble(events), "theory": theory, "idle_ms": 1e3 * sum(idle) / P,
            "theory_idle_ms": 1e3 * 3 * m * t * theory / (1 - theory), "step_ms": span * 1e3}


def main(argv=None):
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--t-forward-ms", type=float, default=20.0, help="t: F, B and W of one stage (ms)")
    p.add_argument("--repeat", type=int, default=3, help="traced steps per case; the shortest is kept")
    p.add_argument("--out", default="docs/images")
    p.add_argument("--format", nargs="+", choices=FORMATS, default=["png"], help="picture format(s)")
    args = p.parse_args(argv)
    positive(p, "--stages/--micro-batches/--repeat", args.stages, *args.micro_batches, args.repeat)
    P, t = args.stages, args.t_forward_ms / 1e3
    if P < 2:
        p.error(f"--stages {P}: a pipeline needs at least 2 stages")
    if t <= 0:
        p.error(f"--t-forward-ms takes a positive time, got {args.t_forward_ms}")
    require_matplotlib()  # fail now, not after the runs
    os.makedirs(args.out, exist_ok=True)
    cases = [(s, m) for s in args.schedules for m in args.micro_batches if _resolved(s, P).runs(m)]
    skipped = sorted({m for s in args.schedules for m in args.micro_batches if not _resolved(s, P).runs(m)})
    print(f"P={P}, per stage F = B = W = {args.t_forward_ms:g} ms (sleep; classical backward 2x), "
          f"two-chunk schedules t/2 per chunk, gloo p2p; the shortest of {args.repeat} steps per case")
    if skipped:
        print(f"interleaved skipped at M={skipped}: it needs M a multiple of P={P}")
    traces = run_cases(P, cases, t, args.repeat)
    print(f"{'schedule':>16} {'M':>4} {'measured':>9} {'theory':>7} {'idle ms':>8} {'theory':>7} "
          f"{'step ms':>8}  timeline")
    results = {}
    for schedule, m in cases:
        events = traces[(schedule, m)]
        r = results[(schedule, m)] = {**summary(events, schedule, P, m, t), "events": events}
        V = CHUNKS[schedule]
        labels = [f"stage {q} (rank {q})" if V == 1 else "rank {}: chunks {}".format(
            q, ", ".join(str(g) for g in _places(schedule, P, q))) for q in range(P)]
        paths = draw_timeline(events, os.path.join(args.out, f"pipeline_P{P}_M{m}_{schedule}"), num_chunks=V,
                              labels=labels, schedule=NAMES[schedule], num_micro=m, formats=args.format)
        print(f"{NAMES[schedule]:>16} {m:>4} {r['measured']:>9.3f} {r['theory']:>7.3f} {r['idle_ms']:>8.0f} "
              f"{r['theory_idle_ms']:>7.0f} {r['step_ms']:>8.0f}  {', '.join(paths)}")
    for zb, base in (("zb-h1", "1f1b"), ("zbv", "interleaved")):
        for m in args.micro_batches:
            if (zb, m) in results and (base, m) in results:
                a, b = results[(zb, m)], results[(base, m)]
                print(f"{NAMES[zb]} / {NAMES[base]}, M={m}: idle time {a['idle_ms'] / b['idle_ms']:.3f} "
                      f"(theory {a['theory_idle_ms'] / b['theory_idle_ms']:.3f}), bubble fraction "
                      f"{a['measured'] / b['measured']:.3f} (theory {a['theory'] / b['theory']:.3f})")
    return results


if __name__ == "__main__":
    main()
