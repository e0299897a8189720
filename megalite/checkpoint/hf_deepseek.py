"""Hugging Face ``DeepseekV3ForCausalLM`` <-> megalite: settings and weight names.

Settings (``config.json`` -> megalite's flags). Attention is Multi-head Latent Attention
(:mod:`megalite.model.mla`): ``q_lora_rank`` (None: one query matrix) -> ``--q-lora-rank``,
``kv_lora_rank``, ``qk_nope_head_dim`` -> ``--qk-head-dim``, ``qk_rope_head_dim`` ->
``--qk-pos-emb-head-dim``, ``v_head_dim``. The first ``first_k_dense_replace`` layers are dense
(FFN ``intermediate_size``), the rest MoE: a ``--moe-layer-freq`` 0/1 list. Each MoE layer has
``n_routed_experts`` experts of ``moe_intermediate_size``, top ``num_experts_per_tok``, and a
shared expert of ``n_shared_experts * moe_intermediate_size``; the router is DeepSeek-V3's
(sigmoid scores, ``n_group`` / ``topk_group`` group-limited top-k, ``norm_topk_prob``,
``routed_scaling_factor``, the selection bias ``e_score_correction_bias`` as megalite's expert
bias, so the import turns ``--moe-router-enable-expert-bias`` on). RoPE: ``rope_theta`` and
``default`` or ``yarn`` scaling (:mod:`megalite.layers.rotary`; HF's keys are megalite's).
What megalite cannot express is refused with the key and value named (:func:`model_config_from_hf`).

YaRN's temperature. HF multiplies cos/sin by ``attention_factor`` when given, else by
mscale(s, mscale) / mscale(s, mscale_all_dim) when both are non-zero, else by mscale(s, 1); the
softmax scale is d_qk^-1/2 times mscale(s, mscale_all_dim)^2 when mscale_all_dim is non-zero.
megalite's cos/sin factor is always mscale(s, mscale) / mscale(s, mscale_all_dim) and its
softmax scale the same as HF's, so the import keeps mscale_all_dim and sets mscale to give HF's
cos/sin factor (mscale 1 when mscale_all_dim is 0; else solved from mscale(s, mscale) = factor x
mscale(s, mscale_all_dim), exact to rounding), and on the way out a factor HF would infer
differently is written as ``attention_factor``.

Weights. megalite's MLA rows are HF's: ``q_b_proj`` (or ``q_proj``) per head [nope; rope],
``kv_a_proj_with_mqa`` [latent; rope key], ``kv_b_proj`` per head [k_nope; v]. One difference:
with ``rope_interleave`` (true in DeepSeek-V3's checkpoints) a head's RoPE rows are
interleaved pairs (x0, x1), (x2, x3), ... each turned by one frequency, while megalite's RoPE
turns the halves (x_i, x_{i + d/2}). Taking the even rows first, then the odd ones
(:func:`halves_from_pairs`) turns the same pairs by the same frequencies, and the attention
scores, which only see q_rope . k_rope, are unchanged; the export puts the rows back
(:func:`pairs_from_halves`). The rows are permuted in ``q_b_proj``/``q_proj`` (each head's last
qk_rope_head_dim rows) and ``kv_a_proj_with_mqa`` (its last qk_rope_head_dim rows).
Experts come under the hub's names (``mlp.experts.E.gate_proj/up_proj/down_proj``, what
``save_pretrained`` writes) or transformers 5's stacked ones (``mlp.experts.gate_up_proj``,
``down_proj``); the export writes the hub's.

Multi-token prediction: the files' ``num_nextn_predict_layers`` extra layers are megalite's
``--mtp-num-layers`` depths; their number is settled here (:func:`mtp_layers_in`), their weights in
:mod:`megalite.checkpoint.hf_deepseek_mtp`.
"""
from __future__ import annotations

import math

import torch

from megalite.checkpoint.expert_bias import SUFFIX as BIAS_SUFFIX
from megalite.checkpoint.hf_llama import (UnsupportedModel, export_gate_up_experts, global_names,
                                          import_gate_up_experts)
from megalite.config import ModelConfig
from megalite.config_types import mtp_depths
from megalite.layers.rotary import rotary_amplitude, scaling_kind, yarn_mscale
from megalite.moe.settings import check_routing, moe_layers

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm (not rms_norm_eps)
KEEP_FP32 = ("e_score_correction_bias",)  # the selection bias's small steps would round away in bf16


