"""Hugging Face Llama (2, 3, 3.1/3.2), Qwen2, Qwen3, Qwen3-MoE and Mixtral <-> megalite: settings and
weight names.

Settings come from ``config.json``, in the older form (``rope_theta``, ``rope_scaling``) or
the one ``transformers`` 5 writes (``rope_parameters`` holding both). What megalite cannot
express is refused with the field named, never approximated: another rope scaling than
``llama3``, sliding-window attention, a ``head_dim`` other than hidden/heads (except Qwen3's,
which is ``--kv-channels``), MLP or output biases, an activation other than SiLU.

Weights. HF keeps q, k and v in three matrices (heads * d, groups * d and groups * d rows);
megalite fuses them into ``attn.qkv.weight`` with the rows of each key/value group together,
``[q heads of group g | k_g | v_g]`` for g = 0..G-1, so a TP split hands each rank whole
groups. The rows inside a head are in the same order in both: HF's Llama/Qwen2 weights are
already arranged for the rotate-half rotation megalite uses, so no permutation is needed
(the logits tests prove it). SwiGLU: megalite's ``fc1`` is ``[gate; up]``, HF's are
``gate_proj`` and ``up_proj``. Matrices keep their (out, in) orientation.

Mixtral is this Llama with every MLP a mixture of experts, whose router megalite's matches
(fp32 softmax over the experts, top-k, weights renormalized over the k; dropless). The hub's
files (and what ``save_pretrained`` writes) name each expert ``block_sparse_moe.experts.E.w1``
(gate), ``w3`` (up), ``w2`` (down) and the router ``block_sparse_moe.gate``; transformers 5
holds them in memory stacked, ``mlp.experts.gate_up_proj`` (E, 2F, h: [gate; up]) and
``down_proj`` (E, h, F) with ``mlp.gate``, and both are read. megalite's checkpoint has one
tensor per expert, ``layers.N.mlp.experts.E.fc1.weight`` = [w1; w3] and ``fc2.weight`` = w2,
and the router ``layers.N.mlp.router.weight``. Export writes the hub's names.

Qwen3 is this Llama with QK-norm (``self_attn.q_norm`` / ``k_norm``, megalite's ``attn.q_norm`` /
``attn.k_norm``: ``--qk-layernorm``) and its own head size (``head_dim``: ``--kv-channels``).
Qwen3-MoE adds experts with Mixtral's router when ``norm_topk_prob`` is true (top-k >= 2; with
top-1 it must be false, as megalite's top-1 keeps its probability), no shared expert, and its
dense layers (``mlp_only_layers``, ``decoder_sparse_step``: layer i is MoE unless listed and when
(i + 1) % step == 0) as a ``--moe-layer-freq`` 0/1 list; the dense ones have FFN
``intermediate_size``, the experts ``moe_intermediate_size``. Its experts are named
``mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj`` and the router ``mlp.gate`` on the hub
(transformers 5 in memory: ``mlp.experts.gate_up_proj`` / ``down_proj`` stacked; both are read).
A megalite model exports as Qwen3 (Qwen3-MoE with experts) when it has QK-norm. A model with
multi-token prediction (``--mtp-num-layers``) is refused: these architectures have no MTP layers
(DeepSeek-V3's do, :mod:`megalite.checkpoint.hf_deepseek_mtp`).
"""
from __future__ import annotations

import torch

