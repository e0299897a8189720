#!/usr/bin/env python
"""Framework overhead: megalite's single-process training step against a plain PyTorch
GPT-2 of the same shape, alternated step by step in one run.

megalite: ``GPTModel`` + ``megalite.testing.reference_step.train_step`` with torch AdamW from
``build_optimizer`` (serial, grid=None): loss mask and mean, global gradient norm,
clipping, LR schedule, loss-scale bookkeeping.
Plain: the GPT-2 below (embeddings, pre-LN blocks with a fused qkv linear, SDPA causal,
GELU-tanh MLP, tied output, ``F.cross_entropy``), torch AdamW with the same two parameter
groups, ``clip_grad_norm_``. Both fp32, same initial weights (copied from megalite), the
same batches; the first step's losses are compared to show they compute the same thing.

After warm-up the two steps alternate (A B, then B A, ...), so drifts of the machine hit
both alike. Reported: median step time of each and the ratio megalite / plain (goal <= 1.05;
Hugging Face's GPT-2 measures about 1.10 on our CPUs). ``--profile`` prints where each
spends its time (torch.profiler, self CPU time per op).

    python tools/bench_overhead.py [--threads 1 2] [--steps 20] [--json PATH] [--profile]
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
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from megalite.config import ModelConfig, TrainConfig  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.train.step import LossScaler  # noqa: E402
from megalite.testing.reference_step import build_optimizer, train_step  # noqa: E402
from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402


# -- the plain PyTorch GPT-2 -----------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, h, heads, dropout):
        super().__init__()
        self.heads, self.p = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):  # (b, s, h)
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class PlainGPT(nn.Module):
    def __init__(self, vocab, seq, h, heads, layers, dropout):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(h, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied output
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def plain_optimizer(model, t: TrainConfig):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "ln" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "ln" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def plain_step(model, opt, batch, clip):
    opt.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], batch["labels"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.item()


@torch.no_grad()
def copy_weights(plain: PlainGPT, meg: GPTModel, heads: int) -> None:
    """megalite's weights into the plain model. megalite's qkv rows are ordered by key/value
    group (here one head each: q, k, v of head 0, then of head 1, ...); plain's are [q; k; v]."""
    v = plain.wte.weight.shape[0]
    plain.wte.weight.copy_(meg.word_embeddings.weight[:v])
    plain.wpe.weight.copy_(meg.position_embeddings.weight)
    plain.ln_f.load_state_dict(meg.final_norm.state_dict())
    for block, layer in zip(plain.blocks, meg.layers.values()):
        block.ln1.load_state_dict(layer.attn_norm.state_dict())
        block.ln2.load_state_dict(layer.mlp_norm.state_dict())
        w, b = layer.attn.qkv.weight, layer.attn.qkv.bias
        block.qkv.weight.copy_(w.view(heads, 3, -1, w.shape[1]).transpose(0, 1).reshape_as(w))
        block.qkv.bias.copy_(b.view(heads, 3, -1).transpose(0, 1).reshape_as(b))
        block.proj.load_state_dict(layer.attn.proj.state_dict())
        block.fc.load_state_dict(layer.mlp.fc1.state_dict())
        block.fc2.load_state_dict(layer.mlp.fc2.state_dict())


# -- the benchmark ---------------------------------------------------------------------------------

def make_batches(n, micro, seq, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (micro, seq + 1), generator=g)
        out.append({"tokens": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous(),
                    "loss_mask": torch.ones(micro, seq), "position_ids": torch.arange(seq).expand(micro, -1)})
    return out


def build(args):
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                      seq_length=args.seq_length, hidden_dropout=args.dropout, attention_dropout=args.dropout)
    t = TrainConfig(micro_batch_size=args.micro_batch_size, lr=3e-4, lr_decay_style="constant", clip_grad=1.0,
                    train_iters=10**6)
    torch.manual_seed(0)
    meg = GPTModel(cfg)
    meg.init_weights(1234)
    plain = PlainGPT(cfg.padded_vocab_size(), cfg.seq_length, cfg.hidden_size, cfg.num_attention_heads,
                     cfg.num_layers, args.dropout)
    copy_weights(plain, meg, cfg.num_attention_heads)
    return cfg, t, meg, plain


