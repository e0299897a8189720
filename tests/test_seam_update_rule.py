"""Proof of the update-rule seam (issue 37, item 7): a new rule, written in tests/test_seams_proof.py
alone (registered there as "signum").

Signum (sign-SGD with momentum) keeps one fp32 state tensor per parameter, the momentum
buffer ``m``; for gradient ``g`` (divided by the clip coefficient), learning rate ``lr`` and
decay ``wd`` (0 on biases and norm weights)::

    w <- w (1 - lr wd)                   decoupled weight decay
    m <- beta m + (1 - beta) g
    w <- w - lr sign(m)

The rule is handed to ``DistributedOptimizer(rule=...)`` and nothing in megalite changes:

- TP2 x PP2 and DP2 ZeRO-1 train equal to a serial run (an independent torch.optim version
  of the same math on the whole model), losses and weights;
- the TP2 x PP2 run saves; its checkpoint holds the master weights and exactly the rule's one
  state tensor per parameter, and records the rule; ``tools/reshard_checkpoint.py`` rewrites it
  for DP2 ZeRO-1 carrying the momentum (from the checkpoint's own record); the resumed run
  continues equal to the serial one;
- the planner's bytes per parameter are the rule's (4 bytes of state + 4 of master weights),
  and its model-state estimate equals what the running optimizer allocated, to the byte, and
  what a dry run (``tools/dry_run.py``: pretrain on meta tensors, the memory tracker) of a run
  stepping with the rule holds as optimizer state.
"""
import json
import os
import sys

import pytest
import torch

from megalite.checkpoint import PieceReader, load_checkpoint, save_checkpoint, save_dcp_checkpoint
from megalite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from megalite.data_parallel.update_rule import MASTER_KIND
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.model.gpt import GPTModel
from megalite.parallel.grid import build_grid
from megalite.parallel.sharding import gather_full
from megalite.pipeline.partition import build_model_chunks
from megalite.planner import model_state_bytes, precision, stage_parameters
from megalite.testing import run_world
from megalite.train.step import LossScaler
from megalite.testing.reference_step import train_step

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.test_seams_proof import BETA, SIGNUM  # noqa: E402 - the rule, defined and registered once there
from tools import reshard_checkpoint  # noqa: E402

SAVED_AT, STEPS, MICRO, GLOBAL = 2, 4, 2, 8
TOL = 1e-5


class SerialSignum(torch.optim.Optimizer):
    """The same math with torch.optim's per-parameter loop: the serial reference."""

    def __init__(self, groups, lr):
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("momentum", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.mul_(BETA).add_(p.grad, alpha=1 - BETA)
                p.add_(torch.sign(m), alpha=-group["lr"])


def make_config(tp=1, pp=1, zero=0) -> Config:
    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
    train = TrainConfig(micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3, weight_decay=0.1, clip_grad=0.5,
                        train_iters=STEPS, zero_stage=zero)
    return Config(model, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), train,
                  DataConfig(mock_data=True))


def global_batch(cfg, step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (GLOBAL, cfg.seq_length + 1), generator=g)
    return [{"tokens": x[i:i + MICRO, :-1], "labels": x[i:i + MICRO, 1:],
             "loss_mask": torch.ones(MICRO, cfg.seq_length),
             "position_ids": torch.arange(cfg.seq_length).expand(MICRO, -1)} for i in range(0, GLOBAL, MICRO)]


def serial_run(config, steps=STEPS):
    model = GPTModel(config.model)
    model.init_weights(7)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = SerialSignum([{"params": decay, "weight_decay": config.train.weight_decay}, {"params": rest}],
                       config.train.lr)
    losses = [train_step(model, opt, global_batch(config.model, s), config.train, s, LossScaler(False)).loss
              for s in range(steps)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, case):
    """Train steps [first, last) under the case's layout with SIGNUM (loading ``load`` first,
    saving into ``save`` at the end); return losses, full weights and the optimizer's bytes."""
    config = make_config(case.get("tp", 1), case.get("pp", 1), case["zero"])
    grid = build_grid(config.parallel, world, rank)
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(7)
    opt = DistributedOptimizer(chunks, config.train, grid, stage=case["zero"], bucket_size=1500, rule=SIGNUM)
    first, last = case["steps"]
    if case.get("load"):
        meta = load_checkpoint(case["load"], opt, None, config, grid)
        assert meta["iteration"] == first and opt.step_count == first
    dp, r = grid.layout.dp, grid.dp_rank
    losses = []
    for s in range(first, last):
        mine = [m for i, m in enumerate(global_batch(config.model, s)) if i % dp == r]
        losses.append(train_step(chunks, opt, mine, config.train, s, LossScaler(False), grid).loss)
    if case.get("save"):
        save = save_dcp_checkpoint if case.get("format") == "torch_dcp" else save_checkpoint
        save(case["save"], last, opt, None, config, grid, consumed_samples=last * GLOBAL)
    params = {}
    with opt.full_weights():
        for c in chunks:
            for n, p in c.named_parameters():
                params[n] = gather_full(p.detach().float(), getattr(p, "tp_split", None), grid.tp_group).clone()
    return losses, params, grid.pp_rank, opt.memory_bytes()