# -- settings ---------------------------------------------------------------------------------------

def _refuse(key: str, value, why: str) -> UnsupportedModel:
    return UnsupportedModel(f"config.json {key} {value!r}: {why}")


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(base, megalite rope_scaling) from either config form (``rope_theta`` + ``rope_scaling``, or
    transformers 5's ``rope_parameters``); see the module docstring for YaRN's temperature."""
    params = hf.get("rope_parameters") or {}
    base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or params
    kind = scaling_kind(scaling) or "default"
    if kind == "default":
        return base, None
    if kind != "yarn":
        raise _refuse("rope scaling type", kind, "megalite converts DeepSeek-V3 with no scaling or 'yarn'.")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", scaling["partial_rotary_factor"],
                      "megalite's RoPE turns the whole qk_rope_head_dim part.")
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    mscale, all_dim = scaling.get("mscale"), float(scaling.get("mscale_all_dim") or 0.0)
    given = scaling.get("attention_factor")
    if given is not None or not (mscale and all_dim):  # HF's cos/sin factor is not the mscale ratio
        amplitude = given if given is not None else yarn_mscale(factor)
        if factor <= 1 and amplitude != 1:
            raise _refuse("rope_scaling attention_factor", given, f"with factor {factor} megalite's cos/sin factor "
                          f"is 1 (YaRN's temperature needs factor > 1).")
        if given is None and not all_dim or factor <= 1:
            mscale = 1.0  # mscale(s, 1) / mscale(s, 0): the same factor, exactly
        else:  # mscale(s, m) = amplitude * mscale(s, mscale_all_dim), solved for m
            mscale = (amplitude * yarn_mscale(factor, all_dim) - 1) / (0.1 * math.log(factor))
        if mscale < 0:
            raise _refuse("rope_scaling attention_factor", amplitude, f"below 1 / mscale(s, mscale_all_dim "
                          f"{all_dim}): megalite's --mscale would have to be negative ({mscale:.3g}).")
    out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
           "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1),
           "mscale": float(mscale), "mscale_all_dim": all_dim, "truncate": bool(scaling.get("truncate", True))}
    return base, out


def _routing(hf: dict) -> dict:
    """The MoE settings (module docstring), or a refusal naming the key."""
    n, E, k = hf["num_hidden_layers"], hf.get("n_routed_experts") or 0, hf.get("num_experts_per_tok") or 0
    dense = hf.get("first_k_dense_replace") or 0
    if E < 1 or k < 1 or dense >= n:
        raise _refuse("first_k_dense_replace / n_routed_experts", (dense, E), f"no MoE layer among the {n}; "
                      f"megalite converts DeepSeek-V3 with its mixture-of-experts layers.")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, want) != want:
            raise _refuse(key, hf[key], f"megalite converts DeepSeek-V3's {key} {want!r} (transformers' "
                          f"DeepseekV3 assumes it too).")
    norm = hf.get("norm_topk_prob", True)
    if bool(norm) != (k > 1):
        raise _refuse("norm_topk_prob", norm, f"with num_experts_per_tok {k}: megalite's router renormalizes the "
                      f"top-k weights exactly when k > 1, so it expresses norm_topk_prob {str(k > 1).lower()}.")
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    grouped = dict(moe_router_num_groups=groups, moe_router_group_topk=group_topk) if groups > 1 else {}
    problem = check_routing(E, k, groups if grouped else None, group_topk if grouped else None, "sigmoid")
    if problem:
        raise _refuse("n_group / topk_group", (groups, group_topk), problem)
    shared = hf.get("n_shared_experts") or 0
    scale = float(hf.get("routed_scaling_factor", 1.0))
    pattern = [int(i >= dense) for i in range(n)]
    return dict(num_experts=E, moe_router_topk=k, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_layer_freq=pattern if dense else 1,
                moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"] or None,
                moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
                moe_router_enable_expert_bias=True, **grouped)


def model_config_from_hf(hf: dict, seq_length: int | None = None, tensor_names=None) -> ModelConfig:
    """megalite's model settings of a ``deepseek_v3`` config.json (module docstring).
    ``tensor_names``: the files' tensor names, which say how many MTP layers there are (None:
    config.json's ``num_nextn_predict_layers``)."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("num_key_value_heads") not in (None, heads):
        raise _refuse("num_key_value_heads", hf["num_key_value_heads"], f"MLA gives every one of the {heads} "
                      f"heads its own key and value (num_key_value_heads = num_attention_heads).")
    if hf.get("attention_bias"):
        raise _refuse("attention_bias", True, "megalite's Multi-head Latent Attention has no biases.")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "megalite's SwiGLU uses silu.")
    if hf.get("rms_norm_eps", LATENT_NORM_EPS) != LATENT_NORM_EPS:
        raise _refuse("rms_norm_eps", hf["rms_norm_eps"], f"transformers' DeepseekV3 normalizes the q and kv "
                      f"latents with eps {LATENT_NORM_EPS} whatever rms_norm_eps says, megalite every norm with "
                      f"--norm-epsilon: they agree only at {LATENT_NORM_EPS}.")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise _refuse("quantization_config quant_method", method, "the weights are stored quantized (DeepSeek-V3's "
                      "hub files: fp8 blocks with weight_scale_inv); megalite imports unquantized weights. Fix: "
                      "convert the checkpoint to bf16 first (DeepSeek's fp8_cast_bf16.py) and import that copy.")
    base, scaling = _rope(hf)
    max_positions = hf.get("max_position_embeddings", 4096)
    return ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=heads, num_query_groups=heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        seq_length=seq_length or min(max_positions, 4096), max_position_embeddings=max_positions,
        position_embedding_type="rope", rotary_base=base, rope_scaling=scaling, normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=0.0, multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        mtp_num_layers=mtp_layers_in(hf, tensor_names) or None, **_routing(hf))


