"""What the training log tells a new user (issue 42): a ``--log-json`` file any JSON parser reads
(a NaN loss included), elapsed time and ETA on every iteration, TFLOP/s named by the device
that did the work, why a ``--finetune`` run counts from 1, and that mock data cannot be learned.

Each claim is checked on a real run's output (one process on the CPU, a few iterations), the
ETA rule also on a fake clock, where its arithmetic can be followed by hand."""
import contextlib
import io
import json
import math
import os
import sys

import pytest
import torch

from megalite.config import ModelConfig
from megalite.observe.monitor import Monitor, clock_time, mock_data_note
from megalite.train.pretrain import pretrain
from megalite.observe.step_log import RunClock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import plot_log  # noqa: E402

VOCAB = 200
SMALL = ["--mock-data", "--vocab-size", str(VOCAB), "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--log-interval", "1"]


def strict_json(line: str) -> dict:
    """``line`` parsed by the JSON standard: a bare NaN / Infinity / -Infinity is refused."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(line, parse_constant=refuse)


def iteration_lines(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("iter ")]


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """A 4-iteration fp16 run whose iteration 3 has a NaN loss (the loss scaler skips it, the
    run goes on): its returned records, its JSON log's lines and its console output."""
    path = tmp_path_factory.mktemp("nan_run") / "log.jsonl"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # a module-scoped fixture cannot use capsys
        log = pretrain(SMALL + ["--train-iters", "4", "--fp16", "--inject-fault", "nan@3",
                                "--log-json", str(path)])
    return log, path.read_text().splitlines(), out.getvalue()


def test_json_log_of_a_nan_step_is_strict_json_with_null_and_the_value_named(nan_run):
    """JSON has no NaN: the log writes null and names the field under ``non_finite``, so
    ``json.loads(line, parse_constant=raise)`` (any strict parser) reads every line."""
    log, lines, _ = nan_run
    assert math.isnan(log[2]["loss"])  # the run itself met a NaN at iteration 3
    records = [strict_json(line) for line in lines]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    nan_step = records[2]
    assert nan_step["loss"] is None and nan_step["non_finite"]["loss"] == "nan"
    assert all(nan_step["non_finite"][k] in ("nan", "inf", "-inf") and nan_step[k] is None
               for k in nan_step["non_finite"])
    assert records[1]["loss"] == log[1]["loss"] and "non_finite" not in records[1]  # finite steps as they were


def test_plot_log_reads_the_strict_log_and_names_the_nan_iteration(nan_run, tmp_path):
    _, lines, _ = nan_run
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records = plot_log.load(str(path))
    xs, losses = plot_log.points(records, lambda r: r["loss"])
    assert xs == [1, 2, 4] and all(math.isfinite(v) for v in losses)  # the null loss is left out
    assert "loss not finite (null in the log, left out) at iteration 3" in plot_log.summary("run", records)


def test_run_clock_eta_is_the_iterations_left_times_the_recent_mean_step():
    """On a fake clock (seconds given by hand): elapsed counts from the first iteration's start,
    the ETA uses the mean of the last ``window`` step times only."""
    clock = RunClock(train_iters=10, window=2)
    clock.start(100.0)
    clock.start(150.0)  # a later step's start does not move the origin
    assert clock.stamp(1, 2.0, 102.0) == {"run_elapsed_s": 2.0, "eta_s": 2.0 * (10 - 1)}
    assert clock.stamp(2, 4.0, 106.0) == {"run_elapsed_s": 6.0, "eta_s": (2.0 + 4.0) / 2 * (10 - 2)}
    # the 2-step window has dropped the first step: (4 + 6) / 2, not (2 + 4 + 6) / 3
    assert clock.stamp(3, 6.0, 112.0) == {"run_elapsed_s": 12.0, "eta_s": (4.0 + 6.0) / 2 * (10 - 3)}
    assert clock.stamp(10, 6.0, 118.0)["eta_s"] == 0.0
    assert clock_time(3723.4) == "1:02:03" and clock_time(None) == "n/a"


