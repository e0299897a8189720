"""DeepSeek-V3's multi-token-prediction layers in and out of Hugging Face (megalite.checkpoint.hf_deepseek_mtp).

A tiny DeepseekV3ForCausalLM written by transformers gains D = 2 MTP layers in its safetensors,
random and named as in DeepSeek-V3's files (``model.layers.{n + k}``: a decoder layer, ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, and ``embed_tokens`` / ``shared_head.head`` copies of
the main model's). The import must give a megalite model whose loss equals a float64 reference
computed from those tensors with DeepSeek-V3's equations (section 2.2, with the input order the
released weights use)::

    h_0 = the main model's normalised last hidden state (transformers' DeepseekV3Model, float64)
    h_k[t] = RMSNorm(Block_{n+k-1}(eh_proj [RMSNorm(Emb x_{t+k}; enorm); RMSNorm(h_{k-1}[t]; hnorm)]); shared_head.norm)
    L = CE(lm_head h_0, x_{t+1}) + lambda / D * sum_k mean_{t + k + 1 <= s} CE(shared_head.head h_k[t], x_{t+k+1})

where Block_{n+k-1} is transformers' own DeepseekV3DecoderLayer (MLA, MoE with its bias) loaded by
transformers from the files' layer n + k - 1, and the rest is written here from the equations.
The export gives back every tensor bit for bit (MTP ones included) and config.json's
``num_nextn_predict_layers``. What megalite cannot hold is refused in one message, before
anything is written. Slow: an imported MTP model trained at PP2 x EP2 equals serial and exports
what it trained.
"""
import copy
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from safetensors.torch import load_file, save_file  # noqa: E402

from megalite.checkpoint.convert import export_hf, import_hf  # noqa: E402
from megalite.checkpoint.hf_llama import UnsupportedModel  # noqa: E402
from megalite.checkpoint.serial import load_serial_model, save_weights_checkpoint  # noqa: E402
from megalite.checkpoint.format import PieceReader  # noqa: E402
from megalite.checkpoint.serial import _checkpoint_dir  # noqa: E402
from megalite.model.mtp import with_mtp_targets  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.train.step import stage_loss  # noqa: E402
from tests.hf_checkpoints import assert_greedy_equals_transformers, saved_model_settings  # noqa: E402
from tests.test_hf_deepseek import _finetune_worker, _round_trip, deepseek  # noqa: E402

D, N, S, EPS = 2, 3, 16, 1e-6  # depths, main layers (SHAPE's), sequence, rms_norm_eps