def _export_checks(cfg: ModelConfig) -> list[str]:
    """What DeepseekV3ForCausalLM needs that ``cfg`` does not have."""
    pattern = moe_layers(cfg)
    dense = pattern.index(True) if any(pattern) else len(pattern)
    shared, ffn = cfg.moe_shared_expert_intermediate_size, cfg.moe_ffn_hidden_size
    groups = cfg.moe_router_num_groups
    return [w for ok, w in (
        ((cfg.position_embedding_type, cfg.normalization, cfg.swiglu, cfg.add_bias_linear, cfg.add_qkv_bias)
         == ("rope", "RMSNorm", True, False, False), "rope, RMSNorm, SwiGLU and no biases"),
        (not cfg.qk_layernorm, "no QK-norm"),
        (cfg.norm_epsilon == LATENT_NORM_EPS, f"--norm-epsilon {LATENT_NORM_EPS} (transformers' latent norms' eps)"),
        (scaling_kind(cfg.rope_scaling) in (None, "yarn"), "no RoPE scaling or yarn"),
        (bool(cfg.num_experts), "mixture-of-experts layers (--num-experts)"),
        (any(pattern) and all(pattern[dense:]), "dense layers first, then only MoE layers (first_k_dense_replace)"),
        (bool(shared) and ffn and shared % ffn == 0, "a shared expert of a whole number of expert FFN sizes"),
        (cfg.moe_router_score_function == "sigmoid", "sigmoid router scores"),
        (cfg.moe_expert_capacity_factor is None, "dropless routing (no capacity factor)"),
        (not groups or cfg.num_experts // groups >= 2, "at least 2 experts per group (HF scores a group by its "
                                                       "top 2)"))
        if not ok]


