"""Hugging Face Llama and Qwen2 in and out: logits equal to transformers', bit-equal export,
sharded (streamed) input, and clear errors. Random models made by transformers; no download."""
import json
import math
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from convert_hf import main as convert_main  # noqa: E402

from megalite.checkpoint import CheckpointError, load_serial_model  # noqa: E402
from megalite.checkpoint.convert import export_hf, import_hf  # noqa: E402
from megalite.checkpoint.hf_llama import UnsupportedModel  # noqa: E402
from tests.hf_checkpoints import assert_greedy_equals_transformers, saved_model_settings  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}  # short, so positions < 64 feel the scaling


def llama(tmp_path, scaling=None, shard=None, **kw):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      rope_theta=500000.0, rope_scaling=dict(scaling) if scaling else None,
                                      max_position_embeddings=256,
                                      tie_word_embeddings=False, rms_norm_eps=1e-5, **kw)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf", max_shard_size=shard or "2GB")
    return model


def qwen2(tmp_path):
    torch.manual_seed(1)
    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      tie_word_embeddings=True, max_position_embeddings=256)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random q/k/v biases (transformers initializes them to zero)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    return model


def assert_same_logits(hf_model, ckpt, vocab=1000):
    ids = torch.randint(0, vocab, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_model(ids).logits
        got = load_serial_model(str(ckpt))(ids)
    # max error relative to the logits' own scale; measured 2e-7 to 4e-7 (fp32 rounding of two
    # orders of summation), so 1e-5 leaves ~25x headroom (it was 1e-4)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"logits vs transformers': max |err| / max |ref| = {rel:.1e}")
    assert rel < 1e-5, rel
    return rel


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["rope", "llama3-scaling"])
def test_llama_import_gives_the_same_logits_and_exports_bit_equal(tmp_path, scaling):
    model = llama(tmp_path, scaling)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert_same_logits(model, tmp_path / "ckpt")
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    original = model.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert json.load(open(tmp_path / "out" / "config.json"))["rope_scaling"] == (scaling and dict(scaling))
    assert os.path.exists(tmp_path / "out" / "generation_config.json")


def test_rope_scaling_matters(tmp_path):
    """The llama3 schedule changes the logits here: importing it as plain RoPE would not match."""
    model = llama(tmp_path, LLAMA3_SCALING)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    meta_path = next((tmp_path / "ckpt").glob("iter_*/metadata.json"))
    meta = json.load(open(meta_path))
    meta["config"]["model"]["rope_scaling"] = None
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(AssertionError):
        assert_same_logits(model, tmp_path / "ckpt")


def test_qwen2_with_qkv_bias_and_tied_embeddings(tmp_path):
    model = qwen2(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    cfg = saved_model_settings(tmp_path / "ckpt")
    assert cfg["add_qkv_bias"] and not cfg["add_bias_linear"] and not cfg["untie_embeddings_and_output_weights"]
    assert_same_logits(model, tmp_path / "ckpt")
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_sharded_checkpoint_streams_and_exports_sharded(tmp_path):
    model = llama(tmp_path, shard="300KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert convert_main(["--direction", "import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    files = json.load(open(next((tmp_path / "ckpt").glob("iter_*/metadata.json"))))["files"]
    assert len(files) == 5  # embeddings + head, then one file per layer: one unit in memory at a time
    assert_same_logits(model, tmp_path / "ckpt")
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), max_shard_bytes=300_000)
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_bad_inputs_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        import_hf(str(tmp_path / "empty"), str(tmp_path / "x"))
    llama(tmp_path, shard="300KB")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    shard = sorted(set(json.load(open(index_path))["weight_map"].values()))[1]
    os.rename(tmp_path / "hf" / shard, tmp_path / "moved")
    with pytest.raises(CheckpointError, match=f"names shard.*{shard}.*not there"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "x"))
    os.rename(tmp_path / "moved", tmp_path / "hf" / shard)
    config = json.load(open(tmp_path / "hf" / "config.json"))
    for change, message in [({"model_type": "mistral"}, "model_type 'mistral'"),
                            ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
                            ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
                             "rope scaling type 'yarn'"),
                            ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                            ({"head_dim": 64}, "head_dim 64")]:
        json.dump({**config, **change}, open(tmp_path / "hf" / "config.json", "w"))
        with pytest.raises(UnsupportedModel, match=message):
            import_hf(str(tmp_path / "hf"), str(tmp_path / "x"))
    json.dump({**config, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64},
              open(tmp_path / "hf" / "config.json", "w"))
    with pytest.raises(UnsupportedModel, match="sliding_window 64"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "x"))


