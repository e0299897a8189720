"""Hugging Face GPT-2 <-> megalite weight mapping (no transformers import needed), one unit
(embeddings and final norm, or one layer) at a time; ``get(name)`` reads one tensor.

HF GPT-2 uses Conv1D layers, ``y = x W + b`` with W of shape (in, out); megalite uses
``y = x W^T + b`` with W of shape (out, in), so every matrix is transposed. The fused
attention projection differs in row order too: HF's columns are [q (all heads) | k | v];
megalite's rows are grouped per key/value group, [q_g, k_g, v_g] for each head g (GPT-2 has
one query head per group), so a TP split gives each rank whole heads.
"""
from __future__ import annotations

import torch

from megalite.config import ModelConfig


def model_config_from_hf(hf: dict) -> ModelConfig:
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"only GPT-2 checkpoints can be imported, got model_type {hf.get('model_type')!r}")
    h = hf["n_embd"]
    return ModelConfig(num_layers=hf["n_layer"], hidden_size=h, num_attention_heads=hf["n_head"],
                       ffn_hidden_size=hf.get("n_inner") or 4 * h, vocab_size=hf["vocab_size"],
                       seq_length=hf["n_positions"], max_position_embeddings=hf["n_positions"],
                       norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), hidden_dropout=0.0, attention_dropout=0.0)


def hf_config_from(cfg: ModelConfig) -> dict:
    if cfg.mtp_num_layers:
        raise ValueError(f"a model with multi-token prediction (--mtp-num-layers {cfg.mtp_num_layers}): "
                         f"GPT2LMHeadModel has no place for its MTP depths, which the export would drop. Fix: only "
                         f"DeepseekV3ForCausalLM holds them; else train without --mtp-num-layers")
    if (cfg.position_embedding_type, cfg.normalization, cfg.swiglu, cfg.num_query_groups,
            cfg.untie_embeddings_and_output_weights, cfg.add_bias_linear, cfg.qk_layernorm,
            cfg.head_dim * cfg.num_attention_heads) != \
            ("learned_absolute", "LayerNorm", False, cfg.num_attention_heads, False, True, False, cfg.hidden_size):
        raise ValueError("only the GPT-2 architecture (learned positions, LayerNorm, GELU, tied "
                         "embeddings, biases, multi-head attention of hidden/heads heads, no QK-norm) exports to "
                         "Hugging Face GPT-2")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
            "n_positions": cfg.max_position_embeddings, "n_ctx": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, "layer_norm_epsilon": cfg.norm_epsilon,
            "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": True, "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1}


def _qkv_hf_to_megalite(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(3h, ...) rows [q | k | v] -> rows [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_megalite_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def import_globals(get, cfg: ModelConfig) -> dict:
    return {"word_embeddings.weight": get("transformer.wte.weight"), "position_embeddings.weight": get("transformer.wpe.weight"),
            "final_norm.weight": get("transformer.ln_f.weight"), "final_norm.bias": get("transformer.ln_f.bias")}


def import_layer(get, i: int, cfg: ModelConfig) -> dict:
    p, q, heads = f"transformer.h.{i}.", f"layers.{i}.", cfg.num_attention_heads
    return {q + "attn_norm.weight": get(p + "ln_1.weight"), q + "attn_norm.bias": get(p + "ln_1.bias"),
            q + "mlp_norm.weight": get(p + "ln_2.weight"), q + "mlp_norm.bias": get(p + "ln_2.bias"),
            q + "attn.qkv.weight": _qkv_hf_to_megalite(get(p + "attn.c_attn.weight").t(), heads),
            q + "attn.qkv.bias": _qkv_hf_to_megalite(get(p + "attn.c_attn.bias"), heads),
            q + "attn.proj.weight": get(p + "attn.c_proj.weight").t(), q + "attn.proj.bias": get(p + "attn.c_proj.bias"),
            q + "mlp.fc1.weight": get(p + "mlp.c_fc.weight").t(), q + "mlp.fc1.bias": get(p + "mlp.c_fc.bias"),
            q + "mlp.fc2.weight": get(p + "mlp.c_proj.weight").t(), q + "mlp.fc2.bias": get(p + "mlp.c_proj.bias")}


def export_globals(get, cfg: ModelConfig) -> dict:
    return {"transformer.wte.weight": get("word_embeddings.weight"), "transformer.wpe.weight": get("position_embeddings.weight"),
            "transformer.ln_f.weight": get("final_norm.weight"), "transformer.ln_f.bias": get("final_norm.bias")}


def export_layer(get, i: int, cfg: ModelConfig) -> dict:
    p, q, heads = f"transformer.h.{i}.", f"layers.{i}.", cfg.num_attention_heads
    return {p + "ln_1.weight": get(q + "attn_norm.weight"), p + "ln_1.bias": get(q + "attn_norm.bias"),
            p + "ln_2.weight": get(q + "mlp_norm.weight"), p + "ln_2.bias": get(q + "mlp_norm.bias"),
            p + "attn.c_attn.weight": _qkv_megalite_to_hf(get(q + "attn.qkv.weight"), heads).t(),
            p + "attn.c_attn.bias": _qkv_megalite_to_hf(get(q + "attn.qkv.bias"), heads),
            p + "attn.c_proj.weight": get(q + "attn.proj.weight").t(), p + "attn.c_proj.bias": get(q + "attn.proj.bias"),
            p + "mlp.c_fc.weight": get(q + "mlp.fc1.weight").t(), p + "mlp.c_fc.bias": get(q + "mlp.fc1.bias"),
            p + "mlp.c_proj.weight": get(q + "mlp.fc2.weight").t(), p + "mlp.c_proj.bias": get(q + "mlp.fc2.bias")}
