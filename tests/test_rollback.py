"""Rollback past non-finite values and loss spikes, skipped data windows, fault injection.

The oracle: a run that meets a fault at iteration k, rolls back to its latest checkpoint and
skips batch k trains exactly like a run told ``--skip-batches k`` from the start.
"""
import json
import os
import sys

import pytest
import torch

from megalite.config import ConfigError
from megalite.data.batch_stream import BatchStream, merge_windows
from megalite.train.pretrain import main, pretrain
from megalite.resilience.fault_injection import Fault, FaultInjector, parse_fault
from megalite.resilience.flags import parse_skip_batches
from megalite.resilience.rollback import BadStep, LossSentinel, agree
from megalite.testing import WorldError, run_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100",
        "--train-iters", "12", "--hidden-dropout", "0.1"]


def _losses(records):
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in records]


# -- units -------------------------------------------------------------------------------------

def test_fault_specs_parse_and_bad_ones_name_the_rule():
    assert parse_fault("nan@7") == Fault("nan", 7)
    assert parse_fault("slow@3:1=0.5") == Fault("slow", 3, 1, 0.5)
    assert str(parse_fault("kill-during-save@20:3")) == "kill-during-save@20:3"
    for bad, why in [("nan", "expected KIND@ITER"), ("boom@3", "'boom' is not a fault kind"),
                     ("nan@0", "count from 1"), ("nan@3=2", "nan takes no =VALUE"), ("slow@3=-1", "")]:
        with pytest.raises(ConfigError, match="--inject-fault") as e:
            parse_fault(bad)
        assert why in str(e.value)


def test_a_fault_on_a_rank_that_does_not_exist_is_a_config_error(capsys):
    assert main(BASE + ["--inject-fault", "kill@3:4"]) == 2
    assert "--inject-fault kill@3:4: rank 4 does not exist in a world of 1 ranks" in capsys.readouterr().err


def test_a_slow_fault_sleeps_the_device_on_a_gpu(monkeypatch):
    """On a GPU the device sleeps (CUDA events see it) for a calibrated torch.cuda._sleep: the
    clock is the slope of two timed sleeps (a window's fixed launch latency cancels, which one
    window's cycles / time would count as sleep), measured once per device, not at every fault."""
    from megalite.resilience import fault_injection
    slept, syncs = [], []
    launch_ms, clock_hz = 0.02, 2e9  # each window also holds the sleep kernel's launch

    class Event:  # a window's time: launch latency + the cycles slept since the start event
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = (len(slept), sum(slept))

        def synchronize(self):
            syncs.append(1)

        def elapsed_time(self, end):
            assert end.at[0] == self.at[0] + 1  # one sleep inside the window
            return launch_ms + (end.at[1] - self.at[1]) / clock_hz * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: slept.append(cycles))
    monkeypatch.setattr(fault_injection, "_CLOCKS", {})
    faults = [parse_fault("slow@3=0.5"), parse_fault("slow@4=0.25")]
    injector = FaultInjector(faults, 0, first_attempt=True)
    injector.slow_compute(3, torch.device("cuda", 0))
    injector.slow_compute(4, torch.device("cuda", 0))
    assert slept[-2:] == [1_000_000_000, 500_000_000]  # 0.5 s and 0.25 s at 2 GHz exactly
    assert len(slept) == 4 and len(syncs) == 1  # calibrated (two sleeps, one sync) once


def test_a_fault_strikes_once_and_only_on_its_rank_in_the_first_attempt():
    faults = [parse_fault("spike@2:1=10"), parse_fault("nan@2")]
    assert not FaultInjector(faults, 0, first_attempt=False)
    inj = FaultInjector(faults, 1, first_attempt=True)
    batch = {"loss_mask": torch.ones(2, 4)}
    out = inj.corrupt(2, [batch, batch])
    assert torch.isnan(out[0]["loss_mask"]).all() and float(out[0]["injected_loss_factor"]) == 10.0
    assert out[1] is batch and inj.corrupt(2, [batch]) == [batch]  # struck once
    assert FaultInjector(faults, 0, first_attempt=True).corrupt(2, [batch])[0].get("injected_loss_factor") is None


