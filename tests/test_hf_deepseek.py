"""Hugging Face DeepSeek-V3 in and out: logits equal to transformers' (fp32, 1e-5 relative) with
and without a query latent, the export round trip bit-equal (safetensors and config.json), what
megalite cannot express refused (both ways), YaRN's temperature as transformers computes it, and
the imported model at TP2+SP x EP2 equal to serial, its saved checkpoint exporting to
transformers' logits; greedy generation equal to transformers'. The multi-token-prediction
layers: tests/test_hf_deepseek_mtp.py. Tiny random models built by transformers; no download."""
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from megalite.checkpoint.convert import export_hf, import_hf  # noqa: E402
from megalite.checkpoint.hf_deepseek import (halves_from_pairs, model_config_from_hf,  # noqa: E402
                                             pairs_from_halves)
from megalite.checkpoint.hf_llama import UnsupportedModel  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from tests.hf_checkpoints import assert_greedy_equals_transformers, export_round_trip, saved_model_settings  # noqa: E402,E501
from tests.test_hf_llama import assert_same_logits  # noqa: E402

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
# 3 layers (1 dense, 2 MoE), 8 experts in 4 groups (top-2 groups, top-2 experts), a shared expert
SHAPE = dict(vocab_size=1000, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
             qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
             max_position_embeddings=128, rope_scaling=YARN, num_mtp_layers=0, tie_word_embeddings=False)


def deepseek(tmp_path, **kw):
    """A random DeepseekV3ForCausalLM saved under tmp_path/hf; norms, router and expert biases
    random too (transformers' ones and zeros would hide a swap or a lost bias)."""
    torch.manual_seed(2)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SHAPE, **kw})).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight"):  # the layer norms, the latent norms, the final norm
                t.normal_(1, 0.3)
            elif name.endswith("gate.weight"):
                t.normal_(0, 0.5)  # a router that prefers some experts
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    return model


# every config key but these comes back from an export (scoring_func / topk_method: transformers'
# fixed values, which megalite's settings do not record)
CONFIG_IGNORE = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "scoring_func", "topk_method"}


def _round_trip(model, tmp_path):
    """Export bit-equal to the original tensors, and config.json giving the same configuration."""
    return export_round_trip(model, transformers.DeepseekV3ForCausalLM, tmp_path, CONFIG_IGNORE)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["query-latent", "query-matrix"])
def test_deepseek_v3_logits_and_round_trip(tmp_path, q_lora_rank):
    model = deepseek(tmp_path, q_lora_rank=q_lora_rank)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    cfg = saved_model_settings(tmp_path / "ckpt")
    assert (cfg["multi_latent_attention"], cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_head_dim"],
            cfg["qk_pos_emb_head_dim"], cfg["v_head_dim"]) == (True, q_lora_rank, 16, 16, 8, 12)
    assert (cfg["moe_layer_freq"], cfg["num_experts"], cfg["moe_router_topk"], cfg["moe_ffn_hidden_size"],
            cfg["moe_shared_expert_intermediate_size"], cfg["ffn_hidden_size"]) == ([0, 1, 1], 8, 2, 16, 16, 64)
    assert (cfg["moe_router_score_function"], cfg["moe_router_num_groups"], cfg["moe_router_group_topk"],
            cfg["moe_router_topk_scaling_factor"], cfg["moe_router_enable_expert_bias"]) == ("sigmoid", 4, 2, 2.5, True)
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["mscale_all_dim"] == 1.0
    print(f"DeepSeek-V3 import ({q_lora_rank=}): logits {assert_same_logits(model, tmp_path / 'ckpt'):.1e}")
    config = _round_trip(model, tmp_path)
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == 1
    assert config["num_nextn_predict_layers"] == 0


def test_stacked_names_and_plain_rope(tmp_path):
    """transformers 5's stacked experts import as the hub's names do; with rope_interleave false
    no row moves (and the export keeps it so). (The MTP layers: tests/test_hf_deepseek_mtp.py.)"""
    from safetensors.torch import save_file
    model = deepseek(tmp_path, rope_interleave=False, rope_scaling=None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    (tmp_path / "stacked").mkdir()
    save_file(state, str(tmp_path / "stacked" / "model.safetensors"))
    config = json.load(open(tmp_path / "hf" / "config.json"))
    json.dump(config, open(tmp_path / "stacked" / "config.json", "w"))
    import_hf(str(tmp_path / "stacked"), str(tmp_path / "ckpt"), progress=False)
    assert saved_model_settings(tmp_path / "ckpt")["rope_scaling"] is None
    assert_same_logits(model, tmp_path / "ckpt")
    assert _round_trip(model, tmp_path)["rope_interleave"] is False


def test_rope_rows_interleaved_pairs_to_halves_and_back():
    """Rows (x0, x1, x2, x3) of each head's RoPE part become (x0, x2, x1, x3); the rest stays."""
    rows = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6, 1)  # 2 heads: 2 plain rows, 4 RoPE rows
    halves = halves_from_pairs(rows, 4)
    assert halves[0, :, 0].tolist() == [0, 1, 2, 4, 3, 5] and halves[1, :, 0].tolist() == [6, 7, 8, 10, 9, 11]
    assert torch.equal(pairs_from_halves(halves, 4), rows)


