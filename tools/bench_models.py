#!/usr/bin/env python
"""Training speed of two model families side by side on the CPU: a DeepSeek-V3-tiny against a
Llama of equal active parameters per token, in one process, alternating.

The models (built from ``pretrain_gpt.py`` command lines, :func:`command_lines`):
- **DeepSeek-V3-tiny**: Multi-head Latent Attention (query latent, key/value latent, per head a
  no-RoPE and a RoPE part, d_qk != d_v), YaRN RoPE, the first layer dense and the rest MoE
  (8 experts top-2 in 4 groups keeping 2, sigmoid scores, routed scaling factor, a shared
  expert, aux-loss-free expert bias);
- **Llama**: the same hidden size, layers, heads, vocabulary and sequence, GQA, RoPE, RMSNorm,
  SwiGLU, with the FFN width solved so that its parameters equal the DeepSeek model's *active*
  parameters per token (:func:`megalite.model.counting.active_parameters`: all parameters but
  the E - k experts a token skips in each MoE layer). Both counts are printed, and their gap.

Each model gets its own DistributedOptimizer (one process, ZeRO-0) and the same batches of
random tokens; after ``--warmup`` steps each, ``--steps`` rounds run one train step of each
model, in alternating order, so both see the same machine load. Printed per model: the
median step time, tokens/s (global batch x sequence / step time), model FLOPs per token
(the one definition, :func:`megalite.model.counting.flops_per_token`: 6 N_active + 3 x
attended FLOPs x s) and the FLOP/s achieved, and the ratio of the two tokens/s.

    python tools/bench_models.py [--hidden 256] [--layers 4] [--seq 256] [--micro 4] [--global-batch 8]
                                 [--steps 6] [--warmup 2] [--threads 1] [--quick] [--json PATH]

``--quick``: a model of hidden 32, 2 layers, seq 32, one warm-up step and two rounds (a smoke
run for the test, seconds; its numbers mean nothing).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.arguments import parse_settings  # noqa: E402
from megalite.config import validate  # noqa: E402
from megalite.model.counting import active_parameters, flops_per_token, total_parameters  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.observe.step_values import LossScaler  # noqa: E402
from megalite.train.step import build_data_parallel_optimizer, train_step  # noqa: E402
from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402

VOCAB, HEADS, QUERY_GROUPS = 1024, 8, 2
QUICK = dict(hidden=32, layers=2, seq=32, micro=2, global_batch=4, steps=2, warmup=1, threads=1)


def _common(a) -> list[str]:
    return ["--mock-data", "--vocab-size", str(VOCAB), "--seq-length", str(a.seq), "--num-layers", str(a.layers),
            "--hidden-size", str(a.hidden), "--num-attention-heads", str(HEADS), "--normalization", "RMSNorm",
            "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--position-embedding-type", "rope", "--micro-batch-size", str(a.micro),
            "--global-batch-size", str(a.global_batch), "--lr", "1e-3", "--train-iters", "1000",
            "--hidden-dropout", "0", "--attention-dropout", "0"]


def deepseek_v3_tiny(a) -> list[str]:
    """DeepSeek-V3's shape scaled to hidden ``h`` (V3: h 7168, query latent 1536 ~ h/5, key/value
    latent 512, heads of 128 + 64 RoPE against values of 128, dense FFN 18432 ~ 2.6 h, routed
    and shared experts of 2048 ~ h/3.5; here h/4 latents, heads of h/8 + h/16 against h/8)."""
    h = a.hidden
    return _common(a) + [
        "--multi-latent-attention", "--q-lora-rank", str(h // 4), "--kv-lora-rank", str(h // 4),
        "--qk-head-dim", str(h // HEADS), "--qk-pos-emb-head-dim", str(h // (2 * HEADS)),
        "--v-head-dim", str(h // HEADS), "--rope-type", "yarn", "--rotary-scaling-factor", "4",
        "--yarn-original-max-position-embeddings", str(max(a.seq // 4, 1)), "--mscale", "1.0",
        "--mscale-all-dim", "1.0", "--ffn-hidden-size", str(5 * h // 2),
        "--moe-layer-freq", f"([0]*1+[1]*{a.layers - 1})", "--num-experts", "8", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", str(h // 2), "--moe-shared-expert-intermediate-size", str(h // 2),
        "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
        "--moe-router-load-balancing-type", "none"]


def llama(a, ffn: int) -> list[str]:
    return _common(a) + ["--num-query-groups", str(QUERY_GROUPS), "--ffn-hidden-size", str(ffn)]


def config_of(argv: list[str]):
    config = parse_settings(argv).config
    config.model.vocab_size = VOCAB
    validate(config, 1)
    return config


def matched_llama_ffn(a, target: int) -> int:
    """The Llama FFN width whose parameter count is nearest ``target``: the count is linear in the
    width (3 h per unit of width per layer with SwiGLU), so two counts give the line."""
    at_1, at_2 = (total_parameters(config_of(llama(a, f)).model) for f in (1, 2))
    return max(1, round(1 + (target - at_1) / (at_2 - at_1)))


def command_lines(a) -> dict[str, list[str]]:
    """The two models' command lines, the Llama's FFN solved for equal active parameters."""
    deepseek = deepseek_v3_tiny(a)
    target = active_parameters(config_of(deepseek).model)
    return {"DeepSeek-V3-tiny": deepseek, "Llama": llama(a, matched_llama_ffn(a, target))}


def build(argv: list[str], seed: int = 0):
    """(config, model, optimizer, step) for one model: ``step(batch)`` trains one step."""
    config = config_of(argv)
    model = GPTModel(config.model)
    model.init_weights(seed)
    optimizer = build_data_parallel_optimizer([model], config.train, None)
    scaler, iteration = LossScaler(False), [0]

    def step(micro_batches):
        result = train_step([model], optimizer, micro_batches, config.train, iteration[0], scaler)
        iteration[0] += 1
        return float(result.loss)  # waits for the step
    return config, model, optimizer, step


def batches(a, count: int) -> list[list[dict]]:
    """``count`` global batches of random tokens (each micro-batches of ``--micro``)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        x = torch.randint(0, VOCAB, (a.global_batch, a.seq + 1), generator=g)
        out.append([{"tokens": x[i:i + a.micro, :-1], "labels": x[i:i + a.micro, 1:],
                     "loss_mask": torch.ones(a.micro, a.seq), "position_ids": torch.arange(a.seq).expand(a.micro, -1)}
                    for i in range(0, a.global_batch, a.micro)])
    return out


