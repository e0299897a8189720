"""Proof of the two seams (issue 37, item 7): a new attention and a new update rule, written in
this file alone and picked through the settings ``ModelConfig.attention_kind`` (no flag) and
``TrainConfig.optimizer`` (``--optimizer NAME``, Megatron's flag: a rule registered in code is
picked by its name like the built-in ones).

- **Scaled-cosine attention** (``attention_kind="scaled_cosine"``): q and k L2-normalised per
  head, logits ``tau exp(g_h) cos(q_h, k)`` with a learned log-gain ``g`` per head (split over TP
  with its heads).
- **Signum** (``optimizer="signum"``): sign-SGD with momentum, one fp32 state tensor ``m`` per
  parameter; for gradient ``g`` (divided by the clip coefficient), learning rate ``lr`` and decay
  ``wd`` (0 on biases and norm weights)::

      w <- w (1 - lr wd);   m <- beta m + (1 - beta) g;   w <- w - lr sign(m)

Neither name appears in megalite. A config (or a dry run of one, ``tools/dry_run.measure_layout``,
or ``pretrain(argv + ["--optimizer", "signum"], flagless)``) that names them gets them, with
nothing of megalite patched:

- fast: the attention setting has no flag, the rule's is ``--optimizer``; validate() refuses an unknown name with the registered ones;
  a checkpoint without ``attention_kind`` loads as "self"; the planner's weights, optimizer state
  (master + momentum, 8 bytes per parameter) and FLOPs per token equal a meta dry run of the
  pretrain path with both parts plugged in;
- slow (multi-process): TP 2 x PP 2 and DP 2 ZeRO-1 train equal to serial, losses and weights;
  a TP 2 x PP 2 checkpoint resharded (tools/reshard_checkpoint) to DP 2 ZeRO-1 and to PP 4
  resumes equal to the run that resumes where it was saved.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalite.arguments import build_parser, config_from_args
from megalite.checkpoint.core import check_config
from megalite.checkpoint.format import CheckpointError, PieceReader, resolve_checkpoint
from megalite.checkpoint.serial import model_config_from
from megalite.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, validate
from megalite.data_parallel.update_rule import MASTER_KIND, RULES, DeviceStepCount, UpdateRule, register_rule, rule_named
from megalite.flag_spec import set_flagless
from megalite.model.attention import SelfAttention
from megalite.model.counting import flops_per_token
from megalite.model.gpt import GPTModel, count_parameters
from megalite.model.parts import attention_names, register_attention
from megalite.parallel import comm
from megalite.parallel.grid import GridLayout
from megalite.parallel.sharding import TPSplit, mark_tensor_parallel
from megalite.testing import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools import dry_run, reshard_checkpoint  # noqa: E402

TAU = 10.0  # the logits' scale at g = 0: cosines in [-1, 1] would give a flat softmax
BETA = 0.9


class ScaledCosineAttention(SelfAttention):
    """Self-attention whose scores are ``tau exp(g_h) cos(q_h, k)``: q and k normalised per head,
    a learned log-gain ``g`` per query head (``log_gain``, split over TP with the heads)."""

    def __init__(self, cfg, tp_group=None, sequence_parallel: bool = False, cp_group=None,
                 cp_hierarchy: tuple = (None, None)):
        super().__init__(cfg, tp_group, sequence_parallel, cp_group, cp_hierarchy)
        tp, rank, heads = comm.group_size(tp_group), comm.group_rank(tp_group), cfg.num_attention_heads
        self.log_gain = nn.Parameter(torch.empty(heads // tp))
        mark_tensor_parallel(self.log_gain, (heads,), TPSplit(0), rank, tp)

    def score_inputs(self, q, k):
        # attention() divides the logits by sqrt(d): fold it into q's gain.
        gain = self.log_gain.exp().view(1, -1, 1, 1) * (TAU * math.sqrt(self.cfg.head_dim))
        return F.normalize(q, dim=-1) * gain, F.normalize(k, dim=-1)

    @classmethod
    def extra_parameters(cls, m):
        return m.num_attention_heads, 0  # log_gain: one per head, split over TP

    @classmethod
    def activation_bytes(cls, m, s, b, act_bytes, recompute="none", flash_attention=False):
        """SelfAttention's, plus what the normalisation keeps: the normalised q (1 s b h) and the
        division's inputs, q and k: with rotary positions new tensors (1 + groups/heads), else
        views that keep the whole fused qkv alive (1 + 2 groups/heads)."""
        replicated, split, scores = super().activation_bytes(m, s, b, act_bytes, recompute, flash_attention)
        kv = m.num_query_groups / m.num_attention_heads
        inputs = 1 + (kv if m.position_embedding_type == "rope" else 2 * kv)
        return replicated, split + act_bytes * s * b * m.hidden_size * (1 + inputs), scores


class FlatSignum(DeviceStepCount):
    """The rule's step on flat fp32 shards (the seam's interface: ``step``; the step counter
    ``step_count`` comes from the base). ``found_inf`` skips the update on the device, as
    AdamW's fused kernel does."""

    def __init__(self, masters, states, decay_ranges, t: TrainConfig):
        super().__init__(masters)
        self.masters, self.momentum, self.weight_decay = masters, states["momentum"], t.weight_decay
        self.decayed = []
        for master, ranges in zip(masters, decay_ranges):
            mask = torch.zeros(master.numel(), device=master.device)
            for a, z in ranges:
                mask[a:z] = 1.0
            self.decayed.append(mask)

    @torch.no_grad()
    def step(self, grads, lr, grad_scale=None, found_inf=None) -> None:
        keep = torch.ones((), device=self.steps.device) if found_inf is None else (found_inf == 0).float()
        for w, m, g, decayed in zip(self.masters, self.momentum, grads, self.decayed):
            g = g.float() if grad_scale is None else g.float() / grad_scale
            new_m = BETA * m + (1 - BETA) * g
            new_w = w * (1 - lr * self.weight_decay * decayed) - lr * torch.sign(new_m)
            m.copy_(torch.where(keep > 0, new_m, m))
            w.copy_(torch.where(keep > 0, new_w, w))
        self.steps += keep


