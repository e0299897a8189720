"""What a run reports and how it fails: log line, JSON, TensorBoard, MFU, profiler, NaN, hangs."""
import io
import json
import time

import pytest
import torch

from megalite.config import ModelConfig
from megalite.observe import monitor as monitor_module
from megalite.observe.monitor import Monitor, attended_length, detect_peak_tflops, flops_per_token, memory_line
from megalite.train.pretrain import main, pretrain
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


def _fake_gpu(monkeypatch, name, index=0):
    """torch.cuda as seen on a machine whose current device (``index``) is called ``name``."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: index)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or name)
    monkeypatch.setattr(monitor_module, "_unknown_reported", set())
    return asked


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4),   # SXM
    ("NVIDIA H100 PCIe", 756.0),        # not the SXM figure, although "H100" is in its name
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A10", 125.0),              # not the A100 figure, although "A10" is in "A100"
    ("NVIDIA L4", 121.0),               # not L40 / L40S
    ("NVIDIA L40S", 362.05),
    ("NVIDIA GeForce RTX 4090", 165.2),
])
def test_peak_tflops_is_looked_up_by_the_exact_device_name(monkeypatch, name, peak, capsys):
    asked = _fake_gpu(monkeypatch, name, index=3)
    assert detect_peak_tflops() == peak
    assert asked == [3]  # the current device, not device 0
    assert detect_peak_tflops(device=torch.device("cuda", 1)) == peak and asked[-1] == 1
    assert detect_peak_tflops(device=torch.device("cpu")) is None  # a CPU run on a GPU machine
    assert capsys.readouterr().err == ""


def test_unknown_gpu_gives_no_mfu_and_one_message_naming_it_and_the_flag(monkeypatch, capsys):
    _fake_gpu(monkeypatch, "NVIDIA H100 Mystery Edition")
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=200, seq_length=16)
    monitor = Monitor(cfg, world_size=1, tokens_per_step=1000, train_iters=10)
    assert monitor.peak is None and "mfu" not in monitor.metrics(0.5)
    Monitor(cfg, world_size=1, tokens_per_step=1000, train_iters=10)  # the same name again: silent
    err = capsys.readouterr().err
    assert err.count("'NVIDIA H100 Mystery Edition'") == 1 and "--peak-tflops" in err
    # ranks that do not log stay silent; --peak-tflops wins over the table
    _fake_gpu(monkeypatch, "Some Other GPU")
    assert Monitor(cfg, 1, 1000, 10, enabled=False).peak is None and capsys.readouterr().err == ""
    assert Monitor(cfg, 1, 1000, 10, peak_tflops=100.0).metrics(0.5)["mfu"] > 0


def test_gpu_memory_line_reports_the_current_device_and_resets_its_peak(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    for fn, value in (("memory_allocated", 1 << 30), ("memory_reserved", 3 << 30), ("max_memory_allocated", 2 << 30)):
        monkeypatch.setattr(torch.cuda, fn, lambda device=None, fn=fn, value=value: calls.append((fn, device)) or value)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    line, stats = memory_line(None)
    assert line.startswith("mem 1.00/3.00/2.00 GiB") and stats == {"allocated": 1 << 30, "reserved": 3 << 30,
                                                                 "peak": 2 << 30}
    assert {d for _, d in calls} == {2} and ("reset", 2) not in calls
    calls.clear()
    memory_line(None, reset_peak=True)
    assert calls[-1] == ("reset", 2)
    calls.clear()
    memory_line(None, reset_peak=True, device=torch.device("cuda", 5))
    assert {d for _, d in calls} == {5}

    class Optimizer:
        def memory_bytes(self):
            return {"weights": 1 << 20, "grads": 1 << 20}
    line, stats = memory_line(Optimizer(), reset_peak=True, device=torch.device("cpu"))
    assert line.startswith("mem 2.0 MiB") and stats == {"weights": 1 << 20, "grads": 1 << 20}


def test_log_line_json_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log = pretrain(SMALL + ["--train-iters", "5", "--peak-tflops", "1.5", "--log-json", str(tmp_path / "log.jsonl"),
                            "--tensorboard-dir", str(tmp_path / "tb"), "--eval-interval", "5", "--eval-iters", "1"])
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("iter     3/5")][0]
    for part in ("loss", "lr", "grad norm", "scale 1", "skipped 0", "tok/s", "TFLOP/s/CPU process", "MFU", "mem",
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


class Tty(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


def test_progress_bar_with_eta_on_a_terminal():
    stream = Tty()
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=8)
    monitor = Monitor(cfg, 1, 64, train_iters=4, stream=stream)
    lines = []
    for iteration in (1, 2, 3):
        record = {"iteration": iteration, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "loss_scale": 1.0,
                  "skipped_total": 0, **monitor.metrics(0.1), "times_ms": {"forward": 1.0}}
        monitor.log(record, "mem 1 MiB", print_line=iteration < 3)
        lines.append(monitor.line(record, "mem 1 MiB"))
    monitor.close()
    out = stream.getvalue()
    # tqdm's bar with its ETA ([elapsed<remaining, rate]), redrawn under each log line
    assert "training:  50%|" in out and "| 2/4 [" in out and "<" in out and "it/s]" in out
    assert "training:  75%|" in out and out.endswith("\n")  # closed: the last state stays
    segments = out.replace("\r", "\n").split("\n")  # what a terminal shows line by line
    assert lines[0] in segments and lines[1] in segments  # the log lines intact, each on its own line
    assert lines[2] not in out  # print_line=False: the bar only


def test_no_bar_characters_when_not_a_terminal():
    stream = io.StringIO()
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=8)
    monitor = Monitor(cfg, 1, 64, train_iters=2, stream=stream)
    record = {"iteration": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "loss_scale": 1.0, "skipped_total": 0,
              **monitor.metrics(0.1), "times_ms": {"forward": 1.0}}
    monitor.log(record, "mem 1 MiB", print_line=True)
    monitor.close()
    assert stream.getvalue() == monitor.line(record, "mem 1 MiB") + "\n"


def test_profiler_trace_and_summary(tmp_path, capsys):
    pretrain(SMALL + ["--train-iters", "4", "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
                      "--profile-dir", str(tmp_path / "prof")])
    out = capsys.readouterr().out
    assert "profile rank 0 (iterations 2-3): compute" in out and "communication" in out
    trace = json.loads((tmp_path / "prof" / "trace_rank000.json").read_text())
    assert len(trace["traceEvents"]) > 10


def test_nan_loss_stops_bf16_and_fp32_runs_naming_the_iteration(capsys):
    for flags in ([], ["--bf16"]):
        assert main(SMALL + ["--train-iters", "6", "--inject-fault", "nan@3"] + flags) == 3
        err = capsys.readouterr().err
        assert "training stopped: iteration 3: loss nan" in err and "Fix" in err


def test_nan_in_fp16_is_skipped_by_the_loss_scaler(capsys):
    log = pretrain(SMALL + ["--train-iters", "6", "--fp16", "--inject-fault", "nan@3"])
    assert [r["skipped"] for r in log] == [False, False, True, False, False, False]
    assert log[2]["loss_scale"] == log[1]["loss_scale"] / 2 and log[-1]["skipped_total"] == 1
    assert "iteration 3: inf/nan gradients, step skipped" in capsys.readouterr().out


def _hang_worker(rank, world):
    import contextlib
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err):
        code = main(SMALL + ["--train-iters", "4", "--global-batch-size", "8", "--distributed-timeout-minutes", "0.1",
                             "--inject-fault", "hang@2:2=12"])
    return code, err.getvalue(), time.monotonic() - start


@pytest.mark.slow
def test_rank_stuck_before_a_collective_gives_a_clear_error_on_every_other_rank():
    # Rank 2 sleeps 12 s; the others fail after 6 s: the world ends with them (rank 2 is killed).
    results = run_world(_hang_worker, 4, pg_timeout_s=6, timeout=90, unawaited=(2,))
    assert results[2] is None
    for rank, result in enumerate(results):
        if rank == 2:
            continue
        code, err, elapsed = result
        assert code == 4, err
        assert "distributed timeout" in err and "did not complete within 6 s" in err
        assert "rank(s) [2] did not arrive" in err, err
        assert elapsed < 20, elapsed  # within twice the timeout of the hang (plus start-up)
    print(results[0][1].strip(), f"(after {results[0][2]:.1f} s)")


def test_packed_documents_count_only_the_attention_work_done():
    """With documents a token attends its own document: the attention term 12 L h s of the
    FLOPs per token takes the mean document length over tokens (sum_d L_d^2 / s) instead of s."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=100)
    start = torch.tensor([[0, 0, 0, 0, 4, 4, 4, 4], [0, 0, 2, 2, 2, 2, 2, 2]], dtype=torch.int32)
    end = torch.tensor([[4, 4, 4, 4, 8, 8, 8, 8], [2, 2, 8, 8, 8, 8, 8, 8]], dtype=torch.int32)
    # row 0: two documents of 4 (4^2 + 4^2 = 32); row 1: 2 and 6 (4 + 36 = 40); per token (32 + 40) / 16
    assert attended_length([{"doc_start": start, "doc_end": end}]) == 72 / 16
    assert attended_length([{"tokens": start}]) is None
    whole, packed = flops_per_token(cfg), flops_per_token(cfg, 4.5)
    assert whole - packed == 12.0 * 2 * 64 * (8 - 4.5)
    monitor = Monitor(cfg, world_size=1, tokens_per_step=16, train_iters=1, peak_tflops=1.0, enabled=False)
    assert monitor.metrics(1.0)["tflops_per_gpu"] == whole * 16 / 1e12
    assert monitor.metrics(1.0, 4.5)["tflops_per_gpu"] == packed * 16 / 1e12