def test_what_megalite_cannot_express_is_refused(tmp_path):
    deepseek(tmp_path)
    config = json.load(open(tmp_path / "hf" / "config.json"))
    yarn = config["rope_parameters"]
    for change, message in [({"norm_topk_prob": False}, "norm_topk_prob False"),
                            ({"num_key_value_heads": 2}, "num_key_value_heads 2"),
                            ({"attention_bias": True}, "attention_bias True"),
                            ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                            ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
                            ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
                            ({"first_k_dense_replace": 3}, "no MoE layer"),
                            ({"n_group": 3}, "n_group / topk_group"),
                            ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
                            ({"rope_parameters": {**yarn, "rope_type": "dynamic", "type": "dynamic"}},
                             "rope scaling type 'dynamic'"),
                            ({"rope_parameters": {**yarn, "partial_rotary_factor": 0.5}},
                             "partial_rotary_factor 0.5"),
                            ({"rope_parameters": {**yarn, "attention_factor": 0.5}}, "attention_factor 0.5")]:
        json.dump({**config, **change}, open(tmp_path / "hf" / "config.json", "w"))
        with pytest.raises(UnsupportedModel, match=message):
            import_hf(str(tmp_path / "hf"), str(tmp_path / "x"))
        assert not (tmp_path / "x").exists()


def test_bf16_export_keeps_the_expert_bias_fp32_and_what_v3_cannot_hold_is_refused(tmp_path):
    """transformers keeps e_score_correction_bias in fp32 (its small steps would round away in
    bf16): the export writes it so, beside bf16 weights. A model DeepseekV3ForCausalLM cannot
    hold is refused before anything is written."""
    from safetensors import safe_open
    model = deepseek(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), dtype="bfloat16")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert torch.equal(bias, model.model.layers[1].mlp.gate.e_score_correction_bias)
    meta_path = next((tmp_path / "ckpt").glob("iter_*/metadata.json"))
    saved = json.load(open(meta_path))
    for change, message in [({"moe_router_score_function": "softmax"}, "sigmoid router scores"),
                            ({"moe_shared_expert_intermediate_size": None}, "a shared expert"),
                            ({"moe_layer_freq": [1, 0, 1]}, "dense layers first"),
                            ({"qk_layernorm": True}, "no QK-norm"),
                            ({"norm_epsilon": 1e-5}, "--norm-epsilon 1e-06")]:
        meta = json.loads(json.dumps(saved))
        meta["config"]["model"].update(change)
        json.dump(meta, open(meta_path, "w"))
        with pytest.raises(UnsupportedModel, match=message):
            export_hf(str(tmp_path / "ckpt"), str(tmp_path / "refused"))
        assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("given,megalite", [({"mscale": 0.707, "mscale_all_dim": 0}, (1.0, 0.0)),
                                            ({"mscale": 0, "mscale_all_dim": 0.8}, None),
                                            ({"attention_factor": 1.25}, None)])
def test_yarn_temperatures_hf_infers_otherwise_are_expressed(given, megalite):
    """HF's cos/sin factor is mscale(s, mscale) / mscale(s, mscale_all_dim) only when both are
    non-zero (else mscale(s, 1), or attention_factor when given); the import picks megalite's
    --mscale to give the same factor, and the export writes it back as HF reads it."""
    import math

    import transformers.modeling_rope_utils as rope_utils
    from megalite.checkpoint.hf_deepseek import hf_config_from
    from megalite.layers.rotary import rotary_amplitude, softmax_scale

    hf = {**SHAPE, "model_type": "deepseek_v3", "rope_scaling": None,
          "rope_parameters": {**YARN, "rope_type": "yarn", "rope_theta": 10000.0, **given}}
    cfg = model_config_from_hf(hf)
    if megalite:
        assert (cfg.rope_scaling["mscale"], cfg.rope_scaling["mscale_all_dim"]) == megalite
    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in hf.items() if k != "model_type"})
    _, want = rope_utils._compute_yarn_parameters(hf_config)
    assert math.isclose(rotary_amplitude(cfg.rope_scaling), want, rel_tol=1e-12)
    d_qk = SHAPE["qk_nope_head_dim"] + SHAPE["qk_rope_head_dim"]
    assert math.isclose(softmax_scale(cfg, d_qk), rope_utils.yarn_apply_mscale(hf_config.rope_parameters,
                                                                               d_qk ** -0.5), rel_tol=1e-12)
    out = hf_config_from(cfg, torch.float32, {})  # and back: HF's factor from what the export writes
    again = transformers.DeepseekV3Config(**{k: v for k, v in out.items() if k not in ("model_type", "architectures")})
    assert math.isclose(rope_utils._compute_yarn_parameters(again)[1], want, rel_tol=1e-12)


