#!/usr/bin/env python
"""Generation cache bytes per token: Multi-head Latent Attention's latent against GQA's keys and values.

What generation keeps per token and layer is the attention part's choice
(``PartShape.cache_buffers``): grouped-query attention keys and values, 2 g d elements;
Multi-head Latent Attention the normed latent and the shared RoPE key, r_kv + d_r
(megalite/model/mla.py). This tool builds each model (on the meta device: no weights), lets
``megalite.model.generation.model_cache`` allocate its cache on the CPU, and reports the bytes
of the allocated buffers over the positions they hold, next to the formula
(``megalite.model.counting.cache_bytes_per_token``) and the ratio GQA / MLA:

1. one layer: DeepSeek-V3's (r_kv 512, d_r 64: 576 elements) against Llama-3-8B's (8 groups x
   128 x 2 = 2048), and a cache of V3's 128 heads' keys and values of 192/128 (40960);
2. whole models: DeepSeek-V3 (61 layers) against Llama-3-8B (32 layers), bf16;
3. a tiny pair, built for real on the CPU, decoding greedily with the cache filled by the decode
   itself (bytes from that cache; decode tokens/s on this CPU, MLA's absorbed and expanded form);
4. one decode step of one attention layer (hidden 1024, 16 heads) over a long cache on this CPU:
   GQA against MLA expanded (W_ukv applied to every cached latent each step) and absorbed (the
   cache read once as one shared head).

    python tools/bench_generation_cache.py [--positions 1024] [--tiny-tokens 64] [--context 2048]
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny decode steps: more threads only contend

import torch  # noqa: E402

from megalite.config import ModelConfig  # noqa: E402
from megalite.layers.kv_cache import KVCache  # noqa: E402
from megalite.layers.rotary import rotary_angles  # noqa: E402
from megalite.model.counting import cache_bytes_per_token  # noqa: E402
from megalite.model.generation import model_cache  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from tools.tool_errors import one_line_errors, positive  # noqa: E402

COMMON = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, seq_length=4096, vocab_size=1024)
DEEPSEEK_V3 = dict(hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432, multi_latent_attention=True,
                   q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
LLAMA_3_8B = dict(hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336)
TINY_MLA = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, multi_latent_attention=True,
                q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                num_layers=2, seq_length=256, vocab_size=256)
TINY_GQA = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, num_layers=2,
                seq_length=256, vocab_size=256)


def config(shape: dict, **kw) -> ModelConfig:
    return ModelConfig(**{**COMMON, **shape, **kw})


def measured(cfg: ModelConfig, positions: int, dtype=torch.bfloat16) -> tuple[float, int]:
    """(bytes per token of the allocated cache, the formula's) for ``cfg`` built on meta."""
    with torch.device("meta"):
        model = GPTModel(cfg)
    cache = model_cache(model, 1, positions, dtype, torch.device("cpu"))
    got = cache.bytes_per_token()
    del cache
    return got, cache_bytes_per_token(cfg, torch.finfo(dtype).bits // 8)


def table(title: str, rows: list[tuple[str, float, int]], baseline: float) -> None:
    print(title)
    print(f"{'model':<34} {'bytes/token measured':>21} {'formula':>10} {'GQA / this':>11}")
    for name, got, formula in rows:
        print(f"{name:<34} {got:>21,.0f} {formula:>10,} {baseline / got:>11.2f}")
    print()


def per_layer(positions: int) -> None:
    v3 = measured(config(DEEPSEEK_V3, num_layers=1), positions)
    llama = measured(config(LLAMA_3_8B, num_layers=1), positions)
    heads, d_qk, d_v = 128, 128 + 64, 128  # V3's keys and values, were they cached per head
    full = KVCache.for_layers({"0": [(heads, d_qk), (heads, d_v)]}, 1, positions, torch.bfloat16, torch.device("cpu"))
    rows = [("Llama-3-8B layer (GQA 8 x 128)", *llama), ("DeepSeek-V3 layer (MLA 512 + 64)", *v3),
            ("V3 layer uncompressed (128 x 320)", full.bytes_per_token(), 2 * heads * (d_qk + d_v))]
    table(f"1. one layer, bf16 ({positions} positions allocated)", rows, llama[0])
    print(f"   elements per token: Llama-3-8B 2 x 8 x 128 = 2048, DeepSeek-V3 512 + 64 = 576, uncompressed "
          f"128 x (192 + 128) = 40960: the latent is {full.bytes_per_token() / v3[0]:.1f}x smaller than V3's "
          f"heads' keys and values\n")


def whole_models(positions: int) -> None:
    v3 = measured(config(DEEPSEEK_V3, num_layers=61), positions)
    llama = measured(config(LLAMA_3_8B, num_layers=32), positions)
    rows = [("Llama-3-8B, 32 layers", *llama), ("DeepSeek-V3, 61 layers", *v3)]
    table(f"2. whole models, bf16 ({positions} positions allocated)", rows, llama[0])


@torch.no_grad()
def decode(model: GPTModel, tokens: int) -> tuple[float, float]:
    """Greedy decode of ``tokens`` after a 4-token prompt with a fresh cache: (bytes per token of
    that cache, decode tokens per second)."""
    cache = model_cache(model, 1, tokens + 4, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    start = time.perf_counter()
    for _ in range(tokens):
        ids = model(ids, kv_cache=cache)[:, -1:].argmax(-1)
    return cache.bytes_per_token(), tokens / (time.perf_counter() - start)


def tiny_pair(tokens: int) -> None:
    print(f"3. tiny pair on this CPU, fp32, {tokens} tokens decoded greedily, best of 3 (cache bytes from the "
          f"decode's cache)")
    print(f"{'model':<40} {'bytes/token':>12} {'formula':>8} {'GQA / this':>11} {'decode tok/s':>13}")
    results = []
    for name, shape, absorbed in (("GQA: 4 heads, 2 groups x 16", TINY_GQA, None),
                                  ("MLA: r_kv 32 + d_r 8, absorbed", TINY_MLA, True),
                                  ("MLA: r_kv 32 + d_r 8, expanded", TINY_MLA, False)):
        cfg = config(shape)
        torch.manual_seed(0)
        model = GPTModel(cfg).eval()
        model.init_weights(0)
        for layer in model.layers.values():
            if absorbed is not None:
                layer.attn.absorbed = absorbed
        decode(model, 8)  # warm-up
        runs = [decode(model, tokens) for _ in range(3)]  # the best of 3: other work shares the CPU
        got, rate = runs[0][0], max(r for _, r in runs)
        results.append((name, got, cache_bytes_per_token(cfg, 4), rate))
    for name, got, formula, rate in results:
        print(f"{name:<40} {got:>12,.0f} {formula:>8,} {results[0][1] / got:>11.2f} {rate:>13,.0f}")
    print()


MID_MLA = dict(hidden_size=1024, num_attention_heads=16, ffn_hidden_size=1024, multi_latent_attention=True,
               q_lora_rank=384, kv_lora_rank=256, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64, num_layers=1)
MID_GQA = dict(hidden_size=1024, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=1024, num_layers=1)


@torch.no_grad()
def step_ms(attn, cfg: ModelConfig, context: int, repeats: int = 5) -> float:
    """Best time (ms) of one new position attending over ``context`` cached ones, one layer."""
    cache = KVCache.for_layers({"0": attn.cache_buffers(cfg)}, 1, context + 1, torch.float32, torch.device("cpu"))
    cos, sin = rotary_angles(torch.arange(context + 1)[None], cfg.rotary_dim, cfg.rotary_base)
    attn(torch.randn(context, 1, cfg.hidden_size), (cos[..., :context, :], sin[..., :context, :]), cache.layer(0))
    cache.advance(context)
    x, step = torch.randn(1, 1, cfg.hidden_size), (cos[..., context:, :], sin[..., context:, :])
    best = float("inf")
    for _ in range(repeats):
        cache.length = context  # the same step again
        start = time.perf_counter()
        attn(x, step, cache.layer(0))
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def decode_step(context: int) -> None:
    print(f"4. one decode step of one attention layer over {context} cached positions, this CPU, fp32, best of 5")
    print(f"{'layer (hidden 1024, 16 heads)':<44} {'bytes/token':>12} {'step ms':>8}")
    for name, shape, absorbed in (("GQA: 4 groups x 64", MID_GQA, None),
                                  ("MLA: r_kv 256 + d_r 32, expanded", MID_MLA, False),
                                  ("MLA: r_kv 256 + d_r 32, absorbed", MID_MLA, True)):
        cfg = config(shape, seq_length=context + 1)
        torch.manual_seed(0)
        model = GPTModel(cfg).eval()
        model.init_weights(0)
        attn = model.layers["0"].attn
        if absorbed is not None:
            attn.absorbed = absorbed
        print(f"{name:<44} {cache_bytes_per_token(cfg, 4):>12,} {step_ms(attn, cfg, context):>8.2f}")
    print()


def main(argv=None) -> int:
    p = one_line_errors(argparse.ArgumentParser(description=__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--positions", type=int, default=1024, help="positions each cache allocates (1. and 2.)")
    p.add_argument("--tiny-tokens", type=int, default=64, help="tokens the tiny pair decodes (3.)")
    p.add_argument("--context", type=int, default=2048, help="cached positions of the decode step (4.)")
    a = p.parse_args(argv)
    positive(p, "--positions/--tiny-tokens/--context", a.positions, a.tiny_tokens, a.context)
    per_layer(a.positions)
    whole_models(a.positions)
    tiny_pair(a.tiny_tokens)
    decode_step(a.context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
