"""What a run reports and how it fails: log line, JSON, TensorBoard, MFU, profiler, NaN, hangs."""
import io
import json
import time

import pytest
import torch

from megalite.config import ModelConfig
from megalite.monitor import Monitor, flops_per_token
from megalite.pretrain import main, pretrain
from megalite.testing import run_world

SMALL = ["--mock-data", "--vocab-size", "200", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--log-interval", "1"]


def test_flops_and_mfu_against_hand_computation():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=200, seq_length=16)
    h, L, V, S = 32, 2, 200, 16
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    n = V * h + S * h + L * per_layer + 2 * h  # tied output: counted once
    assert flops_per_token(cfg) == 6 * n + 12 * L * h * S
    monitor = Monitor(cfg, world_size=4, tokens_per_step=1000, train_iters=10, peak_tflops=2.0, enabled=False)
    m = monitor.metrics(elapsed_s=0.5)
    expected_tflops = (6 * n + 12 * L * h * S) * 1000 / 0.5 / 4 / 1e12
    assert m["tflops_per_gpu"] == pytest.approx(expected_tflops) and m["mfu"] == pytest.approx(expected_tflops / 2)


def test_log_line_json_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log = pretrain(SMALL + ["--train-iters", "5", "--peak-tflops", "1.5", "--log-json", str(tmp_path / "log.jsonl"),
                            "--tensorboard-dir", str(tmp_path / "tb"), "--eval-interval", "5", "--eval-iters", "1"])
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("iter     3/5")][0]
    for part in ("loss", "lr", "grad norm", "scale 1", "skipped 0", "tok/s", "TFLOP/s/GPU", "MFU", "mem",
                 "forward", "backward", "grad_sync", "optimizer"):
        assert part in line, (part, line)
    records = [json.loads(x) for x in open(tmp_path / "log.jsonl")]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5] and records == json.loads(json.dumps(log))
    for key in ("loss", "lr", "grad_norm", "loss_scale", "skipped_total", "tokens_per_sec", "tflops_per_gpu",
                "mfu", "times_ms", "memory_bytes", "comm_bytes", "elapsed_ms"):
        assert key in records[0], key
    assert "valid_loss" in records[-1]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/mfu", "time_ms/forward", "memory_bytes/weights", "train/valid_loss"} <= set(tags)
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert acc.Scalars("train/loss")[2].value == pytest.approx(records[2]["loss"])


def test_progress_bar_with_eta_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    stream = Tty()
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=8)
    monitor = Monitor(cfg, 1, 64, train_iters=4, stream=stream)
    record = {"iteration": 2, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "loss_scale": 1.0, "skipped_total": 0,
              **monitor.metrics(0.1), "times_ms": {"forward": 1.0}}
    monitor.log(record, "mem 1 MiB", print_line=False)
    assert "50.0% ETA" in stream.getvalue() and "[###############" in stream.getvalue()


def test_profiler_trace_and_summary(tmp_path, capsys):
    pretrain(SMALL + ["--train-iters", "4", "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
                      "--profile-dir", str(tmp_path / "prof")])
    out = capsys.readouterr().out
    assert "profile rank 0 (iterations 2-3): compute" in out and "communication" in out
    trace = json.loads((tmp_path / "prof" / "trace_rank000.json").read_text())
    assert len(trace["traceEvents"]) > 10


def test_nan_loss_stops_bf16_and_fp32_runs_naming_the_iteration(monkeypatch, capsys):
    monkeypatch.setenv("MEGALITE_TEST_NAN_AT_ITERATION", "3")
    for flags in ([], ["--bf16"]):
        assert main(SMALL + ["--train-iters", "6"] + flags) == 3
        err = capsys.readouterr().err
        assert "training stopped: iteration 3: loss nan" in err and "Fix" in err


def test_nan_in_fp16_is_skipped_by_the_loss_scaler(monkeypatch, capsys):
    monkeypatch.setenv("MEGALITE_TEST_NAN_AT_ITERATION", "3")
    log = pretrain(SMALL + ["--train-iters", "6", "--fp16"])
    assert [r["skipped"] for r in log] == [False, False, True, False, False, False]
    assert log[2]["loss_scale"] == log[1]["loss_scale"] / 2 and log[-1]["skipped_total"] == 1
    assert "iteration 3: inf/nan gradients, step skipped" in capsys.readouterr().out


def _hang_worker(rank, world):
    import contextlib
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err):
        code = main(SMALL + ["--train-iters", "4", "--global-batch-size", "8", "--distributed-timeout-minutes", "0.1"])
    return code, err.getvalue(), time.monotonic() - start


def test_rank_stuck_before_a_collective_gives_a_clear_error_on_every_other_rank():
    env = {"MEGALITE_TEST_HANG_AT_ITERATION": "2", "MEGALITE_TEST_HANG_RANK": "2",
           "MEGALITE_TEST_HANG_SECONDS": "20"}
    results = run_world(_hang_worker, 4, env=env, pg_timeout_s=6, timeout=90)
    for rank, (code, err, elapsed) in enumerate(results):
        if rank == 2:
            continue
        assert code == 4, err
        assert "distributed timeout" in err and "did not complete within 6 s" in err
        assert "rank(s) [2] did not arrive" in err, err
        assert elapsed < 20, elapsed  # within twice the timeout of the hang (plus start-up)
    print(results[0][1].strip(), f"(after {results[0][2]:.1f} s)")
