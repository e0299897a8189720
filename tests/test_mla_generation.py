"""Generation with Multi-head Latent Attention: the cache holds the compressed latent.

Oracle: an uncached greedy loop, the argmax of a full forward (the training path, checked against
the float64 reference in tests/test_mla.py) over the growing sequence. The cached decode, in the
expanded and the absorbed form, must give the same tokens and the full forward's logits at every
position, with and without a query latent and with YaRN. The cache's bytes per token are
measured from the tensors it allocated and compared with the formula written out here:
(r_kv + d_r) elements per layer for MLA, 2 g d for grouped-query attention.
"""
from __future__ import annotations

import pytest
import torch

from megalite.config_types import yarn_rope_scaling
from megalite.layers.part_shape import MLAShape, SelfAttentionShape
from megalite.model.counting import cache_bytes_per_token
from megalite.model.generation import generate, model_cache
from megalite.model.gpt import GPTModel
from tests.test_mla import DR, RKV, mla_config

YARN = yarn_rope_scaling(factor=40.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0)
VARIANTS = {"query latent": {}, "no query latent": dict(q_lora_rank=None), "yarn": dict(rope_scaling=YARN)}


def _model(**kw) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(mla_config(**kw))
    model.init_weights(7)
    with torch.no_grad():  # latent norms away from 1, so that caching c before its norm would show
        for layer in model.layers.values():
            for norm in (layer.attn.kv_norm, layer.attn.q_norm):
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def _set_form(model: GPTModel, absorbed: bool) -> None:
    for layer in model.layers.values():
        layer.attn.absorbed = absorbed