def add_mtp_layers(model, folder, depths=D, seed=5):
    """Rewrite ``folder``'s model.safetensors with ``depths`` random MTP layers beside the main
    model's tensors, named as DeepSeek-V3's files name them; returns the MTP tensors."""
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    n, h = model.config.num_hidden_layers, model.config.hidden_size
    last = f"model.layers.{n - 1}."  # an MoE layer: its names and shapes are the decoder layer's
    extra = {}
    for k in range(depths):
        p = f"model.layers.{n + k}."
        for name, t in tensors.items():
            if not name.startswith(last):
                continue
            leaf = name[len(last):]
            if leaf.endswith("norm.weight"):
                value = 1 + 0.3 * torch.randn(t.shape, generator=g)
            elif leaf.endswith("e_score_correction_bias"):
                value = 0.1 * torch.randn(t.shape, generator=g)
            else:  # large enough that every matrix moves the losses well past the tolerance
                value = 0.15 * torch.randn(t.shape, generator=g)
            extra[p + leaf] = value.to(t.dtype)
        extra.update({p + "enorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                      p + "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                      p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
                      p + "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                      p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                      p + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file({**tensors, **extra}, str(folder / "model.safetensors"))
    return extra


def _rms(x, w):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)


def _ce(logits, targets):
    """Per-position -log softmax(logits)[target], (b, s)."""
    return -torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def reference_losses(model, folder, stream, lam):
    """(the loss, each depth's per-token losses (b, s, D) with NaN where masked) in float64 from
    the files' tensors (module docstring)."""
    files = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
    main = copy.deepcopy(model).double()
    main.set_experts_implementation("eager")  # a loop over the experts (grouped_mm has no float64)
    seen = {}
    main.model.layers[0].register_forward_pre_hook(lambda mod, args, kw: seen.update(kw), with_kwargs=True)
    tokens, labels = stream[:, :-1], stream[:, 1:]
    with torch.no_grad():
        h = main.model(tokens).last_hidden_state  # h_0, after the final norm
    # transformers' own decoder layers n.. (its MLA and MoE), loaded by transformers from the files
    blocks = folder.parent / "blocks"
    blocks.mkdir(exist_ok=True)
    config = json.load(open(folder / "config.json"))
    json.dump({**config, "num_hidden_layers": N + D}, open(blocks / "config.json", "w"))
    if not (blocks / "model.safetensors").exists():
        os.symlink(folder / "model.safetensors", blocks / "model.safetensors")
    layers = transformers.DeepseekV3ForCausalLM.from_pretrained(blocks, experts_implementation="eager").double().eval()
    layers = layers.model.layers
    s = tokens.shape[1]
    t = torch.arange(s)
    main_loss, per_token = _ce(h @ files["lm_head.weight"].T, labels).mean(), []
    for k in range(1, D + 1):
        p = f"model.layers.{N + k - 1}."
        ahead = stream[:, torch.clamp(t + k, max=s)]  # x_{t+k}; past the end: masked below
        u = torch.cat([_rms(files[p + "embed_tokens.weight"][ahead], files[p + "enorm.weight"]),
                       _rms(h, files[p + "hnorm.weight"])], -1) @ files[p + "eh_proj.weight"].T
        with torch.no_grad():
            block = layers[N + k - 1](u, attention_mask=seen["attention_mask"], position_ids=seen["position_ids"],
                                      position_embeddings=seen["position_embeddings"])
        h = _rms(block, files[p + "shared_head.norm.weight"])
        valid = t + k + 1 <= s
        target = stream[:, torch.clamp(t + k + 1, max=s)]
        per_token.append(torch.where(valid, _ce(h @ files[p + "shared_head.head.weight"].T, target), torch.nan))
    per_token = torch.stack(per_token, -1)
    return main_loss + lam / D * per_token.nanmean((0, 1)).sum(), per_token


def test_mtp_layers_come_in_with_the_reference_loss_and_go_out_bit_equal(tmp_path, capsys):
    """Two MTP depths: imported as --mtp-num-layers 2, megalite's fp32 loss (the model, then the
    train step's loss rule) within 1e-6 of the float64 reference, each depth's per-token losses
    within 1e-5; greedy generation (the main model) still transformers'; the export
    writes every tensor back bit for bit (the MTP layers and their embedding / head copies too) and
    num_nextn_predict_layers 2."""
    model = deepseek(tmp_path, num_mtp_layers=D)
    source = {**load_file(str(tmp_path / "hf" / "model.safetensors")), **add_mtp_layers(model, tmp_path / "hf")}
    capsys.readouterr()
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), progress=False)
    assert "note" not in capsys.readouterr().err
    assert saved_model_settings(tmp_path / "ckpt")["mtp_num_layers"] == D

    megalite = load_serial_model(str(tmp_path / "ckpt"))
    stream = torch.randint(0, 1000, (2, S + 1), generator=torch.Generator().manual_seed(4))
    batch = with_mtp_targets({"tokens": stream[:, :-1], "labels": stream[:, 1:], "loss_mask": torch.ones(2, S)}, D)
    with torch.no_grad():
        out = megalite(batch["tokens"], labels=batch["labels"], mtp_labels=batch["mtp_labels"])
        loss = stage_loss(out, batch)
    lam = megalite.cfg.mtp_loss_scaling_factor
    want, want_tokens = reference_losses(model, tmp_path / "hf", stream, lam)
    valid = ~want_tokens.isnan()
    assert torch.equal(valid, batch["mtp_loss_mask"].bool())
    token_error = (out.mtp.double() - want_tokens)[valid].abs().max().item()
    loss_error = abs(loss.item() - want.item()) / want.item()
    print(f"MTP import vs float64 reference: loss {loss_error:.1e} relative, per-token depth losses {token_error:.1e}")
    assert loss_error < 1e-6 and token_error < 1e-5, (loss.item(), want.item(), token_error)

    # generation reads the main model only: transformers' tokens
    assert_greedy_equals_transformers(model, tmp_path / "ckpt", [5, 17, 42], 6, capsys)

    config = _round_trip(model, tmp_path)  # the main model's tensors and config, through transformers
    assert config["num_nextn_predict_layers"] == D
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == set(source)
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_what_megalite_cannot_hold_is_refused_before_anything_is_written(tmp_path, capsys):
    """An MTP layer with its own output head (or embedding), MTP layers config.json does not count,
    an MTP layer without its norms: one message each, no checkpoint; config.json announcing MTP
    layers the files lack (transformers' save_pretrained): one line, imported without MTP. A
    Llama-shaped model with MTP cannot export as Llama, nor any model as GPT-2."""
    from megalite.checkpoint import hf as gpt2
    from megalite.config import ModelConfig
    from megalite.model.gpt import GPTModel

    model = deepseek(tmp_path, num_mtp_layers=1)
    capsys.readouterr()
    import_hf(str(tmp_path / "hf"), str(tmp_path / "plain"), progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_nextn_predict_layers 1 but the files hold no model.layers.3.*" in err[0], err
    assert saved_model_settings(tmp_path / "plain")["mtp_num_layers"] is None

    good = add_mtp_layers(model, tmp_path / "hf", depths=1)
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    config = json.load(open(tmp_path / "hf" / "config.json"))
    head = "model.layers.3.shared_head.head.weight"
    for change, extra, message in [
            ({}, {head: good[head] + 1e-3}, "model.layers.3.shared_head.head.weight differs from lm_head.weight"),
            ({}, {"model.layers.3.embed_tokens.weight": good[head]}, "embed_tokens.weight differs from "
                                                                      "model.embed_tokens.weight"),
            ({"num_nextn_predict_layers": 2}, {}, r"num_nextn_predict_layers 2: the files hold the multi-token"),
            ({}, {"model.layers.5.enorm.weight": good["model.layers.3.enorm.weight"]}, r"model.layers.\{3,5\}"),
            ({}, {"model.layers.3.hnorm.weight": None}, r"lacks \['model.layers.3.hnorm.weight'\]")]:
        folder = tmp_path / "bad"
        folder.mkdir(exist_ok=True)
        json.dump({**config, **change}, open(folder / "config.json", "w"))
        changed = {**tensors, **extra}
        save_file({k: v for k, v in changed.items() if v is not None}, str(folder / "model.safetensors"))
        with pytest.raises(UnsupportedModel, match=message):
            import_hf(str(folder), str(tmp_path / "x"), progress=False)
        assert not (tmp_path / "x").exists()

    llama = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                        position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                        untie_embeddings_and_output_weights=True, mtp_num_layers=1)
    save_weights_checkpoint(str(tmp_path / "llama"), GPTModel(llama))
    with pytest.raises(UnsupportedModel, match="multi-token prediction \\(--mtp-num-layers 1\\): Llama"):
        export_hf(str(tmp_path / "llama"), str(tmp_path / "llama-out"), progress=False)
    assert not (tmp_path / "llama-out").exists()
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no place for its MTP depths"):
        gpt2.hf_config_from(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                        mtp_num_layers=1))


