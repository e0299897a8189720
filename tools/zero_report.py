#!/usr/bin/env python
"""Memory per rank and communication per step for DDP and ZeRO stages 1-3, measured on a
real gloo world on CPU, against the ZeRO arithmetic and ring-collective theory.

Memory: bytes this rank holds between steps (weights, gradients, fp32 master weights, the
update rule's state), from DistributedOptimizer.memory_bytes(), against the ZeRO arithmetic
with the rule's bytes per parameter K (master weights and state; AdamW: 12; a rule with a matrix
class, Muon, counts its matrices at their own bytes, 8):
DDP (4 + K) Psi, ZeRO-1 4 Psi + K Psi/N, ZeRO-2 2 Psi + (2 + K) Psi/N, ZeRO-3 (4 + K) Psi/N
(bf16 weights and gradients; with --fp32-grads the gradient terms take 4 bytes). The rule is
the default one (what pretrain_gpt.py trains with); its name and state come from the rule.

Communication: bytes handed to each data-parallel collective in one step (the full tensor
each works on), and the ring traffic per rank they imply: all-reduce 2(N-1)/N of it,
all-gather and reduce-scatter (N-1)/N. Theory per rank: DDP 2 Psi (N-1)/N gradient
elements; ZeRO-1/2 the same (reduce-scatter + all-gather); ZeRO-3 about 1.5x DDP
(all-gather for forward, again for backward, reduce-scatter of gradients).

    python tools/zero_report.py [--dp 4] [--hidden 64 --layers 2] [--json PATH]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from megalite.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from megalite.data_parallel.accounting import model_parameters, zero_theory_bytes  # noqa: E402
from megalite.data_parallel.update_rule import DEFAULT_RULE  # noqa: E402
from megalite.data_parallel.zero import DistributedOptimizer  # noqa: E402
from megalite.model.counting import total_matrix_parameters  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.comm import count_collectives  # noqa: E402
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.train.step import LossScaler  # noqa: E402
from megalite.testing.reference_step import train_step  # noqa: E402
from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402

RULE = DEFAULT_RULE  # the update rule measured, and named in the report


def model_config(hidden: int, layers: int) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4, vocab_size=512,
                       seq_length=32, hidden_dropout=0, attention_dropout=0)


def measure(rank, world, stage, hidden, layers, fp32_grads):
    cfg = model_config(hidden, layers)
    t = TrainConfig(micro_batch_size=2, bf16=True, clip_grad=1.0)
    grid = build_grid(ParallelConfig(), world, rank)
    model = GPTModel(cfg)
    model.init_weights(0)
    opt = DistributedOptimizer([model], t, grid, stage=stage, overlap=True, bucket_size=hidden * hidden * 4,
                               param_dtype=torch.bfloat16,
                               grad_dtype=torch.float32 if fp32_grads else torch.bfloat16, rule=RULE)
    x = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(rank))
    batch = [{"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(2, 32),
              "position_ids": torch.arange(32).expand(2, -1)}]
    train_step(model, opt, batch, t, 0, LossScaler(False), grid)  # warm-up step
    with count_collectives() as stats:
        train_step(model, opt, batch, t, 1, LossScaler(False), grid)
    return opt.memory_bytes(), model_parameters(opt), {k: dict(v) for k, v in stats.items()}


def header(rule, n: int, fp32_grads: bool) -> str:
    """The report's first two lines: the setting, with the update rule's name, state and bytes per
    parameter in its own words, and the table's columns (the state column named after the rule)."""
    return (f"DP={n}, bf16 weights, {'fp32' if fp32_grads else 'bf16'} gradients, {rule.name} (fp32 master + "
            f"{rule.describe_state()}: {rule.describe_bytes()})\n"
            f"{'stage':>5} {'weights':>9} {'grads':>9} {'master':>9} {rule.name:>9} {'total':>10} {'theory':>10} "
            f"{'ratio':>6} | {'handed':>10} {'ring/rank':>10} {'theory':>10} {'ratio':>6}")


def main():
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fp32-grads", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    positive(p, "--dp/--hidden/--layers", args.dp, args.hidden, args.layers)
    writable(p, "--json", args.json)
    n, g = args.dp, 4 if args.fp32_grads else 2
    report = []
    print(header(RULE, n, args.fp32_grads))
    ddp_ring = None
    for stage in range(4):
        mem, psi, stats = run_world(measure, n, stage, args.hidden, args.layers, args.fp32_grads)[0]
        matrices = total_matrix_parameters(model_config(args.hidden, args.layers))  # the rule's matrix class
        theory = zero_theory_bytes(psi, n, stage, 2, g, RULE.bytes_of(False), matrices, RULE.bytes_of(True))
        total = sum(mem.values())
        handed = {k: v["bytes"] for k, v in stats.items()}
        ring = (2 * handed.get("all_reduce", 0) + handed.get("all_gather", 0)
                + handed.get("reduce_scatter", 0)) * (n - 1) / n
        # Theory: gradients reduced once (2 (N-1)/N Psi g); weights all-gathered once
        # (stages 1-2), or before forward and again before backward (stage 3).
        grad_part = (2 * g * psi if stage == 0 else g * psi + 2 * psi) * (n - 1) / n
        comm_theory = grad_part + (2 * psi * (n - 1) / n if stage == 3 else 0)
        ddp_ring = ddp_ring or ring
        row = {"stage": stage, "psi": psi, "memory": mem, "total": total, "theory": theory["total"],
               "collectives": stats, "ring_bytes_per_rank": ring, "ring_theory": comm_theory}
        report.append(row)
        print(f"{stage:>5} {mem['weights']:>9,} {mem['gradients']:>9,} {mem['master_weights']:>9,} "
              f"{mem['optimizer_state']:>9,} {total:>10,} {theory['total']:>10,.0f} {total / theory['total']:>6.3f} | "
              f"{sum(handed.values()):>10,} {ring:>10,.0f} {comm_theory:>10,.0f} {ring / comm_theory:>6.3f}")
    print(f"Psi = {report[0]['psi']:,} parameters. ZeRO-3 ring traffic / DDP: "
          f"{report[3]['ring_bytes_per_rank'] / report[0]['ring_bytes_per_rank']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