def measure(a) -> dict:
    """Warm up each model, then alternate one step of each per round; medians per model."""
    models = {name: build(argv) for name, argv in command_lines(a).items()}
    data = batches(a, a.warmup + a.steps)
    for name, (_, _, _, step) in models.items():
        for b in data[:a.warmup]:
            step(b)
    times = {name: [] for name in models}
    names = list(models)
    for r in range(a.steps):
        for name in names[r % 2:] + names[:r % 2]:  # alternate who goes first
            start = time.perf_counter()
            models[name][3](data[a.warmup + r])
            times[name].append(time.perf_counter() - start)
    tokens = a.global_batch * a.seq
    out = {}
    for name, (config, _, _, _) in models.items():
        m, seconds = config.model, statistics.median(times[name])
        out[name] = {"total_parameters": total_parameters(m), "active_parameters": active_parameters(m),
                     "flops_per_token": flops_per_token(m), "step_ms": seconds * 1e3,
                     "tokens_per_s": tokens / seconds, "gflops_per_s": flops_per_token(m) * tokens / seconds / 1e9,
                     "ffn_hidden_size": m.ffn_hidden_size}
    return out


def report(a, results: dict) -> str:
    deepseek, llama_ = results["DeepSeek-V3-tiny"], results["Llama"]
    gap = deepseek["active_parameters"] / llama_["active_parameters"] - 1
    lines = [f"hidden {a.hidden}, {a.layers} layers, {HEADS} heads, vocab {VOCAB}, seq {a.seq}, global batch "
             f"{a.global_batch} (micro {a.micro}); {a.warmup} warm-up step(s) each, median of {a.steps} "
             f"alternating rounds; {torch.get_num_threads()} thread(s), torch {torch.__version__}",
             f"active parameters per token: DeepSeek-V3-tiny {deepseek['active_parameters']:,} "
             f"(of {deepseek['total_parameters']:,}), Llama {llama_['active_parameters']:,} "
             f"(FFN {llama_['ffn_hidden_size']}): gap {gap:+.2%}",
             f"{'model':<17} {'step ms':>9} {'tokens/s':>10} {'FLOPs/token':>12} {'GFLOP/s':>8}"]
    for name, r in results.items():
        lines.append(f"{name:<17} {r['step_ms']:9.1f} {r['tokens_per_s']:10.0f} {r['flops_per_token']:12.3e} "
                     f"{r['gflops_per_s']:8.2f}")
    lines.append(f"tokens/s DeepSeek-V3-tiny / Llama: {deepseek['tokens_per_s'] / llama_['tokens_per_s']:.2f}")
    return "\n".join(lines)


def parse(argv=None):
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the 2-core machine is shared)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds): " + str(QUICK))
    parser.add_argument("--json", default=None)
    a = parser.parse_args(argv)
    if a.quick:
        vars(a).update(QUICK)
    positive(parser, "--hidden/--layers/--seq/--micro/--global-batch/--steps/--threads", a.hidden, a.layers, a.seq,
             a.micro, a.global_batch, a.steps, a.threads)
    if a.layers < 2:
        parser.error(f"--layers {a.layers}: DeepSeek-V3-tiny needs 2 or more (the first is dense, the rest MoE)")
    if a.hidden % (2 * HEADS):
        parser.error(f"--hidden {a.hidden}: must divide by {2 * HEADS} (heads of h/{HEADS} + h/{2 * HEADS} RoPE)")
    if a.global_batch % a.micro:
        parser.error(f"--global-batch {a.global_batch} must be a multiple of --micro {a.micro}")
    writable(parser, "--json", a.json)
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    torch.set_num_threads(a.threads)
    results = measure(a)
    print(report(a, results), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
