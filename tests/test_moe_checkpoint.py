"""MoE checkpoints name experts globally, so they load under any expert-parallel size.

Trained at EP4 (DP4, ZeRO-1) through pretrain_gpt's entry point and saved; then:
- the serial model loaded from it, and from its reshard to EP2 / EP1, gives the same logits;
- training resumed at EP2 (ZeRO-0), serially, and from the EP2 reshard continues exactly as
  it does at EP4 (losses to 1e-5): weights and Adam moments of every expert were re-cut.
"""
import json
import os
import sys

import pytest
import torch

from megalite.checkpoint import PieceReader, load_serial_model
from megalite.testing import run_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from reshard_checkpoint import reshard  # noqa: E402

BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "100", "--adam-eps", "1e-5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--swiglu", "--disable-bias-linear",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
        "--moe-aux-loss-coeff", "1e-2"]


def _run(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"], r["moe_aux_loss"]) for r in pretrain(argv)]


def _logits(path):
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return load_serial_model(str(path))(tokens)


def test_ep4_checkpoint_loads_at_ep2_and_serially(tmp_path):
    src = tmp_path / "ep4"
    run_world(_run, 4, BASE + ["--expert-model-parallel-size", "4", "--use-distributed-optimizer",
                               "--train-iters", "3", "--save", str(src)])
    reader = PieceReader(str(src / "iter_0000003"))
    names = reader.names()
    assert "layers.1.mlp.experts.3.fc2.weight" in names and "layers.0.mlp.router.weight" in names
    assert not any(n.endswith("experts.w1") for n in names)  # stacked tensors never reach the file
    ref = _logits(src)
    for ep in (2, 1):
        dst = tmp_path / f"ep{ep}"
        reshard(str(src), str(dst), 1, 1, None, 4 // ep if ep > 1 else 1, 1, ep=ep)
        assert torch.allclose(_logits(dst), ref, rtol=1e-6, atol=1e-6)
    meta = json.loads((tmp_path / "ep2" / "iter_0000003" / "metadata.json").read_text())
    assert meta["layout"]["ep"] == 2

    args = BASE + ["--train-iters", "6"]
    same = run_world(_run, 4, args + ["--expert-model-parallel-size", "4", "--use-distributed-optimizer",
                                      "--load", str(src)])[0]
    runs = {"EP2 re-cut at load": run_world(_run, 2, args + ["--expert-model-parallel-size", "2",
                                                             "--load", str(src)])[0],
            "serial": run_world(_run, 1, args + ["--load", str(src)])[0],
            "EP2 reshard": run_world(_run, 2, args + ["--expert-model-parallel-size", "2",
                                                      "--use-distributed-optimizer", "--load",
                                                      str(tmp_path / "ep2")])[0]}
    assert [r[0] for r in same] == [4, 5, 6]
    for name, run in runs.items():
        for a, b in zip(run, same):
            assert a[0] == b[0] and abs(a[1] - b[1]) / b[1] < 1e-5 and abs(a[2] - b[2]) < 1e-5, (name, run, same)


def test_dense_flags_against_moe_checkpoint_are_refused(tmp_path):
    src = tmp_path / "moe"
    run_world(_run, 1, BASE + ["--train-iters", "1", "--save", str(src)])
    i = BASE.index("--num-experts")
    argv = BASE[:i] + BASE[i + 2:] + ["--num-experts", "8", "--train-iters", "2", "--load", str(src)]
    with pytest.raises(Exception, match="--num-experts: the checkpoint has 4, the command line gives 8"):
        run_world(_run, 1, argv)


def test_hf_export_of_gpt2_style_moe_checkpoint_is_refused(tmp_path):
    from megalite.checkpoint import CheckpointError
    from megalite.checkpoint.convert import export_hf

    src = tmp_path / "moe"
    run_world(_run, 1, BASE + ["--train-iters", "1", "--save", str(src)])
    with pytest.raises(CheckpointError, match="GPT-2-style mixture-of-experts checkpoint .4 experts.*Fix: load it"):
        export_hf(str(src), str(tmp_path / "hf"), progress=False)
    assert not (tmp_path / "hf").exists()