def _compare(results, ref_losses, ref_params):
    """Every rank's losses (the last stage's; others report 0 or the same) and weights equal serial."""
    seen = set()
    for losses, params, _, _ in results:
        if any(losses):
            assert losses == pytest.approx(ref_losses, rel=TOL), (losses, ref_losses)
        for name, p in params.items():
            ref = ref_params[name]
            err = ((p[: ref.shape[0]] - ref).abs().max() / ref.abs().max()).item()
            assert err < TOL, (name, err)
            seen.add(name)
    assert seen == set(ref_params)


def _assert_planner_matches(results, tp, pp, dp, zero):
    """The planner, told the rule, estimates exactly the master + state bytes each rank allocated."""
    prec = precision("fp32", rule=SIGNUM)
    assert prec.optimizer_bytes == SIGNUM.bytes_per_parameter == 8 and SIGNUM.state_bytes == 4
    for _, _, stage, mem in results:
        est = model_state_bytes(stage_parameters(make_config().model, tp, pp, stage), dp, zero, prec)
        assert mem["master_weights"] + mem["optimizer_state"] == est["master_and_optimizer"]
        assert mem["optimizer_state"] * 2 == mem["master_weights"] + mem["optimizer_state"]  # 4 of 8 bytes


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.filterwarnings("ignore:.*deprecating ShardedTensor:FutureWarning")
@pytest.mark.parametrize("fmt", ["megalite", "torch_dcp"])
def test_signum_trains_saves_reshards_and_resumes_equal_to_serial(tmp_path, fmt):
    ref_losses, ref_params = serial_run(make_config())
    saved, moved = str(tmp_path / "tp2pp2"), str(tmp_path / "dp2")

    tp2pp2 = run_world(_worker, 4, {"tp": 2, "pp": 2, "zero": 0, "steps": (0, SAVED_AT), "save": saved, "format": fmt})
    _compare(tp2pp2, *serial_run(make_config(), SAVED_AT))
    assert all(r[0] == pytest.approx(ref_losses[:SAVED_AT], rel=TOL) for r in tp2pp2 if r[2] == 1)
    _assert_planner_matches(tp2pp2, 2, 2, 1, 0)

    directory = os.path.join(saved, f"iter_{SAVED_AT:07d}")
    assert json.load(open(os.path.join(directory, "metadata.json")))["update_rule"] == SIGNUM.record()
    if fmt == "torch_dcp":  # its full tensors, by megalite's names: weight/<name> and the rule's momentum/<name>
        from megalite.checkpoint.dcp_offline import read_dcp_index
        keys = {k for k in read_dcp_index(directory) if not k.startswith("rng/")}
        assert keys == {f"{kind}/{name}" for kind in (MASTER_KIND, "momentum") for name in ref_params}
        saved, directory = str(tmp_path / "megalite"), reshard_checkpoint.reshard(saved, str(tmp_path / "megalite"),
                                                                                 to_format="megalite")
    reader = PieceReader(directory)
    assert {kind for _, kind in reader.index} == {MASTER_KIND, "momentum"}  # exactly the rule's one state tensor
    assert reader.names("momentum") == reader.names(MASTER_KIND) == sorted(ref_params)

    out = reshard_checkpoint.reshard(saved, moved, tp=1, pp=1, dp=2, zero=1)
    assert {kind for _, kind in PieceReader(out).index} == {MASTER_KIND, "momentum"}
    for name in reader.names(MASTER_KIND):
        assert torch.equal(PieceReader(out).full_tensor(name, "momentum", 97), reader.full_tensor(name, "momentum", 97))

    dp2 = run_world(_worker, 2, {"zero": 1, "steps": (SAVED_AT, STEPS), "load": moved})
    _compare(dp2, ref_losses[SAVED_AT:], ref_params)
    _assert_planner_matches(dp2, 1, 1, 2, 1)


def test_dp2_zero1_from_scratch_equals_serial():
    ref_losses, ref_params = serial_run(make_config())
    results = run_world(_worker, 2, {"zero": 1, "steps": (0, STEPS)})
    _compare(results, ref_losses, ref_params)


def test_the_planner_counts_the_rule_as_a_dry_run_measures_it():
    """A dry run of one ZeRO-1 DP2 rank whose optimizer steps with SIGNUM (``--optimizer signum``,
    the name this file registers it under): the memory tracker's optimizer
    state (master weights + momentum) equals the planner's estimate for the rule, 8 bytes per
    parameter over DP (the dry run's planned column says so too), and is 8/12 of what the planner
    counts for AdamW."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.parallel.grid import GridLayout
    from megalite.planner import Layout, stage_memory
    from tools import dry_run as tool

    flags = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
             "64", "--vocab-size", "500", "--micro-batch-size", "2", "--global-batch-size", "4", "--zero-stage", "1",
             "--optimizer", "signum"]
    config = config_from_args(build_parser().parse_args(flags), 500, eod_token=tool.mock_eod(500))
    (role,) = tool.measure_layout(flags, config, GridLayout.from_config(config.parallel, 2), 8)
    measured = role["categories"]["optimizer state"]
    planned = stage_memory(config.model, Layout(dp=2, zero=1), 0, 2, 1, precision("fp32", rule=SIGNUM),
                           flash_attention=True)[1]
    adamw = stage_memory(config.model, Layout(dp=2, zero=1), 0, 2, 1, precision("fp32"), flash_attention=True)[1]
    # the dry run's planned column reads the config's rule too (before the setting it counted AdamW's 12 bytes)
    assert measured == planned["master_and_optimizer"] == role["planned_categories"]["master_and_optimizer"]
    assert measured == adamw["master_and_optimizer"] * 8 / 12
