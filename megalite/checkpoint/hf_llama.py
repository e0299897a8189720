"""Hugging Face Llama (2, 3, 3.1/3.2) and Qwen2 <-> megalite: settings and weight names.

Settings come from ``config.json``, in the older form (``rope_theta``, ``rope_scaling``) or
the one ``transformers`` 5 writes (``rope_parameters`` holding both). What megalite cannot
express is refused with the field named, never approximated: another rope scaling than
``llama3``, sliding-window attention, a ``head_dim`` other than hidden/heads, MLP or output
biases, an activation other than SiLU.

Weights. HF keeps q, k and v in three matrices (heads * d, groups * d and groups * d rows);
megalite fuses them into ``attn.qkv.weight`` with the rows of each key/value group together,
``[q heads of group g | k_g | v_g]`` for g = 0..G-1, so a TP split hands each rank whole
groups. The rows inside a head are in the same order in both: HF's Llama/Qwen2 weights are
already arranged for the rotate-half rotation megalite uses, so no permutation is needed
(the logits tests prove it). SwiGLU: megalite's ``fc1`` is ``[gate; up]``, HF's are
``gate_proj`` and ``up_proj``. Matrices keep their (out, in) orientation.
"""
from __future__ import annotations

import torch

from megalite.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class UnsupportedModel(ValueError):
    """A Hugging Face config megalite cannot express; the message names the field."""


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(base, scaling) from either config form."""
    params = hf.get("rope_parameters") or {}
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return float(base), None
        if kind != "llama3":
            raise UnsupportedModel(f"config.json rope scaling type {kind!r} is not supported (megalite implements "
                                   f"'llama3'); converting would silently change the positions.")
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {"rope_type": "llama3", **{k: scaling[k] for k in keys}}
    return float(base), scaling


def model_config_from_hf_llama(hf: dict, seq_length: int | None = None) -> ModelConfig:
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise UnsupportedModel(f"config.json model_type {kind!r}: megalite converts {', '.join(ARCHITECTURES)} "
                               f"and gpt2.")
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, h // heads):
        raise UnsupportedModel(f"config.json head_dim {hf['head_dim']} differs from hidden_size/num_attention_heads "
                               f"= {h // heads}; megalite's heads are hidden/heads wide.")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"config.json hidden_act {hf['hidden_act']!r}: megalite's SwiGLU uses silu.")
    if hf.get("mlp_bias"):
        raise UnsupportedModel("config.json mlp_bias true: megalite's Llama MLP has no bias.")
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") and window:
        raise UnsupportedModel(f"config.json use_sliding_window with sliding_window {window}: megalite attends "
                               f"over the whole sequence (no sliding-window attention).")
    base, scaling = _rope(hf)
    max_positions = hf.get("max_position_embeddings", 4096)
    qkv_bias = kind == "qwen2" or bool(hf.get("attention_bias"))
    return ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=seq_length or min(max_positions, 4096),
        max_position_embeddings=max_positions, position_embedding_type="rope", rotary_base=base,
        rope_scaling=scaling, normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
        add_bias_linear=False, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=0.0)


def hf_config_from_llama(cfg: ModelConfig, model_type: str, dtype: torch.dtype, special: dict) -> dict:
    """config.json for ``model_type`` (llama or qwen2) in the older form, which transformers 4
    and 5 both read. ``special``: bos/eos token ids to record (may be empty)."""
    if (cfg.position_embedding_type, cfg.normalization, cfg.swiglu, cfg.add_bias_linear) != ("rope", "RMSNorm", True, False):
        raise UnsupportedModel("only the Llama architecture (rope, RMSNorm, SwiGLU, no linear biases) exports to "
                               "Hugging Face Llama/Qwen2")
    if model_type == "llama" and cfg.add_qkv_bias:
        model_type = "qwen2"  # Llama with q/k/v biases is what Qwen2 is
    out = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
           "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
           "rope_theta": cfg.rotary_base, "rope_scaling": cfg.rope_scaling, "vocab_size": cfg.vocab_size,
           "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
           "torch_dtype": str(dtype).removeprefix("torch."), "attention_dropout": 0.0}
    if model_type == "llama":
        out.update(attention_bias=cfg.add_qkv_bias, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return {**out, **special}


# -- weights, one unit (embeddings+head, or one layer) at a time ----------------------------------

def _fuse_qkv(q, k, v, groups: int) -> torch.Tensor:
    """Rows [q (heads*d) | k (G*d) | v (G*d)] -> per group [q_g (heads/G*d) | k_g | v_g]."""
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k, v = k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv, cfg: ModelConfig):
    groups, d = cfg.num_query_groups, cfg.head_dim
    per = (cfg.num_attention_heads // groups) * d
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, per + 2 * d, *rest)
    return (g[:, :per].reshape(-1, *rest), g[:, per: per + d].reshape(-1, *rest), g[:, per + d:].reshape(-1, *rest))


# Tensors that only change name (megalite <- HF); the fused ones are handled beside them.
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
               "attn.proj.weight": "self_attn.o_proj.weight", "mlp.fc2.weight": "mlp.down_proj.weight"}


def global_names(cfg: ModelConfig) -> dict[str, str]:
    """megalite name -> HF name of the tensors outside the layers."""
    names = {"word_embeddings.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if cfg.untie_embeddings_and_output_weights:
        names["output_layer.weight"] = "lm_head.weight"
    return names


def import_globals(get, cfg: ModelConfig) -> dict:
    return {ours: get(theirs) for ours, theirs in global_names(cfg).items()}


def import_layer(get, i: int, cfg: ModelConfig) -> dict:
    p, q = f"model.layers.{i}.", f"layers.{i}."
    a = p + "self_attn."
    out = {q + ours: get(p + theirs) for ours, theirs in LAYER_NAMES.items()}
    out[q + "attn.qkv.weight"] = _fuse_qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"),
                                           get(a + "v_proj.weight"), cfg.num_query_groups)
    out[q + "mlp.fc1.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
    if cfg.add_qkv_bias:
        out[q + "attn.qkv.bias"] = _fuse_qkv(get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"),
                                             cfg.num_query_groups)
    return out


def export_globals(get, cfg: ModelConfig) -> dict:
    return {theirs: get(ours) for ours, theirs in global_names(cfg).items()}


def export_layer(get, i: int, cfg: ModelConfig) -> dict:
    p, q = f"model.layers.{i}.", f"layers.{i}."
    a = p + "self_attn."
    out = {p + theirs: get(q + ours) for ours, theirs in LAYER_NAMES.items()}
    out.update(zip((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                   _split_qkv(get(q + "attn.qkv.weight"), cfg)))
    out.update(zip((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), get(q + "mlp.fc1.weight").chunk(2)))
    if cfg.add_qkv_bias:
        out.update(zip((a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                       _split_qkv(get(q + "attn.qkv.bias"), cfg)))
    return out