from megalite.checkpoint.format import CheckpointError
from megalite.config import ModelConfig
from megalite.moe.settings import moe_layers

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
QWEN3 = ("qwen3", "qwen3_moe")


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
    if kind in QWEN3 and hf.get("attention_bias"):
        raise UnsupportedModel("config.json attention_bias true: a Qwen3 with q/k/v/o biases; megalite's Qwen3 "
                               "has none (Qwen2's q/k/v-only biases are another model_type).")
    if kind not in QWEN3 and hf.get("head_dim") not in (None, h // heads):
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
    seq_length = seq_length or min(max_positions, 4096)
    moe = _moe_fields(hf, seq_length) if kind == "mixtral" else _qwen3_moe_fields(hf) if kind == "qwen3_moe" else {}
    qwen3 = dict(qk_layernorm=True, kv_channels=hf.get("head_dim") or h // heads) if kind in QWEN3 else {}
    qkv_bias = kind == "qwen2" or bool(hf.get("attention_bias"))
    return ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=seq_length,
        max_position_embeddings=max_positions, position_embedding_type="rope", rotary_base=base,
        rope_scaling=scaling, normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
        add_bias_linear=False, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=0.0, **moe, **qwen3)


def _moe_fields(hf: dict, seq_length: int) -> dict:
    """Mixtral's experts as megalite's MoE settings (every layer, dropless)."""
    window, k = hf.get("sliding_window"), hf.get("num_experts_per_tok", 2)
    if window is not None and window < seq_length:
        raise UnsupportedModel(f"config.json sliding_window {window} is shorter than the sequence length "
                               f"{seq_length}: megalite attends over the whole sequence. Fix: a --seq-length of at "
                               f"most {window}, where the two are the same.")
    if k < 2:
        raise UnsupportedModel("config.json num_experts_per_tok 1: Mixtral then gives the chosen expert weight 1, "
                               "megalite's top-1 router keeps its probability.")
    if hf.get("router_jitter_noise"):
        raise UnsupportedModel(f"config.json router_jitter_noise {hf['router_jitter_noise']}: megalite's router "
                               f"adds no noise. Fix: set it to 0.0 in config.json (it only perturbs training).")
    return dict(num_experts=hf["num_local_experts"], moe_router_topk=k, moe_ffn_hidden_size=hf["intermediate_size"],
                moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0))

def _qwen3_moe_fields(hf: dict) -> dict:
    """Qwen3-MoE's experts and dense layers as megalite's MoE settings (dropless, no shared expert)."""
    # the hub's files say num_experts, transformers 5 writes num_local_experts
    k, E, n = hf.get("num_experts_per_tok", 8), hf.get("num_experts") or hf["num_local_experts"], hf["num_hidden_layers"]
    if hf.get("norm_topk_prob", False) != (k > 1):
        raise UnsupportedModel(f"config.json norm_topk_prob {hf.get('norm_topk_prob', False)} with num_experts_per_tok "
                               f"{k}: megalite's router renormalizes the top-k weights exactly when k > 1 (Mixtral's "
                               f"rule), so it expresses norm_topk_prob {str(k > 1).lower()} here, not this.")
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    pattern = [int(E > 0 and i not in dense and (i + 1) % step == 0) for i in range(n)]
    if not any(pattern):
        raise UnsupportedModel(f"config.json mlp_only_layers / decoder_sparse_step leave no MoE layer among "
                               f"{n}: convert it as a dense Qwen3 (model_type qwen3).")
    return dict(num_experts=E, moe_router_topk=k, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_layer_freq=pattern if not all(pattern) else 1,
                moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0))


