"""A checkpoint records the update rule that wrote it; readers go by that record (issue 37, item 5).

- both formats write ``update_rule``: the rule's name and its state tensors (name, dtype, bytes);
- loading the optimizer state into a run with another rule is refused before any tensor is
  read, with one message naming both rules and the fix (``--finetune`` / ``--no-load-optim``);
  loading the weights only is not refused;
- a checkpoint older than the record (the key removed) loads, and reshards, as AdamW;
- rules are found by name (``"adam"``: AdamW, Megatron's ``--optimizer`` name), and the
  preflight disk check counts the rule it is given.
"""
import json
import os
import sys

import pytest
import torch

from megalite.checkpoint import CheckpointError, PieceReader, load_checkpoint, save_checkpoint, save_dcp_checkpoint
from megalite.checkpoint.rule_record import RULE_KEY, saved_kinds
from megalite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from megalite.data_parallel.update_rule import ADAMW, MASTER_KIND, RULES, UpdateRule, register_rule, rule_named
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.model.gpt import GPTModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import reshard_checkpoint  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*deprecating ShardedTensor:FutureWarning")]


class _Momentum:
    """A stand-in step with one state tensor (loading only builds it and sets its step count)."""

    def __init__(self, masters, states, decay_ranges, t):
        self.step_count = 0


MOMENTUM = UpdateRule("momentum-sgd", ("momentum",), _Momentum, state_label="momentum buffer")
SAVE = {"megalite": save_checkpoint, "torch_dcp": save_dcp_checkpoint}


def _config() -> Config:
    # A vocabulary of 128: no padding rows, so every state element survives a save and a load.
    model = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=128, seq_length=8)
    train = TrainConfig(micro_batch_size=1, global_batch_size=1)
    return Config(model, ParallelConfig(), train, DataConfig(mock_data=True))


def _optimizer(config, rule=ADAMW, seed=3):
    model = GPTModel(config.model)
    model.init_weights(seed)
    opt = DistributedOptimizer([model], config.train, None, rule=rule)
    for i, shards in enumerate(opt.state.values()):  # state that differs from the weights and from zero
        for shard in shards:
            shard.copy_(torch.arange(shard.numel()) * (i + 1) / shard.numel())
    return opt


def _save(tmp_path, fmt, rule=ADAMW) -> str:
    config = _config()
    root = str(tmp_path / f"{fmt}-{rule.name}")
    SAVE[fmt](root, 5, _optimizer(config, rule), None, config, None, consumed_samples=5)
    return root


def _metadata_path(root) -> str:
    return os.path.join(root, "iter_0000005", "metadata.json")


@pytest.mark.parametrize("fmt", ["megalite", "torch_dcp"])
def test_the_rule_is_recorded_and_another_rule_is_refused(tmp_path, fmt):
    root = _save(tmp_path, fmt)
    meta = json.load(open(_metadata_path(root)))
    assert meta[RULE_KEY] == {"name": "adamw", "state": [
        {"name": "exp_avg", "dtype": "float32", "bytes_per_parameter": 4},
        {"name": "exp_avg_sq", "dtype": "float32", "bytes_per_parameter": 4}]}
    config = _config()
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(root, _optimizer(config, MOMENTUM), None, config, None)
    message = str(refused.value)
    for words in ("'adamw' (state: exp_avg, exp_avg_sq)", "'momentum-sgd' (state: momentum)", "--finetune",
                  "--no-load-optim", "start a fresh optimizer"):
        assert words in message, message
    for weights_only in ({"load_optimizer": False}, {"finetune": True}):  # a fresh optimizer: no refusal
        opt = _optimizer(config, MOMENTUM, seed=9)
        load_checkpoint(root, opt, None, config, None, **weights_only)
        assert all(not s.any() for s in opt.state["momentum"]) and opt.step_count == 0
        assert torch.equal(opt.master[0], _optimizer(config).master[0])
    opt = _optimizer(config, seed=9)  # the same rule: the state comes back
    for shards in opt.state.values():
        for shard in shards:
            shard.zero_()
    load_checkpoint(root, opt, None, config, None)
    assert all(torch.equal(a, b) for a, b in zip(opt.state["exp_avg_sq"], _optimizer(config).state["exp_avg_sq"]))


