#!/usr/bin/env python
"""Optimizer step time: megalite's DP/ZeRO optimizer against ``torch.optim.AdamW``, side by
side in one run, on the parameters of one GPT.

Timed, each on its own copy of the same weights and gradients (fp32, clipping on):
- ``torch foreach``: ``torch.optim.AdamW(foreach=True)`` (torch's default on a GPU) over the
  model's parameters, two groups (decayed / not), after ``clip_grad_norm_``'s coefficient is
  applied to the gradients (as a training step does before it);
- ``torch fused``: the same with ``fused=True``;
- ``megalite``: ``DistributedOptimizer.step`` (one process, ZeRO-0): the fused AdamW on the
  flat fp32 master shards, clipping and the inf/NaN skip as device values, then the new
  weights copied into the model (``publish``);
- ``megalite unfused``: the update it replaced, written out as separate torch ops (about
  eight elementwise passes over each shard), for the gain of fusing.

Each round runs every variant once, in a rotating order; the median per variant and the
ratios to ``torch foreach`` are printed (and written with ``--json``). The step count grows
by one per call, which does not change the work.

``--muon`` (issue 39) times Muon instead, at each of ``--muon-shapes`` (hidden x layers; the
default 512x8 is the 29.4M-parameter shape above, 1024x8 a 109M one):

- ``torch fused`` and ``megalite AdamW`` as above (fused AdamW), beside
- ``megalite Muon``: ``DistributedOptimizer.step`` with the ``muon`` rule (one process; the
  rule's AdamW part over embeddings, output layer, norms and biases included), its Newton-Schulz
  FLOPs per step in the table (:func:`megalite.data_parallel.muon.matrix_ns_flops`, summed over the logical matrices);

then Muon's step at DP 1 against DP 2 ZeRO-1 (gloo worlds on loopback, ``--threads`` split over
the ranks), where each rank orthogonalises only the matrices it owns: the per-step time and each
rank's share of the NS FLOPs (the ownership's balance).

    python tools/bench_optimizer.py [--hidden 512] [--layers 8] [--rounds 15] [--threads 2] [--json PATH]
    python tools/bench_optimizer.py --muon [--muon-shapes 512x8 1024x8] [--rounds 3] [--json PATH]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from megalite.data_parallel.muon import logical_pieces, matrix_ns_flops, takes_muon  # noqa: E402
from megalite.data_parallel.update_rule import ADAMW, rule_named  # noqa: E402
from megalite.data_parallel.zero import DistributedOptimizer  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.testing.reference_step import build_optimizer  # noqa: E402
from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402

MUON_SETTINGS = {"optimizer": "muon", "muon_scale_mode": "spectral", "muon_extra_scale_factor": 0.2}  # the work
# does not depend on the scale; these are the settings the AdamW-vs-Muon sweep trains with


def build(args):
    return build_shape(args.hidden, args.layers)


def build_shape(hidden: int, layers: int, **train):
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8, vocab_size=8192,
                      seq_length=64, hidden_dropout=0.0, attention_dropout=0.0)
    t = TrainConfig(micro_batch_size=1, global_batch_size=1, lr=1e-4, weight_decay=0.1, clip_grad=1.0, train_iters=1,
                    **train)
    model = GPTModel(cfg)
    model.init_weights(0)
    g = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(p.shape, generator=g) * 1e-3 for n, p in model.named_parameters()}
    return cfg, t, model, grads


def torch_variant(cfg, t, model, grads, **kind):
    copy = GPTModel(cfg)
    copy.load_state_dict(model.state_dict())
    opt = build_optimizer(copy, t)
    for group in opt.param_groups:
        group.update(kind)
    params = [(p, grads[n]) for n, p in copy.named_parameters()]

    def step():
        for p, g in params:
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_([p for p, _ in params], t.clip_grad, foreach=True)
        del norm
        opt.step()
    return step, sum(p.numel() for p, _ in params)


def megalite_variant(cfg, t, model, grads, unfused=False):
    copy = GPTModel(cfg)
    copy.load_state_dict(model.state_dict())
    opt = DistributedOptimizer([copy], t, None, stage=0, rule=rule_named(t.optimizer))
    for name, p in copy.named_parameters():
        p.grad = grads[name].clone()
    opt.zero_grad()
    for b in opt.sync.buckets:  # the flat gradient shard, as the reduction leaves it
        flat = opt.sync.shard_grad(b)
        for p, (start, numel) in zip(b.params, b.offsets):
            flat[start: start + numel].copy_(grads[next(n for n, q in copy.named_parameters() if q is p)].reshape(-1))
    saved = [opt.sync.shard_grad(b).clone() for b in opt.sync.buckets]

    def step():
        for b, g in zip(opt.sync.buckets, saved):
            opt.sync.shard_grad(b).copy_(g)  # the fused step unscales the gradients in place
        norm = opt.grad_norm()
        found_inf = ~torch.isfinite(norm)
        coeff = (t.clip_grad / (norm + 1e-6)).clamp(max=1.0)
        if unfused:
            unfused_step(opt, t, coeff)
        else:
            opt.step(t.lr, coeff, found_inf)
    return step, sum(m.numel() for m in opt.master)


def unfused_step(opt, t, coeff):
    """The update before the fused kernel: separate torch ops per shard, then publish."""
    opt.update.steps += 1
    step = float(opt.update.steps)
    b1, b2 = t.adam_beta1, t.adam_beta2
    first, second = (opt.state[name] for name in ADAMW.state_names)  # the moments m and v, named by the rule
    for i, b in enumerate(opt.sync.buckets):
        for a, z in opt.decay_ranges[i]:
            opt.master[i][a:z].mul_(1 - t.lr * t.weight_decay)
        g = opt.sync.shard_grad(b).float() * coeff
        m, v, w = first[i], second[i], opt.master[i]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** step)).add_(t.adam_eps)
        w.addcdiv_(m, denom, value=-t.lr / (1 - b1 ** step))
    opt.publish()


def timed(variants: dict, rounds: int, warmup: int) -> dict:
    """Median milliseconds per variant: each round runs every variant once, the order rotated by
    one per round (no variant always first or last); the first ``warmup`` rounds are not counted."""
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds + warmup):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            variants[name][0]()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


# -- Muon (issue 39) ------------------------------------------------------------------------------
def matrix_flops(name: str, p, cfg, t) -> int:
    """NS FLOPs per step of parameter ``p``: the sum over its logical matrices (a fused QKV per
    q, k, v; a [gate; up] per half; experts per expert: megalite.data_parallel.muon.logical_pieces)."""
    if not takes_muon(name, p):
        return 0
    total = 0
    for select in logical_pieces(name, p, tuple(p.shape), cfg, t.muon_split_qkv):
        piece = select(p.detach())
        total += matrix_ns_flops(piece.numel() // piece.shape[-1], piece.shape[-1], t.muon_num_ns_steps)
    return total


def muon_shape_rows(hidden: int, layers: int, rounds: int) -> dict:
    """One shape: torch fused AdamW, megalite's fused AdamW and megalite's Muon, side by side."""
    cfg, t, model, grads = build_shape(hidden, layers)
    _, t_muon, _, _ = build_shape(hidden, layers, **MUON_SETTINGS)
    variants = {"torch fused": torch_variant(cfg, t, model, grads, fused=True),
                "megalite AdamW": megalite_variant(cfg, t, model, grads),
                "megalite Muon": megalite_variant(cfg, t_muon, model, grads)}
    medians = timed(variants, rounds, warmup=1)
    flops = sum(matrix_flops(n, p, cfg, t_muon) for n, p in model.named_parameters())
    return {"shape": f"{hidden}x{layers}", "parameters": variants["megalite AdamW"][1], "median_ms": medians,
            "ratio_to_torch_fused": {k: v / medians["torch fused"] for k, v in medians.items()},
            "ns_flops_per_step": flops}


def dp_worker(rank: int, world: int, hidden: int, layers: int, rounds: int, threads: int) -> dict:
    """Muon's step on rank ``rank`` of a DP ``world`` (ZeRO-1 when world > 1): median ms over
    ``rounds`` after one warm-up (every rank steps together: the step's collectives pace them),
    and the NS FLOPs of the matrices this rank owns."""
    torch.set_num_threads(threads)
    cfg, t, model, grads = build_shape(hidden, layers, **MUON_SETTINGS)
    grid = build_grid(ParallelConfig(), world, rank)
    opt = DistributedOptimizer([model], t, grid, stage=1 if world > 1 else 0, rule=rule_named(t.optimizer))
    names = {p: n for n, p in model.named_parameters()}
    for b in opt.sync.buckets:  # the reduced gradient, whole on every rank at ZeRO-1 (each steps its shard)
        for p, (start, numel) in zip(b.params, b.offsets):
            b.grad[start: start + numel].copy_(grads[names[p]].reshape(-1))
    saved = [b.grad.clone() for b in opt.sync.buckets]
    times = []
    for r in range(rounds + 1):
        for b, g in zip(opt.sync.buckets, saved):
            b.grad.copy_(g)
        torch.distributed.barrier()
        start = time.perf_counter()
        norm = opt.grad_norm()
        opt.step(t.lr, (t.clip_grad / (norm + 1e-6)).clamp(max=1.0), ~torch.isfinite(norm))
        if r:
            times.append(time.perf_counter() - start)
    owned = sum(matrix_flops(n, p, cfg, t) for bucket in opt.update.owned for n, p, _ in bucket)
    return {"median_ms": statistics.median(times) * 1e3, "ns_flops": owned}


def muon_dp_rows(hidden: int, layers: int, rounds: int, threads: int) -> dict:
    """Muon at DP 1 against DP 2 ZeRO-1, the same threads in all (split over the ranks)."""
    rows = {}
    for world in (1, 2):
        ranks = run_world(dp_worker, world, hidden, layers, rounds, max(1, threads // world), timeout=3600.0)
        rows[f"DP{world}"] = {"median_ms": max(r["median_ms"] for r in ranks),  # the step ends with its slowest rank
                              "ns_flops_per_rank": [r["ns_flops"] for r in ranks],
                              "threads_per_rank": max(1, threads // world)}
    return rows


def print_muon(shapes: list[dict], dp: dict, args) -> None:
    print(f"optimizer step, AdamW against Muon ({args.threads} thread(s), median of {args.rounds} rounds, "
          f"torch {torch.__version__}; Muon: {MUON_SETTINGS}):")
    for row in shapes:
        print(f"  shape {row['shape']} ({row['parameters'] / 1e6:.1f}M fp32 parameters), Newton-Schulz "
              f"{row['ns_flops_per_step'] / 1e9:.1f} GFLOP per step:")
        for name, ms in row["median_ms"].items():
            ns = f"   NS {row['ns_flops_per_step'] / ms / 1e6:6.1f} GFLOP/s" if name == "megalite Muon" else ""
            print(f"    {name:<15} {ms:9.1f} ms   {row['ratio_to_torch_fused'][name]:7.2f}x torch fused{ns}")
    one = dp["DP1"]["median_ms"]
    print(f"  Muon at shape {args.hidden}x{args.layers}, DP 1 against DP 2 ZeRO-1 (gloo on loopback; the slowest "
          f"rank's median):")
    for name, row in dp.items():
        flops = row["ns_flops_per_rank"]
        share = " / ".join(f"{f / 1e9:.1f}" for f in flops)
        balance = max(flops) / (sum(flops) / len(flops)) if sum(flops) else 1.0
        print(f"    {name:<4} {row['median_ms']:9.1f} ms   {row['median_ms'] / one:5.2f}x DP1   "
              f"{row['threads_per_rank']} thread(s) per rank   NS GFLOP per rank {share} (max/mean {balance:.2f})")


def parse_shape(text: str) -> tuple[int, int]:
    try:
        hidden, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HIDDENxLAYERS (e.g. 1024x8)") from None
    if hidden < 8 or hidden % 8 or layers < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the hidden size must be a multiple of 8 (8 heads), layers >= 1")
    return hidden, layers


def main(argv=None):
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--muon", action="store_true", help="time Muon against fused AdamW, and Muon at DP1 vs "
                        "DP2 ZeRO-1 (at --hidden x --layers)")
    parser.add_argument("--muon-shapes", type=parse_shape, nargs="+", default=[(512, 8), (1024, 8)],
                        metavar="HIDDENxLAYERS")
    args = parser.parse_args(argv)
    positive(parser, "--hidden/--layers/--rounds/--threads", args.hidden, args.layers, args.rounds, args.threads)
    writable(parser, "--json", args.json)
    torch.set_num_threads(args.threads)
    if args.muon:
        # The gloo worlds first: they fork this process, and a fork after torch has run a
        # multi-threaded (OpenMP) op can hang in the child's first parallel region.
        dp = muon_dp_rows(args.hidden, args.layers, args.rounds, args.threads)
        shapes = [muon_shape_rows(h, n, args.rounds) for h, n in args.muon_shapes]
        print_muon(shapes, dp, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"threads": args.threads, "rounds": args.rounds, "shapes": shapes, "dp": dp}, f, indent=1)
        return {"shapes": shapes, "dp": dp}
    cfg, t, model, grads = build(args)
    variants = {"torch foreach": torch_variant(cfg, t, model, grads, foreach=True),
                "torch fused": torch_variant(cfg, t, model, grads, fused=True),
                "megalite": megalite_variant(cfg, t, model, grads),
                "megalite unfused": megalite_variant(cfg, t, model, grads, unfused=True)}
    numel = variants["megalite"][1]
    medians = timed(variants, args.rounds, warmup=2)
    base = medians["torch foreach"]
    print(f"optimizer step, {numel / 1e6:.1f}M fp32 parameters, {args.threads} thread(s), "
          f"median of {args.rounds} rounds (torch {torch.__version__}):")
    for name, ms in medians.items():
        print(f"  {name:<17} {ms:8.1f} ms   {ms / base:5.2f}x torch foreach")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"parameters": numel, "threads": args.threads, "median_ms": medians,
                       "ratio_to_torch_foreach": {k: v / base for k, v in medians.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
