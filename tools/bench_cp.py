#!/usr/bin/env python
"""Context parallelism four ways: bytes per layer measured against theory, and memory.

1. Traffic, measured: one attention layer's forward + backward on a real gloo world of C ranks
   (CPU), each communication type, the bytes handed to every collective counted
   (megalite.parallel.comm.count_collectives) beside the formulas of
   megalite.context_parallel.traffic. a2a+p2p runs at C = 4 as 2 x 2.
2. Traffic, theory, at scale: one Llama-2-7B layer (32 heads, 32 kv heads, d 128, bf16) at
   32k tokens, per type and C: bytes handed and bytes that leave the rank, per layer and step.
3. Memory: the meta-device dry run (tools/dry_run.py: one fake-process-group rank, one
   iteration, every live storage tracked) of a one-layer 7B model at 32k tokens, per type:
   the peak and the activations at the peak.
On a GPU the time per layer needs C GPUs talking over real links; one GPU with the fake group
would time the compute alone, so that figure waits for a multi-GPU machine (not yet measured).

    python tools/bench_cp.py [--cp 2 4] [--skip-memory]
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megalite.config import ParallelConfig  # noqa: E402
from megalite.context_parallel.attention import ContextParallelGroups, context_parallel_attention  # noqa: E402
from megalite.context_parallel.comm_types import CP_COMM_TYPES, is_hierarchical  # noqa: E402
from megalite.context_parallel.traffic import cp_attention_traffic  # noqa: E402
from megalite.parallel import comm  # noqa: E402
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from tools.tool_errors import one_line_errors, positive  # noqa: E402

MiB = 2 ** 20


def _hierarchy(rank, world, inner):
    """Inner groups of ``inner`` consecutive ranks, outer groups strided by ``inner``."""
    mine = [None, None]
    for lo in range(0, world, inner):
        g = dist.new_group(list(range(lo, lo + inner)))
        mine[0] = g if lo <= rank < lo + inner else mine[0]
    for i in range(inner):
        ranks = list(range(i, world, inner))
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        mine[1] = g if rank in ranks else mine[1]
    return mine


def _traffic_worker(rank, world, shape, types, inner):
    b, heads, groups, seq, d = shape
    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    inner_group, outer_group = _hierarchy(rank, world, inner)
    out = {}
    for comm_type in types:
        groups_ = ContextParallelGroups(grid.cp_group, inner_group, outer_group)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, heads, seq // world, d, generator=g, requires_grad=True)
        k, v = (torch.randn(b, groups, seq // world, d, generator=g, requires_grad=True) for _ in range(2))
        with comm.count_collectives() as fwd:
            o = context_parallel_attention(q, k, v, groups_, comm_type, backend="torch")
        with comm.count_collectives() as bwd:
            o.backward(torch.ones_like(o))
        out[comm_type] = {"forward": sum(x["bytes"] for x in fwd.values()),
                          "backward": sum(x["bytes"] for x in bwd.values()),
                          "calls": sum(x["calls"] for x in fwd.values()) + sum(x["calls"] for x in bwd.values())}
    return out


def measured_traffic(cps, shape):
    b, heads, groups, seq, d = shape
    print(f"1. traffic of one attention layer, measured on gloo (fp32, b={b} heads={heads} kv groups={groups} "
          f"s={seq} d={d}), bytes handed per rank, forward + backward")
    print(f"{'type':>10} {'C':>2} {'A x B':>6} {'calls':>5} {'fwd':>9} {'bwd':>9} {'theory fwd':>10} "
          f"{'theory bwd':>10} {'ratio':>6} {'wire':>9}")
    for cp in cps:
        inner = 2 if cp >= 4 else cp
        types = [t for t in CP_COMM_TYPES if not is_hierarchical(t) or 1 < inner < cp]
        ranks = run_world(_traffic_worker, cp, shape, types, inner, timeout=300)
        for t in types:
            got = ranks[0][t]
            theory = cp_attention_traffic(t, batch=b, seq=seq, heads=heads, groups=groups, head_dim=d, cp=cp,
                                          element_size=4, inner=inner)
            tf, tb = (sum(theory.handed[p].values()) for p in ("forward", "backward"))
            ratio = (got["forward"] + got["backward"]) / (tf + tb)
            sizes = f"{inner}x{cp // inner}" if is_hierarchical(t) else ""
            print(f"{t:>10} {cp:>2} {sizes:>6} {got['calls']:>5} {got['forward']:>9,} {got['backward']:>9,} "
                  f"{tf:>10,.0f} {tb:>10,.0f} {ratio:>6.3f} {sum(theory.wire.values()):>9,.0f}")


def theory_at_scale(cps):
    print("\n2. theory, one Llama-2-7B layer at 32k tokens (b=1, 32 heads, 32 kv groups, d=128, bf16, TP=1): "
          "MiB per rank per layer per step")
    print(f"{'type':>10} {'C':>2} {'A x B':>6} {'handed fwd':>10} {'handed bwd':>10} {'wire':>8} {'on inner':>8}")
    for cp in cps:
        for t in CP_COMM_TYPES:
            inners = [a for a in range(2, cp) if cp % a == 0] if is_hierarchical(t) else [None]
            for inner in inners:
                x = cp_attention_traffic(t, batch=1, seq=32768, heads=32, groups=32, head_dim=128, cp=cp,
                                         element_size=2, inner=inner)
                fwd, bwd = (sum(x.handed[p].values()) / MiB for p in ("forward", "backward"))
                sizes = f"{inner}x{cp // inner}" if inner else ""
                print(f"{t:>10} {cp:>2} {sizes:>6} {fwd:>10.0f} {bwd:>10.0f} {sum(x.wire.values()) / MiB:>8.0f} "
                      f"{x.wire.get('inner', 0) / MiB:>8.0f}")


SEVEN_B_LAYER = ["--num-layers", "1", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "32768",
                 "--ffn-hidden-size", "11008", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                 "rope", "--disable-bias-linear", "--vocab-size", "32000", "--micro-batch-size", "1", "--bf16",
                 "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0"]


def dry_run_memory(cp):
    from dry_run import measure_layout

    from megalite.arguments import build_parser, config_from_args
    from megalite.parallel.grid import GridLayout

    print(f"\n3. dry-run memory, one 7B layer at 32k tokens, CP={cp} (meta device, fake process group, rank 0), "
          f"beside the planner: GiB")
    print(f"{'type':>10} {'A x B':>6} {'peak':>7} {'planned':>7} {'activations':>11} {'communication':>13}")
    for t in CP_COMM_TYPES:
        sizes = ["--hierarchical-context-parallel-sizes", "2", str(cp // 2)] if is_hierarchical(t) else []
        flags = SEVEN_B_LAYER + ["--context-parallel-size", str(cp), "--global-batch-size", "1",
                                 "--cp-comm-type", t] + sizes
        config = config_from_args(build_parser().parse_args(flags), 32000)
        layout = GridLayout.from_config(config.parallel, cp)
        (result,) = list(measure_layout(flags, config, layout, cp))
        at_peak = result["categories"]
        print(f"{t:>10} {('2x' + str(cp // 2)) if sizes else '':>6} {result['measured_bytes'] / 2 ** 30:>7.2f} "
              f"{result['planned_bytes'] / 2 ** 30:>7.2f} {at_peak.get('activations', 0) / 2 ** 30:>11.2f} "
              f"{at_peak.get('communication', 0) / 2 ** 30:>13.2f}")


def main():
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--shape", type=int, nargs=5, default=[1, 8, 2, 64, 32], metavar=("B", "HEADS", "GROUPS", "S", "D"))
    p.add_argument("--skip-memory", action="store_true", help="skip the dry runs (part 3)")
    args = p.parse_args()
    positive(p, "--cp/--shape", *args.cp, *args.shape)
    measured_traffic(args.cp, tuple(args.shape))
    theory_at_scale(sorted(set(args.cp) | {8}))
    if not args.skip_memory:
        dry_run_memory(max(args.cp))


if __name__ == "__main__":
    main()