def test_iteration_lines_and_json_carry_elapsed_and_eta(nan_run):
    """Elapsed time starts with the first step and grows by at least each step's time (the log
    and the host's work between steps count too); the ETA is the steps left times the mean
    step time so far (fewer than 20 steps); the line shows both as h:mm:ss."""
    _, lines, out = nan_run
    records = [strict_json(line) for line in lines]
    steps = [r["elapsed_ms"] / 1e3 for r in records]  # one flush per step here: each its own time
    elapsed = [r["run_elapsed_s"] for r in records]
    assert elapsed[0] == pytest.approx(steps[0])
    assert all(elapsed[k] - elapsed[k - 1] >= steps[k] - 1e-9 for k in range(1, 4)), (elapsed, steps)
    for k, r in enumerate(records):
        assert r["eta_s"] == pytest.approx(sum(steps[:k + 1]) / (k + 1) * (4 - r["iteration"]))
    shown = iteration_lines(out)
    assert len(shown) == 4
    for line, r in zip(shown, records):
        assert f"| elapsed {clock_time(r['run_elapsed_s'])} ETA {clock_time(r['eta_s'])} |" in line, line


def test_tflops_are_named_by_the_device_that_did_the_work(nan_run):
    """A CPU run's figure is per CPU process, not per GPU; CUDA keeps per GPU."""
    _, _, out = nan_run
    assert all("TFLOP/s/CPU process" in line and "GPU" not in line for line in iteration_lines(out))
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=8)
    for device, unit in (("cuda", "TFLOP/s/GPU"), ("cpu", "TFLOP/s/CPU process"), ("meta", "TFLOP/s/device")):
        monitor = Monitor(cfg, 1, 64, train_iters=2, peak_tflops=1.0, device=torch.device(device))
        record = {"iteration": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "loss_scale": 1.0,
                  "skipped_total": 0, **monitor.metrics(0.1), "times_ms": {}}
        assert f" {unit} |" in monitor.line(record, "mem 1 MiB"), device


def test_mock_data_run_says_once_that_random_tokens_cannot_be_learned(nan_run):
    _, _, out = nan_run
    note = mock_data_note(VOCAB)
    assert f"ln(vocab) = ln({VOCAB}) = {math.log(VOCAB):.2f}" in note and "random tokens" in note
    assert out.count(note) == 1 and out.index(note) < out.index("iter ")  # at startup, before the loss


def test_finetune_says_what_starts_afresh_and_does_it(tmp_path, capsys):
    """The "loaded ... at iteration 3" line of a --finetune run says why the count restarts at 1,
    and the run does what it says: its LR schedule and loss scale are those of a fresh start."""
    fresh = pretrain(SMALL + ["--train-iters", "3", "--fp16", "--lr-warmup-iters", "2",
                              "--inject-fault", "nan@2", "--save", str(tmp_path / "ckpt")])
    capsys.readouterr()
    tuned = pretrain(SMALL + ["--train-iters", "3", "--fp16", "--lr-warmup-iters", "2",
                              "--load", str(tmp_path / "ckpt"), "--finetune"])
    out = capsys.readouterr().out
    loaded = [x for x in out.splitlines() if x.startswith("loaded ")][0]
    assert "at iteration 3" in loaded and "--finetune takes the weights only: the iteration count (from 1)" in loaded
    for part in ("optimizer state", "loss scale", "LR schedule", "data position"):
        assert part in loaded, part
    assert iteration_lines(out)[0].startswith("iter     1/3")
    assert [r["lr"] for r in tuned] == [r["lr"] for r in fresh]  # the warmup again, from iteration 1
    assert fresh[-1]["loss_scale"] < fresh[0]["loss_scale"]  # the NaN at 2 halved the scale it saved
    assert tuned[0]["loss_scale"] == fresh[0]["loss_scale"]  # the initial scale, not the saved one