def run(args, threads: int) -> dict:
    torch.set_num_threads(threads)
    cfg, t, meg, plain = build(args)
    meg_opt, plain_opt = build_optimizer(meg, t), plain_optimizer(plain, t)
    scaler = LossScaler(False)
    batches = make_batches(4, args.micro_batch_size, cfg.seq_length, cfg.vocab_size)
    it = {"megalite": 0}

    def step_megalite(batch):
        result = train_step(meg, meg_opt, [batch], t, it["megalite"], scaler)
        it["megalite"] += 1
        return result.loss

    steps = {"megalite": step_megalite, "plain": lambda b: plain_step(plain, plain_opt, b, t.clip_grad)}
    first = {name: fn(batches[0]) for name, fn in steps.items()}  # also the first warm-up step
    for i in range(1, args.warmup):
        for fn in steps.values():
            fn(batches[i % len(batches)])
    times = {name: [] for name in steps}
    cpu = {name: [] for name in steps}  # process CPU time: less sensitive to other processes
    for i in range(args.steps):
        order = ("megalite", "plain") if i % 2 == 0 else ("plain", "megalite")
        for name in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name](batches[i % len(batches)])
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    med = {name: statistics.median(v) for name, v in times.items()}
    med_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    result = {"threads": torch.get_num_threads(), "first_loss": first,
              "median_ms": {k: v * 1e3 for k, v in med.items()},
              "min_ms": {k: min(v) * 1e3 for k, v in times.items()},
              "ratio": med["megalite"] / med["plain"],
              "paired_ratio_median": statistics.median(a / b for a, b in zip(times["megalite"], times["plain"])),
              "median_cpu_ms": {k: v * 1e3 for k, v in med_cpu.items()},
              "cpu_ratio": med_cpu["megalite"] / med_cpu["plain"],
              "load_average": os.getloadavg(),
              "times_ms": {k: [x * 1e3 for x in v] for k, v in times.items()}}
    if args.profile:
        result["profile"] = profile(steps, batches, args.profile_rows)
    return result


def profile(steps, batches, rows: int) -> dict:
    """Self CPU time per op over 3 steps of each model (torch.profiler), printed and returned."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    tables = {}
    for name, fn in steps.items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(3):
                fn(batches[i % len(batches)])
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        print(f"\n--- profile: {name}, 3 steps, by self CPU time ---\n{tables[name]}")
    return tables


def main(argv=None) -> int:
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout (both models)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps of each model, alternated")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    positive(p, "--num-layers/--hidden-size/--num-attention-heads/--seq-length/--vocab-size/--micro-batch-size/"
                "--threads/--steps", args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
             args.vocab_size, args.micro_batch_size, *args.threads, args.steps)
    writable(p, "--json", args.json)
    if args.hidden_size % args.num_attention_heads:
        p.error(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}")
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                      seq_length=args.seq_length)
    n_params = sum(p.numel() for p in GPTModel(cfg).parameters())
    print(f"shapes: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, seq "
          f"{args.seq_length}, micro batch {args.micro_batch_size}, vocab {args.vocab_size} (padded "
          f"{cfg.padded_vocab_size()}), {n_params / 1e6:.2f}M parameters, fp32, dropout {args.dropout}; "
          f"{args.warmup} warm-up + {args.steps} timed steps each, alternated; torch {torch.__version__}")
    report = {"shapes": {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                       "seq_length", "vocab_size", "micro_batch_size", "dropout")},
              "parameters": n_params, "torch": torch.__version__, "runs": []}
    for threads in args.threads:
        r = run(args, threads)
        report["runs"].append(r)
        fl = r["first_loss"]
        same = math.isclose(fl["megalite"], fl["plain"], rel_tol=1e-5)
        print(f"threads {r['threads']}: megalite {r['median_ms']['megalite']:.1f} ms, plain PyTorch "
              f"{r['median_ms']['plain']:.1f} ms (medians; min {r['min_ms']['megalite']:.1f} / "
              f"{r['min_ms']['plain']:.1f}); ratio {r['ratio']:.3f} (median of paired ratios "
              f"{r['paired_ratio_median']:.3f}); CPU-time ratio {r['cpu_ratio']:.3f}; load average "
              f"{r['load_average'][0]:.1f}; first-step loss {fl['megalite']:.6f} vs {fl['plain']:.6f}"
              f"{'' if same else '  <- MODELS DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