def hf_config_from_llama(cfg: ModelConfig, model_type: str, dtype: torch.dtype, special: dict) -> dict:
    """config.json for ``model_type`` (llama or qwen2) in the older form, which transformers 4
    and 5 both read. ``special``: bos/eos token ids to record (may be empty)."""
    if (cfg.position_embedding_type, cfg.normalization, cfg.swiglu, cfg.add_bias_linear) != ("rope", "RMSNorm", True, False):
        raise UnsupportedModel("only the Llama architecture (rope, RMSNorm, SwiGLU, no linear biases) exports to "
                               "Hugging Face Llama/Qwen2")
    if cfg.multi_latent_attention or cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "yarn":
        raise UnsupportedModel("a model with Multi-head Latent Attention or YaRN RoPE is DeepSeek-V3-shaped: "
                               "Llama, Qwen2/3 and Mixtral cannot hold it. Fix: export it as "
                               "DeepseekV3ForCausalLM (--model-type deepseek_v3, the default for an MLA model)")
    if cfg.mtp_num_layers:
        raise UnsupportedModel(f"a model with multi-token prediction (--mtp-num-layers {cfg.mtp_num_layers}): "
                               f"Llama, Qwen2/3 and Mixtral have no place for its MTP depths, which the export "
                               f"would drop. Fix: only DeepseekV3ForCausalLM holds them (a model with "
                               f"--multi-latent-attention and DeepSeek-V3's routing); else train without "
                               f"--mtp-num-layers")
    if cfg.qk_layernorm:
        _check_qwen3(cfg)
        model_type = "qwen3_moe" if cfg.num_experts else "qwen3"
    elif cfg.num_experts:
        _check_mixtral(cfg)
        model_type = "mixtral"
    elif model_type == "llama" and cfg.add_qkv_bias:
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
    elif model_type == "mixtral":
        out.update(intermediate_size=cfg.moe_ffn_hidden_size, num_local_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.moe_router_topk, router_aux_loss_coef=cfg.moe_aux_loss_coeff,
                   output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    elif model_type == "qwen3_moe":
        out.update(moe_intermediate_size=cfg.moe_ffn_hidden_size, num_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.moe_router_topk, norm_topk_prob=cfg.moe_router_topk > 1,
                   decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(moe_layers(cfg)) if not moe],
                   router_aux_loss_coef=cfg.moe_aux_loss_coeff, output_router_logits=False,
                   attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
        if model_type == "qwen3":
            out.update(attention_bias=False, max_window_layers=cfg.num_layers)
    return {**out, **special}


def _softmax_routing(cfg: ModelConfig) -> tuple[tuple[bool, str], ...]:
    """What Mixtral's and Qwen3-MoE's router can express: softmax scores over all experts, no
    expert groups, no scaling of the top-k weights, no expert bias (DeepSeek-V3's routing)."""
    return ((cfg.moe_router_score_function == "softmax", "softmax router scores"),
            (cfg.moe_router_num_groups is None, "no expert groups"),
            (cfg.moe_router_topk_scaling_factor in (None, 1.0), "no top-k scaling factor"),
            (not cfg.moe_router_enable_expert_bias, "no expert bias"))


def _check_qwen3(cfg: ModelConfig) -> None:
    routing = _softmax_routing(cfg) if cfg.num_experts else ()
    why = [w for ok, w in ((cfg.normalization == "RMSNorm", "RMSNorm q/k norms (--normalization RMSNorm)"),
                           (not cfg.add_qkv_bias, "no q/k/v biases"),
                           (not cfg.moe_shared_expert_intermediate_size, "no shared expert"),
                           (cfg.moe_expert_capacity_factor is None, "dropless routing (no capacity factor)"),
                           *routing)
           if not ok]
    if why:
        raise UnsupportedModel(f"a model with QK-norm exports as Qwen3 / Qwen3-MoE, which needs {', '.join(why)}; "
                               f"this checkpoint's model does not have that.")


def _check_mixtral(cfg: ModelConfig) -> None:
    why = [w for ok, w in ((all(moe_layers(cfg)), "every layer an MoE layer (--moe-layer-freq 1)"),
                           (not cfg.moe_shared_expert_intermediate_size, "no shared expert"),
                           (cfg.moe_expert_capacity_factor is None, "dropless routing (no capacity factor)"),
                           (cfg.moe_router_topk >= 2, "top-k of at least 2"),
                           (not cfg.add_qkv_bias, "no q/k/v biases"), *_softmax_routing(cfg)) if not ok]
    if why:
        raise UnsupportedModel(f"a mixture-of-experts model exports as Mixtral, which needs {', '.join(why)}; "
                               f"this checkpoint's model does not have that.")


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


QK_NORM_NAMES = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}


def _is_moe(cfg: ModelConfig, i: int) -> bool:
    return bool(cfg.num_experts) and moe_layers(cfg)[i]