SIGNUM = UpdateRule("signum", ("momentum",), FlatSignum, state_label="momentum buffer")

register_attention("scaled_cosine", ScaledCosineAttention)
register_rule("signum", SIGNUM)

PICKED = {"model": {"attention_kind": "scaled_cosine"}}  # the settings without a flag that pick the parts
RULE = ["--optimizer", "signum"]  # the rule's flag


def picked(config: Config) -> Config:
    """``config`` with both new parts chosen through their settings."""
    for section, values in PICKED.items():
        for name, value in values.items():
            setattr(getattr(config, section), name, value)
    config.train.optimizer = "signum"
    return config


# -- fast: the settings, validate, old checkpoints --------------------------------------------------

def test_the_settings_default_to_megatrons_parts_and_the_flag_picks_a_registered_rule():
    options = {o for action in build_parser()._actions for o in action.option_strings}
    assert "--attention-kind" not in options and "--optimizer" in options
    config = config_from_args(build_parser().parse_args(["--mock-data"]), 100)
    assert (config.model.attention_kind, config.train.optimizer) == ("self", "adam")
    assert rule_named(config.train.optimizer).name == "adamw"
    config = config_from_args(build_parser().parse_args(["--mock-data"] + RULE), 100)
    assert rule_named(config.train.optimizer) is SIGNUM


def test_only_a_setting_without_a_flag_is_handed_beside_the_flags():
    """``pretrain(argv, flagless)`` and the dry run hand on exactly the settings no flag sets;
    one a flag sets stays the command line's."""
    config = picked(Config())
    assert dry_run.flagless_settings(config) == PICKED
    with pytest.raises(KeyError, match="num_layers is not a setting without a flag"):
        set_flagless(config.model, {"num_layers": 3})