def test_a_temperature_hf_would_not_infer_is_exported_as_attention_factor():
    """megalite's --mscale 0.707 --mscale-all-dim 0 (Megatron's form): HF alone would turn cos/sin
    by mscale(s, 1), so the export states mscale(s, 0.707) as attention_factor."""
    import math

    import transformers.modeling_rope_utils as rope_utils
    from megalite.checkpoint.hf_deepseek import hf_config_from
    from megalite.layers.rotary import rotary_amplitude

    cfg = model_config_from_hf({**SHAPE, "model_type": "deepseek_v3"})
    cfg.rope_scaling.update(mscale=0.707, mscale_all_dim=0.0)
    out = hf_config_from(cfg, torch.float32, {})
    assert out["rope_scaling"]["attention_factor"] == rotary_amplitude(cfg.rope_scaling) != 1.0
    again = transformers.DeepseekV3Config(**{k: v for k, v in out.items() if k not in ("model_type", "architectures")})
    assert math.isclose(rope_utils._compute_yarn_parameters(again)[1], rotary_amplitude(cfg.rope_scaling),
                        rel_tol=1e-12)
    back = model_config_from_hf(out)  # and megalite reads it back to the same factor
    assert math.isclose(rotary_amplitude(back.rope_scaling), rotary_amplitude(cfg.rope_scaling), rel_tol=1e-12)


def test_load_takes_the_router_settings_from_the_checkpoint(tmp_path):
    """What a fine-tune of the imported model needs: --load adopting the router's settings as it
    adopts the experts' (settings.adopt_checkpoint_model): the router's settings are fixed by checkpoints."""
    from megalite.checkpoint.settings import adopt_checkpoint_model
    from megalite.config import ModelConfig

    deepseek(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), progress=False)
    run = ModelConfig(vocab_size=1000)
    adopt_checkpoint_model(run, saved_model_settings(tmp_path / "ckpt"), set(), 1000, str(tmp_path / "ckpt"))
    assert (run.num_experts, run.moe_router_score_function, run.moe_router_num_groups,
            run.moe_router_topk_scaling_factor, run.moe_router_enable_expert_bias) == (8, "sigmoid", 4, 2.5, True)


def test_greedy_generation_equals_transformers(tmp_path, capsys):
    model = deepseek(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert_greedy_equals_transformers(model, tmp_path / "ckpt", [5, 17, 42, 7, 300], 12, capsys)


def _finetune_worker(rank, world, ckpt, layouts):
    from megalite.train.pretrain import pretrain
    base = ["--load", ckpt, "--finetune", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--seq-length", "32", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "100",
            "--hidden-dropout", "0", "--attention-dropout", "0"]  # the router's settings: from the checkpoint
    return [[(r["loss"], r["grad_norm"]) for r in pretrain(base + extra)] for extra in layouts]


@pytest.mark.slow
def test_imported_deepseek_v3_trains_at_ep2_tp2_as_serially_and_exports(tmp_path):
    """The imported model fine-tunes at TP2+SP x EP2 as serially; the checkpoint that run saves
    (TP and EP pieces, expert biases moved by the training) exports to a model whose logits
    transformers computes as megalite does."""
    model = deepseek(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), seq_length=32)
    serial = run_world(_finetune_worker, 1, str(tmp_path / "ckpt"), [[]])[0][0]
    ep2_tp2 = run_world(_finetune_worker, 4, str(tmp_path / "ckpt"),
                        [["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                          "--sequence-parallel", "--save", str(tmp_path / "tuned")]])[0][0]
    worst = max(abs(a - b) / b for pair, ref in zip(ep2_tp2, serial) for a, b in zip(pair, ref))
    print(f"imported DeepSeek-V3 at TP2+SP x EP2 vs serial: worst {worst:.1e}")
    assert worst < 1e-5, (ep2_tp2, serial)
    export_hf(str(tmp_path / "tuned"), str(tmp_path / "out"), progress=False)
    tuned = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    before = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert not torch.equal(tuned.model.layers[1].mlp.gate.e_score_correction_bias, before)  # the bias moved
    assert_same_logits(tuned, tmp_path / "tuned")