def test_skip_windows_parse_merge_and_the_stream_reads_past_them():
    assert parse_skip_batches(["9", "3-4", "5"]) == [(3, 5), (9, 9)]
    assert merge_windows([(7, 7), (1, 2), (8, 9)]) == [(1, 2), (7, 9)]
    with pytest.raises(ConfigError, match="--skip-batches '4-2'"):
        parse_skip_batches(["4-2"])

    class Counter:  # micro-batch i is the number i; at(n) repositions
        def __init__(self, start=0):
            self.i = start

        def __next__(self):
            self.i += 1
            return self.i

        def at(self, consumed):
            return Counter(consumed // 2)  # 2 samples per micro-batch step

    stream = BatchStream(Counter(), num_micro=2, global_batch_size=4, windows=[(2, 3)])
    assert stream.next() == (1, [1, 2]) and stream.next() == (4, [7, 8])
    assert stream.consumed_samples == 16 and stream.reserve() == 2
    stream.rewind(1)
    stream.skip(5, 5)
    assert stream.next() == (4, [7, 8]) and stream.next() == (6, [11, 12])


def test_sentinel_finds_non_finite_values_and_spikes_against_the_recent_median():
    rec = lambda i, loss, norm=1.0: {"iteration": i, "loss": loss, "grad_norm": norm}  # noqa: E731
    s = LossSentinel(fp16=False, spiky=True, factor=3.0, window=3)
    assert s.first_bad([rec(1, 5.0), rec(2, 4.0), rec(3, 13.0)]) is None  # the window is not full yet
    bad = s.first_bad([rec(4, 4.0), rec(5, 12.5), rec(6, 1.0)])
    assert bad == BadStep(5, "spike", 12.5, 1.0, 4.0, 3) and 6 not in s.history
    assert s.first_bad([rec(6, 4.0, float("inf"))]).kind == "non-finite"
    s.forget_after(2)
    assert sorted(s.history) == [1, 2]
    assert LossSentinel(fp16=True, spiky=False, factor=3, window=3).first_bad([rec(1, float("nan"))]) is None


def _agree_worker(rank, world):
    from megalite.parallel.grid import build_grid
    from megalite.config import ParallelConfig
    grid = build_grid(ParallelConfig(), world, rank)
    mine = {0: None, 1: BadStep(9, "spike", 50.0), 2: BadStep(7, "non-finite"), 3: BadStep(7, "spike")}[rank]
    return agree(mine, grid)


def test_every_rank_takes_the_earliest_bad_step_of_any_rank():
    results = run_world(_agree_worker, 4)
    assert [(b.iteration, b.kind) for b in results] == [(7, "non-finite")] * 4


# -- rollback against skipping from the start --------------------------------------------------

def _run(rank, world, argv):
    return _losses(pretrain(argv))


@pytest.mark.parametrize("fault,flags", [("nan@7", []), ("spike@7", ["--check-for-spiky-loss", "--spiky-loss-window", "4"]),
                                         ("nan@7", ["--async-save"])])
def test_rollback_equals_a_run_that_skipped_the_window_from_the_start(tmp_path, capsys, fault, flags):
    common = BASE + ["--save-interval", "5", "--max-rollbacks", "1"] + flags
    reference = _losses(pretrain(common + ["--save", str(tmp_path / "ref"), "--skip-batches", "7"]))
    log = tmp_path / "log.jsonl"
    rolled = _losses(pretrain(common + ["--save", str(tmp_path / "b"), "--inject-fault", fault,
                                        "--log-json", str(log)]))
    assert [r[0] for r in rolled] == list(range(1, 13))
    assert rolled == reference  # bit for bit: weights, optimizer, RNG and data position restored
    out = capsys.readouterr().out
    assert "rollback 1/1:" in out and "iteration 7" in out and "skipping global batch 7;" in out
    events = [json.loads(x) for x in log.read_text().splitlines() if '"event"' in x]
    assert len(events) == 1 and events[0]["restored_iteration"] == 5 and events[0]["skipped_batches"] == [7, 7]
    import plot_log  # the log's readers skip the event and keep the replayed iterations
    assert _losses(plot_log.load(str(log))) == rolled


@pytest.mark.parametrize("second,log_interval,windows,restored", [
    ("nan@12", "100", ["3", "8", "14"], 10),  # the second rollback goes to a checkpoint saved after the first
    ("nan@9", "1", ["3", "8", "11"], 5)])     # the second goes back to the first's checkpoint again
def test_a_rollback_skips_the_faulty_iteration_s_batch_after_an_earlier_window(tmp_path, second, log_interval,
                                                                                windows, restored):
    """Batch 3 skipped from the start, so from iteration 3 on iteration k trains on batch k+1
    (k+2 after the first rollback): a NaN at iteration 7 must skip batch 8, not batch 7, and the
    second fault's iteration maps past both windows. The run equals one given all three windows
    from the start: losses, gradient norms and the final checkpoint's bytes (weights, moments,
    RNG). Guards the iteration -> batch lookup of TrainLoop.rollback (the earlier rollback tests
    have no window before the fault, where iteration = batch)."""
    common = BASE + ["--train-iters", "15", "--save-interval", "5", "--max-rollbacks", "2",
                     "--log-interval", log_interval]
    reference = _losses(pretrain(common + ["--save", str(tmp_path / "ref"), "--skip-batches", *windows]))
    log = tmp_path / "log.jsonl"
    rolled = _losses(pretrain(common + ["--save", str(tmp_path / "b"), "--skip-batches", "3", "--inject-fault",
                                        "nan@7", "--inject-fault", second, "--log-json", str(log)]))
    assert [r[0] for r in rolled] == list(range(1, 16))
    assert rolled == reference
    events = [json.loads(x) for x in log.read_text().splitlines() if '"event"' in x]
    skipped = int(windows[-1])
    assert [(e["iteration"], e["restored_iteration"], e["skipped_batches"]) for e in events] == [
        (7, 5, [8, 8]), (int(second.split("@")[1]), restored, [skipped, skipped])]
    final = [tmp_path / run / "iter_0000015" for run in ("ref", "b")]
    assert (final[0] / "rank00000.safetensors").read_bytes() == (final[1] / "rank00000.safetensors").read_bytes()
    metas = [json.loads((d / "metadata.json").read_text()) for d in final]
    assert metas[1]["skipped_batches"] == metas[0]["skipped_batches"] == [[3, 3], [8, 8], [skipped, skipped]]


def test_a_resume_after_a_rollback_does_not_replay_the_skipped_batch(tmp_path):
    argv = BASE + ["--save-interval", "5", "--max-rollbacks", "1", "--inject-fault", "nan@7"]
    full = _losses(pretrain(argv + ["--save", str(tmp_path / "a")]))
    with pytest.raises(WorldError, match="died"):
        run_world(_run, 1, argv + ["--save", str(tmp_path / "b"), "--inject-fault", "kill@11"])
    meta = json.loads((tmp_path / "b" / "iter_0000010" / "metadata.json").read_text())
    assert meta["skipped_batches"] == [[7, 7]] and meta["data_batches"] == 11 and meta["consumed_samples"] == 44
    resumed = _losses(pretrain(BASE + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")]))
    assert resumed == full[10:]


def test_exhausted_rollbacks_stop_with_one_message(tmp_path, capsys):
    argv = BASE + ["--save", str(tmp_path / "c"), "--save-interval", "5", "--max-rollbacks", "1",
                   "--inject-fault", "nan@7", "--inject-fault", "nan@9", "--log-interval", "1"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert err.count("megalite: training stopped:") == 1
    assert "non-finite values at iteration 9" in err and "1 rollback(s) already taken (--max-rollbacks 1)" in err


def test_a_fault_before_the_first_checkpoint_says_there_is_nothing_to_roll_back_to(tmp_path, capsys):
    argv = BASE + ["--save", str(tmp_path / "d"), "--save-interval", "5", "--max-rollbacks", "2",
                   "--inject-fault", "nan@3"]
    assert main(argv) == 3
    assert "there is no checkpoint to roll back to yet" in capsys.readouterr().err


def test_a_finetune_start_is_not_a_state_to_roll_back_to(tmp_path, capsys):
    """--finetune starts at iteration 0 from another run's weights: before its own first
    checkpoint there is nothing of this run to go back to."""
    pretrain(BASE + ["--train-iters", "5", "--save", str(tmp_path / "base")])
    argv = BASE + ["--load", str(tmp_path / "base"), "--finetune", "--save", str(tmp_path / "ft"),
                   "--save-interval", "5", "--max-rollbacks", "1", "--inject-fault", "nan@3"]
    assert main(argv) == 3
    assert "there is no checkpoint to roll back to yet" in capsys.readouterr().err


def test_rollback_needs_save(capsys):
    assert main(BASE + ["--max-rollbacks", "2"]) == 2
    assert "--max-rollbacks 2 needs --save DIR" in capsys.readouterr().err


def test_a_dry_run_cannot_save(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    assert main(BASE + ["--fake-process-group", "--device", "meta", "--save", "ck", "--async-save"]) == 2
    assert "--save ck with --fake-process-group: a dry run plays one rank" in capsys.readouterr().err


def _world_run(rank, world, argv):
    return _losses(pretrain(argv))


@pytest.mark.slow
def test_every_rank_of_dp2_x_pp2_rolls_back_together(tmp_path):
    """The NaN enters on rank 3 only (DP rank 1 of the last stage, where the loss is); the
    whole world rolls back."""
    argv = BASE + ["--pipeline-model-parallel-size", "2", "--save-interval", "5", "--max-rollbacks", "1"]
    reference = run_world(_world_run, 4, argv + ["--save", str(tmp_path / "ref"), "--skip-batches", "7"])
    rolled = run_world(_world_run, 4, argv + ["--save", str(tmp_path / "b"), "--inject-fault", "nan@7:3"])
    assert all(r == reference[0] for r in reference + rolled)
    assert [r[0] for r in rolled[0]] == list(range(1, 13))