def test_the_settings_pick_the_registered_parts():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16,
                      attention_kind="scaled_cosine")
    model = GPTModel(cfg)
    assert all(type(layer.attn) is ScaledCosineAttention for layer in model.layers.values())
    plain = GPTModel(dataclasses.replace(cfg, attention_kind="self"))
    assert all(type(layer.attn) is SelfAttention for layer in plain.layers.values())
    assert rule_named(TrainConfig(optimizer="signum").optimizer) is SIGNUM


@pytest.mark.parametrize("section, name, fix", [("model", "attention_kind", "ModelConfig.attention_kind"),
                                               ("train", "optimizer", "TrainConfig.optimizer")])
def test_validate_refuses_an_unknown_name(section, name, fix):
    config = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                                      seq_length=16), data=DataConfig(mock_data=True))
    validate(picked(config))  # both new names are known
    setattr(getattr(config, section), name, "no_such_part")
    with pytest.raises(ConfigError) as e:
        validate(config)
    message, registered = str(e.value), attention_names() if section == "model" else sorted(RULES)
    assert {"scaled_cosine", "signum"} & set(registered)  # the names this file registered are listed
    assert "'no_such_part'" in message and ", ".join(registered) in message and f"Fix: set {fix}" in message, message


def test_a_checkpoint_without_attention_kind_loads_as_self():
    """A checkpoint written before the setting (no key in its model config) is softmax attention:
    the load check accepts it for a "self" run and refuses it for a scaled-cosine one; offline tools
    build it as "self"; a checkpoint that names the kind is built with it."""
    run = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16)
    old = dataclasses.asdict(run)
    del old["attention_kind"]
    check_config(old, run)
    with pytest.raises(CheckpointError, match="attention_kind: checkpoint 'self', run 'scaled_cosine'"):
        check_config(old, dataclasses.replace(run, attention_kind="scaled_cosine"))
    assert model_config_from(old).attention_kind == "self"
    assert model_config_from({**old, "attention_kind": "scaled_cosine"}).attention_kind == "scaled_cosine"


# -- fast: the planner against a meta dry run of the pretrain path ----------------------------------

DRY = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
       "--max-position-embeddings", "256", "--vocab-size", "1000", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
       "--use-distributed-optimizer", "--lr", "1e-4", "--mock-data"]


def _dry_run(config):
    validate(config, 8, 8)
    argv = DRY + (RULE if config.train.optimizer == "signum" else [])  # the rule by its flag, the attention flagless
    return list(dry_run.measure_layout(argv, config, GridLayout.from_config(config.parallel, 8), 8))


def test_the_planner_counts_both_parts_as_a_meta_dry_run_holds_them():
    """TP 2 x PP 2 x DP 2 (ZeRO-1), one rank per pipeline stage, on meta: with both parts picked,
    the weights the planner counts from the parts' shapes and the optimizer state it counts from
    the rule (master + momentum, 8 bytes per parameter over DP) are what the pretrain path holds,
    to the byte; the log-gains are weights softmax attention has not, and the optimizer state is
    8/12 of AdamW's. FLOPs per token: 6 per parameter of the built model plus softmax attention's."""
    plain = config_from_args(build_parser().parse_args(DRY), 1000)
    both = picked(config_from_args(build_parser().parse_args(DRY), 1000))
    for (p, b) in zip(_dry_run(plain), _dry_run(both)):
        for role in (p, b):
            assert role["categories"]["parameters"] == role["planned_categories"]["weights"], role["role"]
            assert role["categories"]["optimizer state"] == role["planned_categories"]["master_and_optimizer"]
        assert b["categories"]["parameters"] > p["categories"]["parameters"]  # the log-gains
        for role, rule_bytes in ((p, 12), (b, 8)):  # per parameter (bf16 weights: 2 bytes), over DP 2
            assert role["categories"]["optimizer state"] * 2 == rule_bytes * role["categories"]["parameters"] // 2
    m = both.model
    assert flops_per_token(m) == 6 * count_parameters(m) + 12 * m.num_layers * m.hidden_size * m.seq_length
    assert flops_per_token(m) - flops_per_token(plain.model) == 6 * m.num_layers * m.num_attention_heads