@pytest.mark.parametrize("fmt", ["megalite", "torch_dcp"])
def test_a_checkpoint_without_the_record_is_adamw(tmp_path, fmt):
    root = _save(tmp_path, fmt)
    path = _metadata_path(root)
    meta = json.load(open(path))
    del meta[RULE_KEY]  # as the format wrote it before the record
    json.dump(meta, open(path, "w"))
    assert saved_kinds(meta) == ADAMW.checkpoint_kinds
    config = _config()
    opt = _optimizer(config, seed=9)
    load_checkpoint(root, opt, None, config, None)
    assert all(torch.equal(a, b) for a, b in zip(opt.state["exp_avg"], _optimizer(config).state["exp_avg"]))
    with pytest.raises(CheckpointError, match="'adamw'"):
        load_checkpoint(root, _optimizer(config, MOMENTUM), None, config, None)
    out = reshard_checkpoint.reshard(root, str(tmp_path / "moved"), to_format="megalite")
    assert {kind for _, kind in PieceReader(out).index} == set(ADAMW.checkpoint_kinds)
    assert json.load(open(os.path.join(out, "metadata.json")))[RULE_KEY] == ADAMW.record()


@pytest.mark.parametrize("to_format", ["megalite", "torch_dcp"])
def test_reshard_carries_the_recorded_rule(tmp_path, to_format):
    """A checkpoint of a one-state rule reshards (either target format) with that state only,
    and the result loads under that rule with the same state."""
    root = _save(tmp_path, "megalite", MOMENTUM)
    out = reshard_checkpoint.reshard(root, str(tmp_path / "moved"), to_format=to_format)
    assert json.load(open(os.path.join(out, "metadata.json")))[RULE_KEY] == MOMENTUM.record()
    config = _config()
    opt = _optimizer(config, MOMENTUM, seed=9)
    for shard in opt.state["momentum"]:
        shard.zero_()
    load_checkpoint(out, opt, None, config, None)
    assert all(torch.equal(a, b) for a, b in zip(opt.state["momentum"], _optimizer(config, MOMENTUM).state["momentum"]))
    if to_format == "megalite":
        assert {kind for _, kind in PieceReader(out).index} == {MASTER_KIND, "momentum"}


def test_rules_are_found_by_name():
    assert rule_named("adam") is ADAMW and rule_named("adamw") is ADAMW and RULES["adam"] is ADAMW
    with pytest.raises(ValueError, match="unknown update rule 'sgd'.*adam"):
        rule_named("sgd")
    with pytest.raises(ValueError, match="taken"):
        register_rule("adam", MOMENTUM)
    try:
        assert register_rule("momentum-test", MOMENTUM) is MOMENTUM and rule_named("momentum-test") is MOMENTUM
    finally:
        RULES.pop("momentum-test")


def test_preflight_counts_the_rule_it_is_given(tmp_path, monkeypatch):
    from megalite.train import preflight

    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: type("U", (), {"free": 0})())
    with pytest.raises(CheckpointError, match=r"1,000 parameters x 12 bytes: fp32 weights and two Adam moments"):
        preflight.check_save_location(str(tmp_path), 1000)
    with pytest.raises(CheckpointError, match=r"1,000 parameters x 8 bytes: fp32 weights and one momentum buffer"):
        preflight.check_save_location(str(tmp_path), 1000, MOMENTUM)


PRETRAIN = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--log-interval", "100"]


def _pretrain(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return [r["iteration"] for r in pretrain(argv)]


def test_pretrain_load_refuses_another_rule_in_one_line(tmp_path, capsys):
    """pretrain_gpt.py --load of a checkpoint another rule wrote: exit 2, one line naming both
    rules and the fix; --no-load-optim and --finetune take its weights and train."""
    from megalite.train.pretrain import main
    from megalite.testing import run_world

    run_world(_pretrain, 1, PRETRAIN + ["--train-iters", "1", "--save", str(tmp_path)])
    path = os.path.join(tmp_path, "iter_0000001", "metadata.json")
    meta = json.load(open(path))
    meta[RULE_KEY] = MOMENTUM.record()  # as if a momentum-sgd run had written it
    json.dump(meta, open(path, "w"))
    capsys.readouterr()
    assert main(PRETRAIN + ["--train-iters", "2", "--load", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "update rule 'momentum-sgd' (state: momentum)" in err[0], err
    assert "this run steps with 'adamw'" in err[0] and "--finetune or --no-load-optim" in err[0], err
    for fresh in (["--no-load-optim"], ["--finetune"]):
        assert run_world(_pretrain, 1, PRETRAIN + ["--train-iters", "2", "--load", str(tmp_path), *fresh])[0]