# -- generation with a KV cache ----------------------------------------------------------------------

def test_kv_cache_decoding_equals_full_forward(tmp_path):
    """Logits of the prompt in one pass, then token by token through the cache, equal one
    full forward over the whole sequence (Llama with RoPE; GPT-2 with learned positions)."""
    from megalite.config import ModelConfig
    from megalite.layers.kv_cache import KVCache
    from megalite.model.gpt import GPTModel

    llama(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    gpt2 = GPTModel(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300,
                                seq_length=64, hidden_dropout=0.0, attention_dropout=0.0))
    gpt2.init_weights(5)
    for model in (load_serial_model(str(tmp_path / "ckpt")), gpt2.eval()):
        cfg = model.cfg
        ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            full = model(ids)
            cache = KVCache(model.layers.keys(), 1, cfg.num_query_groups, cfg.head_dim, 24, torch.float32,
                            torch.device("cpu"))
            parts = [model(ids[:, :10], kv_cache=cache)]
            parts += [model(ids[:, i: i + 1], kv_cache=cache) for i in range(10, 24)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_generate_greedy_equals_transformers_and_any_layout(tmp_path, capsys):
    from reshard_checkpoint import reshard

    model = llama(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    for ckpt in (tmp_path / "ckpt", tmp_path / "tp2"):
        if ckpt.name == "tp2":  # the same weights, saved as tensor-parallel pieces of 2 ranks
            reshard(str(tmp_path / "ckpt"), str(ckpt), tp=2, pp=1, vp_layers=None, dp=1, zero=0)
        assert_greedy_equals_transformers(model, ckpt, [5, 17, 42, 7, 300], 20, capsys)


def test_sampling_is_seeded_and_respects_top_k():
    from megalite.model.generation import Sampling, next_token

    logits = torch.linspace(0, 3, 50)
    draw = lambda s, seed: [next_token(logits, s, torch.Generator().manual_seed(seed)) for _ in range(1)][0]
    top2 = Sampling(greedy=False, top_k=2, seed=0)
    picks = {next_token(logits, top2, g) for g in [torch.Generator().manual_seed(i) for i in range(40)]}
    assert picks <= {48, 49} and len(picks) == 2
    nucleus = Sampling(greedy=False, top_p=1e-3)
    assert {draw(nucleus, i) for i in range(10)} == {49}  # only the most probable survives
    assert draw(Sampling(greedy=False, temperature=0.7), 3) == draw(Sampling(greedy=False, temperature=0.7), 3)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        Sampling(greedy=False, temperature=0).check()


# -- fine-tuning an imported model under any layout ---------------------------------------------------

def _finetune(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return [r["loss"] for r in pretrain(argv)]


@pytest.mark.slow
def test_imported_llama_finetunes_the_same_under_tp2_pp2_and_dp2_zero1(tmp_path):
    from megalite.testing import run_world

    llama(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    # No model flags: layers, sizes, heads, KV groups, RoPE, RMSNorm, SwiGLU, untied, vocab come from the checkpoint.
    argv = ["--load", str(tmp_path / "ckpt"), "--finetune", "--mock-data", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--adam-eps", "1e-5", "--log-interval", "100"]
    serial = run_world(_finetune, 1, argv)[0]
    assert len(serial) == 10 and all(math.isfinite(x) for x in serial)
    tp2pp2 = run_world(_finetune, 4, argv + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])[0]
    dp2 = run_world(_finetune, 2, argv + ["--zero-stage", "1"])[0]
    for losses in (tp2pp2, dp2):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, serial)) < 1e-5, (losses, serial)


def test_load_refuses_flags_that_contradict_the_checkpoint(tmp_path):
    from megalite.config import ConfigError
    from megalite.train.pretrain import pretrain

    llama(tmp_path)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    base = ["--load", str(tmp_path / "ckpt"), "--finetune", "--mock-data", "--seq-length", "32", "--train-iters", "1"]
    with pytest.raises(ConfigError, match=r"--num-layers: the checkpoint has 4, the command line gives 3"):
        pretrain(base + ["--num-layers", "3"])
    with pytest.raises(ConfigError, match=r"--normalization: the checkpoint has 'RMSNorm'.*'LayerNorm'"):
        pretrain(base + ["--normalization", "LayerNorm"])
    with pytest.raises(ConfigError, match="the tokenizer has 2000 ids but the checkpoint's model only 1000"):
        pretrain(base + ["--vocab-size", "2000"])
    log = pretrain(base + ["--num-layers", "4", "--swiglu"])  # agreeing flags are fine
    assert len(log) == 1
