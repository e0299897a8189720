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

    python tools/bench_optimizer.py [--hidden 512] [--layers 8] [--rounds 15] [--threads 2] [--json PATH]
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

from megalite.config import ModelConfig, TrainConfig  # noqa: E402
from megalite.data_parallel.update_rule import ADAMW  # noqa: E402
from megalite.data_parallel.zero import DistributedOptimizer  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.testing.reference_step import build_optimizer  # noqa: E402
from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402


def build(args):
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, vocab_size=8192,
                      seq_length=64, hidden_dropout=0.0, attention_dropout=0.0)
    t = TrainConfig(micro_batch_size=1, global_batch_size=1, lr=1e-4, weight_decay=0.1, clip_grad=1.0, train_iters=1)
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
    opt = DistributedOptimizer([copy], t, None, stage=0, rule=ADAMW)
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


def main():
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    positive(parser, "--hidden/--layers/--rounds/--threads", args.hidden, args.layers, args.rounds, args.threads)
    writable(parser, "--json", args.json)
    torch.set_num_threads(args.threads)
    cfg, t, model, grads = build(args)
    variants = {"torch foreach": torch_variant(cfg, t, model, grads, foreach=True),
                "torch fused": torch_variant(cfg, t, model, grads, fused=True),
                "megalite": megalite_variant(cfg, t, model, grads),
                "megalite unfused": megalite_variant(cfg, t, model, grads, unfused=True)}
    numel = variants["megalite"][1]
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds + 2):  # two warm-up rounds
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            variants[name][0]()
            if r >= 2:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
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