# -- slow: training, saving, resharding, resuming ---------------------------------------------------

BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100",
        "--weight-decay", "0.1", "--clip-grad", "0.5", "--hidden-dropout", "0", "--attention-dropout", "0"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DP2_ZERO1 = ["--use-distributed-optimizer"]
TOL = 1e-5


def _run(rank, world, argv, flagless=PICKED):
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in pretrain(argv + RULE, flagless)]


def _resume_naming_only_the_rule(rank, world, argv):
    """A resume that does not name the attention: ``--load`` adopts it from the checkpoint (a fixed setting)."""
    return _run(rank, world, argv, {})


def _close(a, b, rtol=TOL):
    assert [x[0] for x in a] == [x[0] for x in b]
    for x, y in zip(a, b):
        assert abs(x[1] - y[1]) <= rtol * abs(y[1]) and abs(x[2] - y[2]) <= rtol * abs(y[2]), (x, y)


def _weights(root) -> dict[str, torch.Tensor]:
    """The full fp32 master weights of the newest checkpoint under ``root``, by name."""
    reader = PieceReader(resolve_checkpoint(str(root)))
    return {n: reader.full_tensor(n, MASTER_KIND, 300) for n in reader.names(MASTER_KIND)}


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        err = ((a[name] - b[name]).abs().max() / b[name].abs().max()).item()
        assert err < TOL, (name, err)


@pytest.mark.slow
def test_tp2_pp2_and_dp2_zero1_equal_serial(tmp_path):
    argv = BASE + ["--train-iters", "4"]
    serial = run_world(_run, 1, argv + ["--save", str(tmp_path / "serial")])[0]
    reader = PieceReader(resolve_checkpoint(str(tmp_path / "serial")))
    assert {kind for _, kind in reader.index} == {MASTER_KIND, "momentum"}  # the rule's one state tensor
    assert any(n.endswith("attn.log_gain") for n in reader.names(MASTER_KIND))  # the attention's weights
    for world, flags, name in ((4, TP2_PP2, "tp2pp2"), (2, DP2_ZERO1, "dp2")):
        _close(run_world(_run, world, argv + flags + ["--save", str(tmp_path / name)])[0], serial)
        _same_weights(_weights(tmp_path / name), _weights(tmp_path / "serial"))


@pytest.mark.slow
def test_save_reshard_resume_continues_equal(tmp_path):
    """Saved under TP 2 x PP 2 after 3 iterations, resharded to DP 2 ZeRO-1 and to TP 1 x PP 4
    (the momentum carried); each resumes to iteration 6 as the TP 2 x PP 2 run resumed does, and
    so does a resume that names only the rule (the checkpoint fixes the attention)."""
    src = tmp_path / "tp2pp2"
    run_world(_run, 4, BASE + TP2_PP2 + ["--train-iters", "3", "--save", str(src)])
    same = run_world(_run, 4, BASE + TP2_PP2 + ["--train-iters", "6", "--load", str(src)])[0]
    _close(run_world(_resume_naming_only_the_rule, 4, BASE + TP2_PP2 + ["--train-iters", "6", "--load", str(src)])[0],
           same)
    for world, tp, pp, dp, zero, flags in ((2, 1, 1, 2, 1, DP2_ZERO1),
                                           (4, 1, 4, 1, 0, ["--pipeline-model-parallel-size", "4"])):
        dst = tmp_path / f"tp{tp}pp{pp}dp{dp}"
        reshard_checkpoint.reshard(str(src), str(dst), tp=tp, pp=pp, dp=dp, zero=zero)
        _close(run_world(_run, world, BASE + flags + ["--train-iters", "6", "--load", str(dst)])[0], same)
