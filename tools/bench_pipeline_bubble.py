#!/usr/bin/env python
"""Measured pipeline bubble against theory, for 1F1B and interleaved 1F1B.

Runs the real schedules and the real point-to-point exchange (gloo, P processes) over
stages whose compute is a sleep: forward t_f, backward t_b = 2 t_f per stage (split into
V chunks of t/V each when interleaved). Sleeping stages do not compete for CPU cores, so
P processes on a 2-core machine behave like P devices and the trace measures the
schedule itself. Prints measured vs theory, (P-1)/(M+P-1) or (P-1)/(V*M+P-1), and writes
one timeline picture per case, OUT/pipeline_P{P}_M{M}_V{V}.png (--format png svg for both;
needs matplotlib): one row per stage, forward / backward per chunk in distinct colours,
micro-batch numbers, time axis in ms, measured and theoretical bubble in the title.

    python tools/bench_pipeline_bubble.py [--stages 4] [--micro-batches 4 8 16] [--out docs/images]
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
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.pipeline.schedules import PipelineRunner, Trace  # noqa: E402
from megalite.plotting import FORMATS, require_matplotlib  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.timeline import draw_timeline, measured_bubble, theory_bubble  # noqa: E402
from tools.tool_errors import one_line_errors, positive  # noqa: E402

SHAPE = (4, 1, 8)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_forward, t_backward):
        time.sleep(t_forward)
        ctx.t_backward = t_backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_backward)
        return grad, None, None


class SleepStage(nn.Module):
    def __init__(self, pre_process, post_process, t_forward, t_backward):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.t_forward, self.t_backward = t_forward, t_backward
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Sleep.apply(x * self.scale, self.t_forward, self.t_backward)


def _worker(rank, world, m, v, t_forward):
    grid = build_grid(ParallelConfig(pipeline_model_parallel_size=world), world, rank)
    chunks = [SleepStage(c == 0 and rank == 0, c == v - 1 and rank == world - 1, t_forward / v,
                         2 * t_forward / v) for c in range(v)]

    def forward_fn(chunk, x, batch):
        y = chunk(batch["x"] if chunk.pre_process else x)
        return y.sum(-1) if chunk.post_process else y

    batches = [{"x": torch.ones(SHAPE)} for _ in range(m)]
    PipelineRunner(chunks, batches, grid, SHAPE, forward_fn, lambda out, b: out.mean()).run("1f1b")  # warm-up
    trace = Trace()
    PipelineRunner(chunks, batches, grid, SHAPE, forward_fn, lambda out, b: out.mean(), trace=trace).run("1f1b")
    return trace.events


def main():
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--virtual", type=int, nargs="+", default=[1, 2])
    p.add_argument("--t-forward-ms", type=float, default=20.0)
    p.add_argument("--out", default="docs/images")
    p.add_argument("--format", nargs="+", choices=FORMATS, default=["png"], help="picture format(s)")
    args = p.parse_args()
    positive(p, "--stages/--micro-batches/--virtual", args.stages, *args.micro_batches, *args.virtual)
    require_matplotlib()  # fail now, not after the first case
    os.makedirs(args.out, exist_ok=True)
    P = args.stages
    print(f"P={P}, t_forward={args.t_forward_ms} ms, t_backward=2*t_forward per stage (sleep), gloo p2p")
    print(f"{'schedule':>14} {'M':>4} {'V':>3} {'measured':>9} {'theory':>8} {'step ms':>8}  timeline")
    for v in args.virtual:
        for m in args.micro_batches:
            if v > 1 and m % P != 0:
                continue
            events = run_world(_worker, P, m, v, args.t_forward_ms / 1e3, timeout=300)
            name = "1F1B" if v == 1 else "interleaved"
            paths = draw_timeline(events, os.path.join(args.out, f"pipeline_P{P}_M{m}_V{v}"), num_chunks=v,
                                  labels=[f"stage {r} (rank {r})" for r in range(P)],
                                  schedule="1F1B" if v == 1 else "interleaved 1F1B", num_micro=m,
                                  formats=args.format)
            span = max(e[4] for ev in events for e in ev) - min(e[3] for ev in events for e in ev)
            print(f"{name:>14} {m:>4} {v:>3} {measured_bubble(events):>9.3f} {theory_bubble(P, m, v):>8.3f} "
                  f"{span * 1e3:>8.0f}  {', '.join(paths)}")


if __name__ == "__main__":
    main()
