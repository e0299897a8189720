"""Hugging Face GPT-2 interchange: same logits both ways (skips without transformers)."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from convert_hf import export_hf, import_hf  # noqa: E402

from megalite.checkpoint import load_serial_model  # noqa: E402
from megalite.testing import run_world  # noqa: E402


def hf_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-zero biases and norms, so the mapping of every tensor is tested
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def assert_close_logits(ours, theirs):
    """Max error relative to the logits' own scale (not allclose's atol, which for logits of
    order 0.1 allowed ~1e-4 relative): measured 1.4e-7 and 2.3e-7, bound 1e-5."""
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    print(f"logits vs transformers': max |err| / max |ref| = {rel:.1e}")
    assert rel < 1e-5, rel


def test_import_gives_the_same_logits(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_serial_model(str(tmp_path / "ckpt"))(tokens)
        theirs = hf(tokens).logits
    assert_close_logits(ours, theirs)


def _train(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return pretrain(argv)


def test_export_of_a_trained_tp2_checkpoint_loads_in_transformers(tmp_path):
    argv = ["--mock-data", "--vocab-size", "97", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
            "--train-iters", "3", "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ckpt")]
    run_world(_train, 2, argv)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = load_serial_model(str(tmp_path / "ckpt"))(tokens)
        theirs = hf(tokens).logits
    assert_close_logits(ours, theirs)