def hf_config_from(cfg: ModelConfig, dtype: torch.dtype, special: dict, interleaved: bool = True) -> dict:
    """config.json of ``DeepseekV3ForCausalLM`` for ``cfg`` (older rope form: transformers 4 and 5
    read it), or a refusal listing what the model lacks."""
    if not cfg.multi_latent_attention:
        raise UnsupportedModel("only a model with Multi-head Latent Attention (--multi-latent-attention) exports "
                               "as DeepseekV3ForCausalLM")
    why = _export_checks(cfg)
    if why:
        raise UnsupportedModel(f"a latent-attention model exports as DeepseekV3ForCausalLM, which needs "
                               f"{', '.join(why)}; this checkpoint's model does not have that.")
    dense = moe_layers(cfg).index(True)
    scaling = None
    if cfg.rope_scaling:
        s = cfg.rope_scaling
        scaling = {"type": "yarn", "rope_type": "yarn",
                   **{k: s[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                        "mscale", "mscale_all_dim")}}
        if not s.get("truncate", True):
            scaling["truncate"] = False
        both = s["mscale"] and s["mscale_all_dim"]
        inferred = rotary_amplitude(s) if both else yarn_mscale(s["factor"])
        if inferred != rotary_amplitude(s):  # HF would infer another cos/sin factor: say it
            scaling["attention_factor"] = rotary_amplitude(s)
    k = cfg.moe_router_topk
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "moe_intermediate_size": cfg.moe_ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
            "n_shared_experts": cfg.moe_shared_expert_intermediate_size // cfg.moe_ffn_hidden_size,
            "n_routed_experts": cfg.num_experts, "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
            "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
            "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
            "qk_nope_head_dim": cfg.qk_head_dim, "n_group": cfg.moe_router_num_groups or 1,
            "topk_group": cfg.moe_router_group_topk or 1, "num_experts_per_tok": k, "first_k_dense_replace": dense,
            "norm_topk_prob": k > 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
            "rope_theta": cfg.rotary_base, "rope_scaling": scaling, "rope_interleave": interleaved,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "attention_bias": False,
            "attention_dropout": 0.0, "num_nextn_predict_layers": mtp_depths(cfg),
            "torch_dtype": str(dtype).removeprefix("torch."), **special}


# -- multi-token prediction: how many layers -------------------------------------------------------

def mtp_layers_in(hf: dict, tensor_names=None) -> int:
    """D, the MTP layers the files hold (``model.layers.{n..n+D-1}.*``), or a refusal when
    config.json's ``num_nextn_predict_layers`` names another number of them (none found with the
    key set is allowed: :func:`megalite.checkpoint.hf_deepseek_mtp.absent_mtp_note`).
    ``tensor_names`` None: the key's value."""
    said = hf.get("num_nextn_predict_layers")
    if tensor_names is None:
        return said or 0
    n = hf["num_hidden_layers"]
    found = sorted({int(name.split(".")[2]) for name in tensor_names
                    if name.startswith("model.layers.") and int(name.split(".")[2]) >= n})
    if found and (found != list(range(n, n + len(found))) or said not in (None, len(found))):
        raise _refuse("num_nextn_predict_layers", said, f"the files hold the multi-token-prediction layers "
                      f"model.layers.{{{','.join(map(str, found))}}}.* (past num_hidden_layers {n}): they must be "
                      f"num_nextn_predict_layers consecutive layers from model.layers.{n} on. Fix: set "
                      f"num_nextn_predict_layers to the number of MTP layers the files hold.")
    return len(found)


# -- weights ----------------------------------------------------------------------------------------

def halves_from_pairs(rows: torch.Tensor, d: int) -> torch.Tensor:
    """The last ``d`` rows (of each head: ``rows`` is (..., d_head, in)), interleaved pairs
    (x0, x1), (x2, x3), ... -> halves (x0, x2, ..., x1, x3, ...): megalite's rotate-half order."""
    rope = rows[..., -d:, :]
    return torch.cat([rows[..., :-d, :], rope[..., 0::2, :], rope[..., 1::2, :]], dim=-2)


