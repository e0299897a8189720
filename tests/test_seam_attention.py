"""Proof of the model-part seam (issue 37, item 7, attention half).

A scaled-cosine attention (defined and registered in tests/test_seams_proof.py alone): q and k are
L2-normalised per head, and the logits are ``tau exp(g_h) cos(q_h, k)`` with a learned log-gain ``g`` per head
(split over TP with its heads). Nothing in megalite names it; the tests show that it trains under
TP 2 x PP 2 and DP 2 ZeRO-1 as serially, that a checkpoint of it reshards to another layout and
resumes equal, and that the planner's parameters, memory and FLOPs for it are the model's and
the dry run's.

Which attention a config picks: the setting ``ModelConfig.attention_kind`` (no flag yet): a config
built here names it, and pretrain (in the forked ranks of ``run_world``, and the dry run's) is
handed it beside its flags (``pretrain(argv, flagless)``). The part is defined once, in
tests/test_seams_proof.py, which registers it.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from megalite.config import ModelConfig
from megalite.model.attention import SelfAttention
from megalite.model.counting import flops_per_token, total_parameters
from megalite.model.gpt import GPTModel, count_parameters
from megalite.model.parts import ATTENTIONS
from megalite.testing import run_world
from tests.test_seams_proof import ScaledCosineAttention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from reshard_checkpoint import reshard  # noqa: E402

COSINE = {"model": {"attention_kind": "scaled_cosine"}}  # the setting pretrain is handed beside its flags


BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100",
        "--adam-eps", "1e-5", "--hidden-dropout", "0", "--attention-dropout", "0"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DP2_ZERO1 = ["--use-distributed-optimizer"]


def _run(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in pretrain(argv, COSINE)]


def _close(a, b, rtol=1e-5):
    assert [x[0] for x in a] == [x[0] for x in b]
    for x, y in zip(a, b):
        assert abs(x[1] - y[1]) <= rtol * abs(y[1]) and abs(x[2] - y[2]) <= rtol * abs(y[2]), (x, y)


def test_the_registered_attention_is_the_one_built():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16,
                      hidden_dropout=0.0, attention_dropout=0.0, attention_kind="scaled_cosine")
    assert ATTENTIONS["scaled_cosine"] is ScaledCosineAttention
    model = GPTModel(cfg)
    assert all(type(layer.attn) is ScaledCosineAttention for layer in model.layers.values())
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.attn.log_gain", "layers.1.attn.log_gain"} <= names
    plain_cfg = ModelConfig(**{f: getattr(cfg, f) for f in ModelConfig.__dataclass_fields__})
    plain_cfg.attention_kind = "self"  # this one config picks softmax attention again
    plain = GPTModel(plain_cfg)
    assert all(type(layer.attn) is SelfAttention for layer in plain.layers.values())
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (model, plain):
        m.init_weights(1)
        losses.append(m(tokens, labels=tokens).mean())
    assert abs(losses[0].item() - losses[1].item()) > 1e-3  # same weights, other scores
    losses[0].backward()
    assert model.layers["0"].attn.log_gain.grad.abs().sum() > 0


def test_the_parts_shape_is_the_models():
    """Parameters counted from the parts' shapes equal the built model's; FLOPs per token count
    the log-gains (6 per parameter) and the same attention FLOPs as softmax attention."""
    for kw in (dict(), dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                            num_query_groups=2, add_bias_linear=False, untie_embeddings_and_output_weights=True)):
        cfg = ModelConfig(num_layers=3, hidden_size=48, num_attention_heads=4, vocab_size=100, seq_length=32,
                          attention_kind="scaled_cosine", **kw)
        assert total_parameters(cfg) == count_parameters(cfg)
        L, h, s, n = cfg.num_layers, cfg.hidden_size, cfg.seq_length, count_parameters(cfg)
        assert flops_per_token(cfg) == 6 * n + 12 * L * h * s


def _planned_and_measured(flags, kind):
    from megalite.arguments import build_parser, config_from_args
    from megalite.config import validate
    from megalite.parallel.grid import GridLayout
    from tools.dry_run import measure_layout

    config = config_from_args(build_parser().parse_args(flags), 1000)  # --vocab-size
    config.model.attention_kind = kind
    validate(config, 8, 8)
    layout = GridLayout.from_config(config.parallel, 8)
    return config, list(measure_layout(flags, config, layout, 8))


DRY = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
       "--max-position-embeddings", "1024", "--vocab-size", "1000", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
       "--use-distributed-optimizer", "--lr", "1e-4", "--mock-data"]


@pytest.mark.parametrize("positions", [[], ["--position-embedding-type", "rope"]])
def test_planner_memory_matches_the_dry_run(positions):
    """One rank per pipeline stage of TP 2 x PP 2 x DP 2 (ZeRO-1), on meta, with softmax and with
    scaled-cosine attention: the weights the planner counts from the parts' shapes are what the
    model holds, to the byte, and the activations the cosine part says it adds (its
    ``activation_bytes``) are what the dry run measures it adding, within 3%; the planner's total
    is as close to the measured peak as for softmax attention."""
    runs = {}
    for kind in ("self", "scaled_cosine"):
        runs[kind] = _planned_and_measured(DRY + positions, kind)[1]
    for plain, cos in zip(runs["self"], runs["scaled_cosine"]):
        for role in (plain, cos):
            assert role["categories"]["parameters"] == role["planned_categories"]["weights"], role["role"]
        measured = cos["categories"]["activations"] - plain["categories"]["activations"]
        planned = cos["planned_categories"]["activations"] - plain["planned_categories"]["activations"]
        assert planned > 0 and abs(measured - planned) / planned < 0.03, (cos["role"], measured, planned)
        assert abs(cos["difference"]) <= abs(plain["difference"]) + 0.01, (cos["difference"], plain["difference"])


@pytest.mark.slow
def test_tp2_pp2_and_dp2_zero1_equal_serial():
    argv = BASE + ["--train-iters", "4"]
    serial = run_world(_run, 1, argv)[0]
    _close(run_world(_run, 4, argv + TP2_PP2)[0], serial)
    _close(run_world(_run, 2, argv + DP2_ZERO1)[0], serial)


@pytest.mark.slow
def test_save_reshard_resume_continues_equal(tmp_path):
    """Saved under TP 2 x PP 2 after 3 iterations, resharded to one rank (PP 1) and to TP 1 x PP 4;
    each resumes to iteration 6 as the TP 2 x PP 2 run resumed from the saved checkpoint does."""
    src = tmp_path / "tp2pp2"
    run_world(_run, 4, BASE + TP2_PP2 + ["--train-iters", "3", "--save", str(src)])
    same = run_world(_run, 4, BASE + TP2_PP2 + ["--train-iters", "6", "--load", str(src)])[0]
    for tp, pp, flags in ((1, 1, []), (1, 4, ["--pipeline-model-parallel-size", "4"])):
        dst = tmp_path / f"tp{tp}pp{pp}"
        reshard(str(src), str(dst), tp, pp, None, 1, 0)
        _close(run_world(_run, tp * pp, BASE + flags + ["--train-iters", "6", "--load", str(dst)])[0], same)