def _layer_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """LAYER_NAMES (and Qwen3's q/k norms), without the dense MLP's down projection in an MoE layer."""
    names = {**LAYER_NAMES, **(QK_NORM_NAMES if cfg.qk_layernorm else {})}
    return {k: v for k, v in names.items() if not (_is_moe(cfg, i) and k == "mlp.fc2.weight")}


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
    out = {q + ours: get(p + theirs) for ours, theirs in _layer_names(cfg, i).items()}
    out[q + "attn.qkv.weight"] = _fuse_qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"),
                                           get(a + "v_proj.weight"), cfg.num_query_groups)
    if _is_moe(cfg, i):
        out.update((_import_qwen3_experts if cfg.qk_layernorm else _import_experts)(get, p, q, cfg))
    else:
        out[q + "mlp.fc1.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
    if cfg.add_qkv_bias:
        out[q + "attn.qkv.bias"] = _fuse_qkv(get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"),
                                             cfg.num_query_groups)
    return out


def _import_experts(get, p: str, q: str, cfg: ModelConfig) -> dict:
    """Mixtral's router and experts of HF layer prefix ``p`` under megalite's names (prefix ``q``)."""
    try:  # the hub's names, one tensor per expert and projection
        out = {q + "mlp.router.weight": get(p + "block_sparse_moe.gate.weight")}
        for e in range(cfg.num_experts):
            x = f"{p}block_sparse_moe.experts.{e}."
            out[f"{q}mlp.experts.{e}.fc1.weight"] = torch.cat([get(x + "w1.weight"), get(x + "w3.weight")])
            out[f"{q}mlp.experts.{e}.fc2.weight"] = get(x + "w2.weight")
        return out
    except CheckpointError:  # transformers 5's stacked names
        gate_up, down = get(p + "mlp.experts.gate_up_proj"), get(p + "mlp.experts.down_proj")
        out = {q + "mlp.router.weight": get(p + "mlp.gate.weight")}
        for e in range(cfg.num_experts):
            out[f"{q}mlp.experts.{e}.fc1.weight"], out[f"{q}mlp.experts.{e}.fc2.weight"] = gate_up[e], down[e]
        return out


def _import_qwen3_experts(get, p: str, q: str, cfg: ModelConfig) -> dict:
    """Qwen3-MoE's router and experts of HF layer prefix ``p`` under megalite's names (prefix ``q``)."""
    return {q + "mlp.router.weight": get(p + "mlp.gate.weight"), **import_gate_up_experts(get, p + "mlp.", q, cfg)}


def import_gate_up_experts(get, m: str, q: str, cfg: ModelConfig) -> dict:
    """The experts under HF MLP prefix ``m`` (``gate_proj`` / ``up_proj`` / ``down_proj`` per expert,
    Qwen3-MoE's and DeepSeek-V3's names) as megalite's ``fc1`` = [gate; up] and ``fc2`` (prefix ``q``)."""
    out = {}
    try:  # the hub's names, one tensor per expert and projection
        for e in range(cfg.num_experts):
            x = f"{m}experts.{e}."
            out[f"{q}mlp.experts.{e}.fc1.weight"] = torch.cat([get(x + "gate_proj.weight"), get(x + "up_proj.weight")])
            out[f"{q}mlp.experts.{e}.fc2.weight"] = get(x + "down_proj.weight")
    except CheckpointError:  # transformers 5's stacked names
        gate_up, down = get(m + "experts.gate_up_proj"), get(m + "experts.down_proj")
        for e in range(cfg.num_experts):
            out[f"{q}mlp.experts.{e}.fc1.weight"], out[f"{q}mlp.experts.{e}.fc2.weight"] = gate_up[e], down[e]
    return out


def export_gate_up_experts(get, m: str, q: str, cfg: ModelConfig) -> dict:
    """megalite's experts (prefix ``q``) under the hub's per-expert names of HF MLP prefix ``m``
    (the converse of :func:`import_gate_up_experts`)."""
    out = {}
    for e in range(cfg.num_experts):
        gate, up = get(f"{q}mlp.experts.{e}.fc1.weight").chunk(2)
        out.update({f"{m}experts.{e}.gate_proj.weight": gate, f"{m}experts.{e}.up_proj.weight": up,
                    f"{m}experts.{e}.down_proj.weight": get(f"{q}mlp.experts.{e}.fc2.weight")})
    return out


def export_globals(get, cfg: ModelConfig) -> dict:
    return {theirs: get(ours) for ours, theirs in global_names(cfg).items()}


def export_layer(get, i: int, cfg: ModelConfig) -> dict:
    p, q = f"model.layers.{i}.", f"layers.{i}."
    a = p + "self_attn."
    out = {p + theirs: get(q + ours) for ours, theirs in _layer_names(cfg, i).items()}
    out.update(zip((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                   _split_qkv(get(q + "attn.qkv.weight"), cfg)))
    if _is_moe(cfg, i) and cfg.qk_layernorm:  # Qwen3-MoE: the hub's per-expert names
        out[p + "mlp.gate.weight"] = get(q + "mlp.router.weight")
        out.update(export_gate_up_experts(get, p + "mlp.", q, cfg))
    elif _is_moe(cfg, i):
        m = p + "block_sparse_moe."
        out[m + "gate.weight"] = get(q + "mlp.router.weight")
        for e in range(cfg.num_experts):
            w1, w3 = get(f"{q}mlp.experts.{e}.fc1.weight").chunk(2)
            out.update({f"{m}experts.{e}.w1.weight": w1, f"{m}experts.{e}.w3.weight": w3,
                        f"{m}experts.{e}.w2.weight": get(f"{q}mlp.experts.{e}.fc2.weight")})
    else:
        out.update(zip((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), get(q + "mlp.fc1.weight").chunk(2)))
    if cfg.add_qkv_bias:
        out.update(zip((a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                       _split_qkv(get(q + "attn.qkv.bias"), cfg)))
    return out
