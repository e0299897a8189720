"""Hugging Face Qwen3 and Qwen3-MoE in and out: logits equal to transformers' (fp32, 1e-5
relative), the export round trip bit-equal, greedy generation equal to transformers', Qwen3-MoE
at EP4 equal to serial, and what megalite cannot express refused. Tiny random models built by
transformers; no download."""
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from megalite.checkpoint.convert import import_hf  # noqa: E402
from megalite.checkpoint.hf_llama import UnsupportedModel, model_config_from_hf_llama  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from tests.hf_checkpoints import assert_greedy_equals_transformers, export_round_trip, saved_model_settings  # noqa: E402,E501
from tests.test_hf_llama import assert_same_logits  # noqa: E402

SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
             max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)  # width 64 != 32


def _random_qk_norms(model):
    with torch.no_grad():  # transformers initializes them to ones, which would hide a swap
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1, 0.3)
            layer.self_attn.k_norm.weight.normal_(1, 0.3)


def qwen3(tmp_path):
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=64, num_hidden_layers=2,
                                                                    **SHAPE)).eval()
    _random_qk_norms(model)
    model.save_pretrained(tmp_path / "hf")
    return model


def qwen3_moe(tmp_path, **kw):
    torch.manual_seed(1)
    fields = dict(intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                  router_aux_loss_coef=0.0, **SHAPE)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**fields, **kw})).eval()
    _random_qk_norms(model)
    with torch.no_grad():  # a router that prefers some experts (the default init is near uniform)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    return model


def test_qwen3_logits_round_trip_and_greedy_generation(tmp_path, capsys):
    model = qwen3(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    cfg = saved_model_settings(tmp_path / "ckpt")
    assert cfg["qk_layernorm"] and cfg["kv_channels"] == 16 and cfg["hidden_size"] == 32
    print(f"Qwen3 import: logits {assert_same_logits(model, tmp_path / 'ckpt'):.1e} from transformers'")
    config = export_round_trip(model, transformers.Qwen3ForCausalLM, tmp_path)
    assert config["model_type"] == "qwen3" and config["head_dim"] == 16
    assert_greedy_equals_transformers(model, tmp_path / "ckpt", [5, 17, 42, 7, 300], 12, capsys)


def test_qwen3_moe_logits_round_trip_and_greedy_generation(tmp_path, capsys):
    model = qwen3_moe(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    cfg = saved_model_settings(tmp_path / "ckpt")
    assert (cfg["num_experts"], cfg["moe_router_topk"], cfg["moe_ffn_hidden_size"], cfg["ffn_hidden_size"]) == \
        (8, 2, 24, 48)
    assert cfg["moe_layer_freq"] == [1, 0, 1] and cfg["moe_shared_expert_intermediate_size"] is None
    print(f"Qwen3-MoE import: logits {assert_same_logits(model, tmp_path / 'ckpt'):.1e} from transformers'")
    config = export_round_trip(model, transformers.Qwen3MoeForCausalLM, tmp_path)
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [1] and config["norm_topk_prob"]
    assert_greedy_equals_transformers(model, tmp_path / "ckpt", [3, 99, 12, 640], 10, capsys)


def test_transformers_5_stacked_expert_names_import_the_same(tmp_path):
    """transformers 5 holds the experts stacked (gate_up_proj, down_proj); a file written from
    that state dict imports to the same model as the hub's per-expert names."""
    from safetensors.torch import save_file
    model = qwen3_moe(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "stacked").mkdir()
    save_file(state, str(tmp_path / "stacked" / "model.safetensors"))
    (tmp_path / "stacked" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    import_hf(str(tmp_path / "stacked"), str(tmp_path / "ckpt"))
    assert_same_logits(model, tmp_path / "ckpt")


def test_what_megalite_cannot_express_is_refused(tmp_path):
    qwen3_moe(tmp_path)
    config = json.load(open(tmp_path / "hf" / "config.json"))
    for change, message in [({"norm_topk_prob": False}, "norm_topk_prob False with num_experts_per_tok 2"),
                            ({"num_experts_per_tok": 1}, "norm_topk_prob True with num_experts_per_tok 1"),
                            ({"attention_bias": True}, "attention_bias true"),
                            ({"mlp_only_layers": [0, 1, 2]}, "leave no MoE layer")]:
        json.dump({**config, **change}, open(tmp_path / "hf" / "config.json", "w"))
        with pytest.raises(UnsupportedModel, match=message):
            import_hf(str(tmp_path / "hf"), str(tmp_path / "x"))
    step2 = model_config_from_hf_llama({**config, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert step2.moe_layer_freq == [0, 1, 0]  # (i + 1) % 2 == 0: layer 1 alone is MoE


def _finetune_worker(rank, world, ckpt, extra):
    from megalite.train.pretrain import pretrain
    args = ["--load", ckpt, "--finetune", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3", "--log-interval", "100",
            "--moe-aux-loss-coeff", "0.01", "--hidden-dropout", "0", "--attention-dropout", "0"] + extra
    return [(r["loss"], r["grad_norm"]) for r in pretrain(args)]


def test_imported_qwen3_moe_trains_at_ep4_as_serially(tmp_path):
    qwen3_moe(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), seq_length=32)
    serial = run_world(_finetune_worker, 1, str(tmp_path / "ckpt"), [])[0]
    ep4 = run_world(_finetune_worker, 4, str(tmp_path / "ckpt"), ["--expert-model-parallel-size", "4"])[0]
    assert max(abs(a - b) / b for pair, ref in zip(ep4, serial) for a, b in zip(pair, ref)) < 1e-5, (ep4, serial)
