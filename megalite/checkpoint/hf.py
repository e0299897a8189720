"""Hugging Face GPT-2 <-> megalite weight mapping (no transformers import needed).

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
    if (cfg.position_embedding_type, cfg.normalization, cfg.swiglu, cfg.num_query_groups,
            cfg.untie_embeddings_and_output_weights, cfg.add_bias_linear) != \
            ("learned_absolute", "LayerNorm", False, cfg.num_attention_heads, False, True):
        raise ValueError("only the GPT-2 architecture (learned positions, LayerNorm, GELU, tied "
                         "embeddings, biases, multi-head attention) exports to Hugging Face GPT-2")
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


def megalite_state_from_hf(hf_state: dict, cfg: ModelConfig) -> dict:
    s = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in hf_state.items()}
    out = {"word_embeddings.weight": s["wte.weight"], "position_embeddings.weight": s["wpe.weight"],
           "final_norm.weight": s["ln_f.weight"], "final_norm.bias": s["ln_f.bias"]}
    heads = cfg.num_attention_heads
    for i in range(cfg.num_layers):
        p, q = f"h.{i}.", f"layers.{i}."
        out[q + "attn_norm.weight"], out[q + "attn_norm.bias"] = s[p + "ln_1.weight"], s[p + "ln_1.bias"]
        out[q + "mlp_norm.weight"], out[q + "mlp_norm.bias"] = s[p + "ln_2.weight"], s[p + "ln_2.bias"]
        out[q + "attn.qkv.weight"] = _qkv_hf_to_megalite(s[p + "attn.c_attn.weight"].t(), heads)
        out[q + "attn.qkv.bias"] = _qkv_hf_to_megalite(s[p + "attn.c_attn.bias"], heads)
        out[q + "attn.proj.weight"], out[q + "attn.proj.bias"] = s[p + "attn.c_proj.weight"].t(), s[p + "attn.c_proj.bias"]
        out[q + "mlp.fc1.weight"], out[q + "mlp.fc1.bias"] = s[p + "mlp.c_fc.weight"].t(), s[p + "mlp.c_fc.bias"]
        out[q + "mlp.fc2.weight"], out[q + "mlp.fc2.bias"] = s[p + "mlp.c_proj.weight"].t(), s[p + "mlp.c_proj.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_state_from_megalite(state: dict, cfg: ModelConfig) -> dict:
    heads = cfg.num_attention_heads
    out = {"transformer.wte.weight": state["word_embeddings.weight"][: cfg.vocab_size],
           "transformer.wpe.weight": state["position_embeddings.weight"],
           "transformer.ln_f.weight": state["final_norm.weight"], "transformer.ln_f.bias": state["final_norm.bias"]}
    for i in range(cfg.num_layers):
        p, q = f"transformer.h.{i}.", f"layers.{i}."
        out[p + "ln_1.weight"], out[p + "ln_1.bias"] = state[q + "attn_norm.weight"], state[q + "attn_norm.bias"]
        out[p + "ln_2.weight"], out[p + "ln_2.bias"] = state[q + "mlp_norm.weight"], state[q + "mlp_norm.bias"]
        out[p + "attn.c_attn.weight"] = _qkv_megalite_to_hf(state[q + "attn.qkv.weight"], heads).t()
        out[p + "attn.c_attn.bias"] = _qkv_megalite_to_hf(state[q + "attn.qkv.bias"], heads)
        out[p + "attn.c_proj.weight"], out[p + "attn.c_proj.bias"] = state[q + "attn.proj.weight"].t(), state[q + "attn.proj.bias"]
        out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = state[q + "mlp.fc1.weight"].t(), state[q + "mlp.fc1.bias"]
        out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = state[q + "mlp.fc2.weight"].t(), state[q + "mlp.fc2.bias"]
    return {k: v.detach().float().contiguous() for k, v in out.items()}
