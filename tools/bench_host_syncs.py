#!/usr/bin/env python
"""Host syncs per train step, counted on the CPU, for dense and MoE layouts.

A read of a tensor value on the host (``.item()``, ``.tolist()``, ``bool(t)``, an f-string of a
tensor, ...) or an operator that syncs (``torch.nonzero``, ``torch.equal``, a boolean-mask
index, ...) stops a GPU's queue; :mod:`megalite.observe.host_syncs` counts those made by megalite's
code, its ``kernels/`` included. For each
layout this runs ``--steps`` steps of a small GPT with the DP/ZeRO optimizer (as
``pretrain_gpt.py`` does) and prints the reads per step and the reads of the log line (the
loop reads all steps of a log interval at once). Multi-rank layouts run in a real gloo
world (rank 0 is reported; every rank makes the same reads).

    TRITON_INTERPRET=1 python tools/bench_host_syncs.py [--steps 3]
"""
import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # the grouped GEMM on the CPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from megalite.data_parallel.zero import DistributedOptimizer  # noqa: E402
from megalite.observe.host_syncs import count_host_syncs  # noqa: E402
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.pipeline.partition import build_model_chunks  # noqa: E402
from megalite.observe.step_values import LossScaler, resolve_steps  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.testing.reference_step import train_step  # noqa: E402
from tools.tool_errors import one_line_errors, positive  # noqa: E402

LAYOUTS = {  # name: (world, parallel sizes, model options, ZeRO stage)
    "dense, 1 process": (1, {}, {}, 0),
    "dense, DP2 ZeRO-1": (2, {}, {}, 1),
    "dense, TP2 x PP2 (1F1B)": (4, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, {}, 0),
    "MoE 4 experts top-2, EP1, grouped GEMM": (1, {}, {"num_experts": 4, "moe_grouped_gemm": True}, 0),
    "MoE 4 experts top-2, EP1, torch experts": (1, {}, {"num_experts": 4}, 0),
    "MoE 4 experts top-2, EP2 x DP2": (2, {"expert_model_parallel_size": 2}, {"num_experts": 4}, 1),
}


def batches(cfg, step, dp, rank, micro=2, total=8):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (total, cfg.seq_length + 1), generator=g)
    return [{"tokens": x[i:i + micro, :-1], "labels": x[i:i + micro, 1:], "loss_mask": torch.ones(micro, cfg.seq_length),
             "position_ids": torch.arange(cfg.seq_length).expand(micro, -1)}
            for j, i in enumerate(range(0, total, micro)) if j % dp == rank]


def worker(rank, world, name, steps):
    _, parallel, moe, stage = LAYOUTS[name]
    if moe:
        moe = {"moe_router_topk": 2, "moe_ffn_hidden_size": 48, "moe_aux_loss_coeff": 1e-2, **moe}
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                        hidden_dropout=0.0, attention_dropout=0.0, **moe)
    t = TrainConfig(micro_batch_size=2, global_batch_size=8, lr=1e-3, clip_grad=1.0, train_iters=steps)
    config = Config(model, ParallelConfig(**parallel), t, DataConfig(mock_data=True))
    grid = build_grid(config.parallel, world, rank, experts=bool(model.num_experts))
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(0)
    opt = DistributedOptimizer(chunks, t, grid, stage=stage)
    per_step, results = [], []
    for s in range(steps):
        mine = batches(model, s, grid.layout.dp, grid.dp_rank)
        with count_host_syncs() as calls:
            results.append(train_step(chunks, opt, mine, t, s, LossScaler(False), grid))
        per_step.append(len(calls))
    with count_host_syncs() as read:
        resolve_steps(results)
    return per_step, len(read), len(mine)


def main():
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    positive(parser, "--steps", args.steps)
    print(f"host syncs per train step ({args.steps} steps; 2-layer GPT, micro-batches per rank shown):")
    print(f"  {'layout':<42} {'per step':>9} {'log read':>9}  micro-batches")
    for name, (world, *_rest) in LAYOUTS.items():
        if world == 1:
            per_step, read, micro = worker(0, 1, name, args.steps)
        else:
            per_step, read, micro = run_world(worker, world, name, args.steps)[0]
        print(f"  {name:<42} {'/'.join(map(str, per_step)):>9} {read:>9}  {micro}")
    print("(log read: one per log interval, for all its steps; EP > 1 reads the all-to-all split sizes, "
          "and the torch experts' loop its per-expert counts, once per MoE layer forward)")


if __name__ == "__main__":
    main()