def _all_tensors(ckpt, vocab=1000):
    """{(kind, name): full tensor} of a megalite checkpoint, whatever layout wrote it (the
    vocabulary's rows without TP padding)."""
    reader = PieceReader(_checkpoint_dir(str(ckpt)))
    return {(kind, name): reader.full_tensor(name, kind, vocab) for kind in ("weight", "expert_bias")
            for name in reader.names(kind)}


@pytest.mark.slow  # one 4-rank world
def test_an_imported_mtp_model_trains_at_pp2_ep2_as_serially_and_exports_what_it_trained(tmp_path):
    """4 layers and one MTP depth: the imported model fine-tunes at PP2 x EP2 (the depth and its
    copy of the embedding on the last stage) as serially; the checkpoint that run saves exports,
    and importing the export gives back every tensor it trained bit for bit, the depth's moved
    expert bias and its weights included."""
    model = deepseek(tmp_path, num_hidden_layers=4, num_mtp_layers=1)
    add_mtp_layers(model, tmp_path / "hf", depths=1)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), seq_length=32, progress=False)
    serial = run_world(_finetune_worker, 1, str(tmp_path / "ckpt"), [[]])[0][0]
    pp2_ep2 = run_world(_finetune_worker, 4, str(tmp_path / "ckpt"),
                        [["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                          "--save", str(tmp_path / "tuned")]])[0][0]
    worst = max(abs(a - b) / b for pair, ref in zip(pp2_ep2, serial) for a, b in zip(pair, ref))
    print(f"imported DeepSeek-V3 with MTP at PP2 x EP2 vs serial: worst {worst:.1e}")
    assert worst < 1e-5, (pp2_ep2, serial)
    export_hf(str(tmp_path / "tuned"), str(tmp_path / "out"), progress=False)
    assert json.load(open(tmp_path / "out" / "config.json"))["num_nextn_predict_layers"] == 1
    import_hf(str(tmp_path / "out"), str(tmp_path / "again"), seq_length=32, progress=False)
    tuned, again, before = (_all_tensors(tmp_path / c) for c in ("tuned", "again", "ckpt"))
    assert set(again) == set(tuned) == set(before)
    for key, tensor in tuned.items():
        assert torch.equal(again[key], tensor), key
    bias = ("expert_bias", "mtp.layers.0.block.mlp.router.expert_bias")
    assert not torch.equal(tuned[bias], before[bias])  # the depth's routing was trained too
