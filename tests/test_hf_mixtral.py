"""Hugging Face Mixtral in and out: the same logits as transformers' (both the hub's per-expert
names and transformers 5's stacked ones), bit-equal export, expert-parallel training from the
import, and the settings megalite cannot express refused. Random models; no download."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megalite.checkpoint.convert import export_hf, import_hf  # noqa: E402
from megalite.checkpoint.hf_llama import UnsupportedModel  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from tests.hf_checkpoints import saved_model_settings  # noqa: E402
from tests.test_hf_llama import assert_same_logits  # noqa: E402


def mixtral(tmp_path, **kw):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                        rope_theta=1e6, **kw)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # a router that prefers some experts (the default init is near uniform)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    return model


def test_mixtral_import_gives_the_same_logits_and_exports_bit_equal(tmp_path):
    model = mixtral(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    cfg = saved_model_settings(tmp_path / "ckpt")
    assert (cfg["num_experts"], cfg["moe_router_topk"], cfg["moe_ffn_hidden_size"]) == (4, 2, 96)
    assert cfg["moe_expert_capacity_factor"] is None  # dropless, as Mixtral
    print(f"Mixtral import: logits {assert_same_logits(model, tmp_path / 'ckpt'):.1e} from transformers'")
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    original = model.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_transformers_5_stacked_expert_names_import_the_same(tmp_path):
    """transformers 5 holds the experts stacked (gate_up_proj, down_proj) under mlp.*; a file
    written from that state dict imports to the same checkpoint as the hub's names."""
    from safetensors.torch import save_file
    model = mixtral(tmp_path)
    (tmp_path / "stacked").mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "stacked" / "model.safetensors"))
    (tmp_path / "stacked" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    import_hf(str(tmp_path / "stacked"), str(tmp_path / "ckpt"))
    assert_same_logits(model, tmp_path / "ckpt")


def _finetune_worker(rank, world, ckpt, extra):
    from megalite.train.pretrain import pretrain
    args = ["--load", ckpt, "--finetune", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--seq-length", "32", "--train-iters", "3", "--lr", "1e-4", "--log-interval", "100",
            "--moe-aux-loss-coeff", "0.01", "--hidden-dropout", "0", "--attention-dropout", "0"] + extra
    return [(r["loss"], r["grad_norm"]) for r in pretrain(args)]


def test_imported_mixtral_trains_expert_parallel_as_serially(tmp_path):
    mixtral(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), seq_length=32)
    serial = run_world(_finetune_worker, 1, str(tmp_path / "ckpt"), [])[0]
    ep2 = run_world(_finetune_worker, 2, str(tmp_path / "ckpt"), ["--expert-model-parallel-size", "2"])[0]
    assert max(abs(a - b) / b for pair, ref in zip(ep2, serial) for a, b in zip(pair, ref)) < 1e-5


def test_what_megalite_cannot_express_is_refused(tmp_path):
    mixtral(tmp_path)
    config = json.load(open(tmp_path / "hf" / "config.json"))
    for change, message in [({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
                            ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
                            ({"sliding_window": 64}, "sliding_window 64 is shorter")]:
        json.dump({**config, **change}, open(tmp_path / "hf" / "config.json", "w"))
        with pytest.raises(UnsupportedModel, match=message):
            import_hf(str(tmp_path / "hf"), str(tmp_path / "x"), seq_length=128)
    json.dump({**config, "sliding_window": 64}, open(tmp_path / "hf" / "config.json", "w"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "short"), seq_length=64)  # within the window: the same
    json.dump(config, open(tmp_path / "hf" / "config.json", "w"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    meta_path = next((tmp_path / "ckpt").glob("iter_*/metadata.json"))
    meta = json.load(open(meta_path))
    meta["config"]["model"]["moe_shared_expert_intermediate_size"] = 32
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(UnsupportedModel, match="needs no shared expert"):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("routing,message", [({"moe_router_score_function": "sigmoid"}, "softmax router scores"),
                                             ({"moe_router_enable_expert_bias": True}, "no expert bias"),
                                             ({"moe_router_topk_scaling_factor": 2.5}, "no top-k scaling factor")])
def test_deepseek_routing_does_not_export_as_mixtral(tmp_path, routing, message):
    """Mixtral's router is softmax over all experts: a checkpoint routed as DeepSeek-V3 (sigmoid,
    groups, scaled weights, expert bias) is refused before anything is written."""
    mixtral(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    meta_path = next((tmp_path / "ckpt").glob("iter_*/metadata.json"))
    meta = json.load(open(meta_path))
    meta["config"]["model"].update(routing)
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(UnsupportedModel, match=message):
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