@torch.no_grad()
def _uncached_greedy(model: GPTModel, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_greedy_equals_the_uncached_loop(variant):
    model = _model(**VARIANTS[variant])
    prompt = [3, 41, 7, 99, 15]
    want = _uncached_greedy(model, prompt, 11)  # 16 positions: the model's seq_length
    ids = torch.tensor([prompt + want])
    with torch.no_grad():
        full = model(ids)
    forms = {}
    for absorbed in (False, True):
        _set_form(model, absorbed)
        assert generate(model, prompt, 11) == want, (variant, absorbed)
        cache = model_cache(model, 1, ids.shape[1], torch.float32, torch.device("cpu"))
        with torch.no_grad():  # the prompt at once, then one position a step: the full forward's logits
            steps = [model(ids[:, :5], kv_cache=cache)] + [model(ids[:, i: i + 1], kv_cache=cache)
                                                           for i in range(5, ids.shape[1])]
        forms[absorbed] = torch.cat(steps, 1)
        assert (forms[absorbed] - full).abs().max() < 1e-5 * full.abs().max(), (variant, absorbed)
    assert (forms[True] - forms[False]).abs().max() < 1e-5 * full.abs().max()


def test_the_cache_holds_the_latent_not_keys_and_values():
    """Bytes per token measured from the allocated buffers: L (r_kv + d_r) e for MLA (also under
    TP: the latent is replicated), 2 L g d e for GQA (/ t under TP); the counting's one definition
    gives the same; DeepSeek-V3's layer caches 576 elements against a Llama-3-8B layer's 2048."""
    mla = _model()
    L = mla.cfg.num_layers
    for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
        cache = model_cache(mla, 2, 16, dtype, torch.device("cpu"))
        assert cache.bytes_per_token() == L * (RKV + DR) * e
        assert [tuple(b.shape) for b in cache.layer("0").buffers] == [(2, 1, 16, RKV + DR)]
        assert cache_bytes_per_token(mla.cfg, e) == L * (RKV + DR) * e
    assert cache_bytes_per_token(mla.cfg, 2, tp=2) == L * (RKV + DR) * 2  # replicated over TP

    gqa_cfg = mla_config(multi_latent_attention=False, num_query_groups=2, normalization="RMSNorm")
    gqa = GPTModel(gqa_cfg)
    g, d = 2, gqa_cfg.head_dim
    assert model_cache(gqa, 1, 16, torch.float32, torch.device("cpu")).bytes_per_token() == L * 2 * g * d * 4
    assert cache_bytes_per_token(gqa_cfg, 4) == L * 2 * g * d * 4
    assert cache_bytes_per_token(gqa_cfg, 4, tp=2) == L * 2 * (g // 2) * d * 4

    v3 = mla_config(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                    qk_pos_emb_head_dim=64, v_head_dim=128)
    llama = mla_config(multi_latent_attention=False, hidden_size=4096, num_attention_heads=32, num_query_groups=8)
    assert MLAShape.cache_elements_per_token(v3) == 576
    assert SelfAttentionShape.cache_elements_per_token(llama) == 8 * 128 * 2


def test_a_full_cache_is_one_message():
    model = _model()
    cache = model_cache(model, 1, 4, torch.float32, torch.device("cpu"))
    with torch.no_grad(), pytest.raises(ValueError, match="the KV cache holds 4 positions; 0 \\+ 5 do not fit"):
        model(torch.arange(5)[None], kv_cache=cache)


def test_tools_generate_runs_a_latent_attention_checkpoint(tmp_path, capsys):
    """tools/generate.py (the model whole, TP 1) loads a saved MLA + YaRN model and decodes with
    the latent cache: the uncached loop's tokens."""
    import json
    import os
    import sys

    from megalite.checkpoint import save_weights_checkpoint

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import generate as generate_tool

    model = _model(**VARIANTS["yarn"])
    save_weights_checkpoint(str(tmp_path / "ckpt"), model)
    prompt = [5, 17, 42]
    assert generate_tool.main(["--load", str(tmp_path / "ckpt"), "--prompt-ids", ",".join(map(str, prompt)),
                               "--max-new-tokens", "9", "--greedy", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == _uncached_greedy(model, prompt, 9)


def test_the_benchmark_measures_the_allocated_caches(capsys):
    """tools/bench_generation_cache.py's first table (docs/BENCHMARKS.md): DeepSeek-V3's layer
    caches 1152 bf16 bytes per token, Llama-3-8B's 4096 (3.56x), V3's heads uncompressed 81920."""
    from tools.bench_generation_cache import per_layer

    per_layer(16)
    rows = {line[:34].strip(): line.split()[-3:] for line in capsys.readouterr().out.splitlines() if "layer" in line}
    assert rows["DeepSeek-V3 layer (MLA 512 + 64)"] == ["1,152", "1,152", "3.56"]
    assert rows["Llama-3-8B layer (GQA 8 x 128)"] == ["4,096", "4,096", "1.00"]
    assert rows["V3 layer uncompressed (128 x 320)"][:2] == ["81,920", "81,920"]


def test_the_planner_states_the_generation_cache_from_the_parts_shapes():
    """tools/plan_parallel.py's explanation gives the KV cache bytes per token and per sequence
    from the attention parts' cache shapes: MLA's latent + RoPE key against GQA's keys and values."""
    from megalite.config import ModelConfig
    from megalite.model.counting import cache_bytes_per_token
    from megalite.planner import Hardware
    from megalite.planner.search import explain, plan

    base = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=64, vocab_size=512, swiglu=True,
                normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False)
    gqa = ModelConfig(**base, num_query_groups=2)
    mla = ModelConfig(**base, multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=32,
                      qk_pos_emb_head_dim=16, v_head_dim=32)
    for m, per_layer in ((gqa, 2 * 2 * 32), (mla, 32 + 16)):  # elements per token per layer
        assert cache_bytes_per_token(m, 2) == 2 * 4 * per_layer
        text = "\n".join(explain(plan(m, Hardware(24, 8, 1), 8, 1)))
        assert f"KV cache holds {2 * 4 * per_layer:,} bytes per token over the 4 layers" in text, text
