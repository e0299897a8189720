#!/usr/bin/env python
"""Tensor-parallel communication per training step, counted, against theory.

Runs one forward + backward of a GPT on a real gloo world of TP ranks (CPU), counting
the bytes handed to each collective (megalite.parallel.comm.count_collectives), for
L and 2L layers; the difference divided by L is the traffic of one transformer layer.

Theory (DESIGN.md section 5), per layer per step, activations of b*s*h elements:
  TP without SP: 4 all-reduces of b*s*h  (fwd: after attention and MLP; bwd: their conjugates)
  TP with SP:    4 all-gathers + 4 reduce-scatters of b*s*h (the same volume: an all-reduce
                 is a reduce-scatter followed by an all-gather), plus 2 all-gathers in backward:
                 QKV and FC1 keep only their input's sequence shard and gather it again there
Bytes counted are those of the full tensor each collective works on.

    python tools/bench_tp_comm.py [--tp 2 4] [--batch 2 --seq 32 --hidden 64 --layers 2]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from megalite.config import ModelConfig, ParallelConfig  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.comm import count_collectives  # noqa: E402
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.testing.reference_step import reduce_gradients  # noqa: E402
from tools.tool_errors import one_line_errors, positive  # noqa: E402


def _worker(rank, world, args, layers, sp):
    cfg = ModelConfig(num_layers=layers, hidden_size=args.hidden, num_attention_heads=8,
                      vocab_size=1000, seq_length=args.seq, hidden_dropout=0, attention_dropout=0)
    grid = build_grid(ParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sp), world, rank)
    model = GPTModel(cfg, tp_group=grid.tp_group, sequence_parallel=sp)
    model.init_weights(0)
    x = torch.randint(0, 1000, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    with count_collectives() as stats:
        model(x[:, :-1], labels=x[:, 1:]).mean().backward()
        reduce_gradients(list(model.parameters()), grid)
    return {k: dict(v) for k, v in stats.items()}


def main():
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    positive(p, "--tp/--batch/--seq/--hidden/--layers", *args.tp, args.batch, args.seq, args.hidden, args.layers)
    bsh_bytes = args.batch * args.seq * args.hidden * 4
    print(f"b={args.batch} s={args.seq} h={args.hidden} fp32: b*s*h = {bsh_bytes:,} bytes")
    print(f"{'TP':>3} {'SP':>3} {'collective':>15} {'calls/layer':>12} {'bytes/layer':>12} "
          f"{'theory':>12} {'ratio':>6}")
    for tp in args.tp:
        for sp in (False, True):
            small = run_world(_worker, tp, args, args.layers, sp)[0]
            large = run_world(_worker, tp, args, 2 * args.layers, sp)[0]
            theory = {"reduce_scatter": 4 * bsh_bytes, "all_gather": 6 * bsh_bytes} if sp else \
                {"all_reduce": 4 * bsh_bytes}
            for kind in sorted(set(small) | set(large)):
                calls = (large.get(kind, {}).get("calls", 0) - small.get(kind, {}).get("calls", 0)) / args.layers
                nbytes = (large.get(kind, {}).get("bytes", 0) - small.get(kind, {}).get("bytes", 0)) / args.layers
                th = theory.get(kind)
                extra = ""
                if kind == "all_reduce" and sp:
                    extra = "  (norm/bias grads, 6h floats per layer, one coalesced call per step)"
                print(f"{tp:>3} {'on' if sp else 'off':>3} {kind:>15} {calls:>12.1f} {nbytes:>12,.0f} "
                      f"{(f'{th:,}' if th else '-'):>12} {(f'{nbytes / th:.3f}' if th else '-'):>6}{extra}")
            totals = {k: v["bytes"] for k, v in small.items()}
            print(f"{'':>8} whole step at {args.layers} layers (incl. embedding, loss, grads): {totals}")


if __name__ == "__main__":
    main()