def pairs_from_halves(rows: torch.Tensor, d: int) -> torch.Tensor:
    """The inverse of :func:`halves_from_pairs`."""
    rope = rows[..., -d:, :]
    pairs = torch.stack([rope[..., : d // 2, :], rope[..., d // 2:, :]], dim=-2)  # (..., d/2, 2, in)
    return torch.cat([rows[..., :-d, :], pairs.flatten(-3, -2)], dim=-2)


def _rope_rows(weight: torch.Tensor, cfg: ModelConfig, per_head: bool, to_megalite: bool) -> torch.Tensor:
    """Permute the RoPE rows of a query matrix (per head) or of kv_a_proj_with_mqa (its tail)."""
    move = halves_from_pairs if to_megalite else pairs_from_halves
    if not per_head:
        return move(weight, cfg.qk_pos_emb_head_dim)
    heads = weight.reshape(cfg.num_attention_heads, -1, weight.shape[-1])
    return move(heads, cfg.qk_pos_emb_head_dim).reshape(weight.shape)


# megalite <- HF names that only change name (prefixes layers.N. and model.layers.N.)
NAMES = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
         "attn.proj.weight": "self_attn.o_proj.weight", "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
         "attn.kv_up.weight": "self_attn.kv_b_proj.weight"}
Q_LATENT = {"attn.q_down.weight": "self_attn.q_a_proj.weight", "attn.q_norm.weight": "self_attn.q_a_layernorm.weight"}


def _plain_names(cfg: ModelConfig, moe: bool) -> dict[str, str]:
    names = {**NAMES, **(Q_LATENT if cfg.q_lora_rank else {})}
    if moe:
        names.update({"mlp.router.weight": "mlp.gate.weight",
                      "mlp.shared_expert.fc2.weight": "mlp.shared_experts.down_proj.weight"})
    else:
        names["mlp.fc2.weight"] = "mlp.down_proj.weight"
    return names


def _query(cfg: ModelConfig) -> tuple[str, str]:
    return ("attn.q_up.weight", "self_attn.q_b_proj.weight") if cfg.q_lora_rank else \
        ("attn.q_proj.weight", "self_attn.q_proj.weight")


def import_globals(get, cfg: ModelConfig) -> dict:
    return {ours: get(theirs) for ours, theirs in global_names(cfg).items()}


def export_globals(get, cfg: ModelConfig) -> dict:
    return {theirs: get(ours) for ours, theirs in global_names(cfg).items()}


def import_layer(get, i: int, cfg: ModelConfig, interleaved: bool = True) -> dict:
    return import_block(get, f"model.layers.{i}.", f"layers.{i}.", moe_layers(cfg)[i], cfg, interleaved)


def export_layer(get, i: int, cfg: ModelConfig, interleaved: bool = True) -> dict:
    return export_block(get, f"model.layers.{i}.", f"layers.{i}.", moe_layers(cfg)[i], cfg, interleaved)


def import_block(get, p: str, q: str, moe: bool, cfg: ModelConfig, interleaved: bool) -> dict:
    """The decoder layer under HF prefix ``p`` as megalite's block under prefix ``q``."""
    out = {q + ours: get(p + theirs) for ours, theirs in _plain_names(cfg, moe).items()}
    (q_ours, q_theirs), kv_down = _query(cfg), get(p + "self_attn.kv_a_proj_with_mqa.weight")
    query = get(p + q_theirs)
    if interleaved:
        query, kv_down = _rope_rows(query, cfg, True, True), _rope_rows(kv_down, cfg, False, True)
    out[q + q_ours], out[q + "attn.kv_down.weight"] = query, kv_down
    if not moe:
        out[q + "mlp.fc1.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        return out
    m = p + "mlp."
    out[q + "mlp." + BIAS_SUFFIX] = get(m + "gate.e_score_correction_bias").float()
    out[q + "mlp.shared_expert.fc1.weight"] = torch.cat([get(m + "shared_experts.gate_proj.weight"),
                                                         get(m + "shared_experts.up_proj.weight")])
    return {**out, **import_gate_up_experts(get, m, q, cfg)}  # the hub's or transformers 5's stacked names


def export_block(get, p: str, q: str, moe: bool, cfg: ModelConfig, interleaved: bool) -> dict:
    """megalite's block under prefix ``q`` as the HF decoder layer under prefix ``p`` (the hub's names)."""
    out = {p + theirs: get(q + ours) for ours, theirs in _plain_names(cfg, moe).items()}
    (q_ours, q_theirs), kv_down = _query(cfg), get(q + "attn.kv_down.weight")
    query = get(q + q_ours)
    if interleaved:
        query, kv_down = _rope_rows(query, cfg, True, False), _rope_rows(kv_down, cfg, False, False)
    out[p + q_theirs], out[p + "self_attn.kv_a_proj_with_mqa.weight"] = query, kv_down
    if not moe:
        out.update(zip((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), get(q + "mlp.fc1.weight").chunk(2)))
        return out
    m = p + "mlp."
    out[m + "gate.e_score_correction_bias"] = get(q + "mlp." + BIAS_SUFFIX)
    out.update(zip((m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight"),
                   get(q + "mlp.shared_expert.fc1.weight").chunk(2)))
    return {**out, **export_gate_up_experts(get, m, q, cfg)}
