"""GPU-side mechanisms that can be checked on a CPU: the NCCL hang watchdog's message, the
timers' host fallback, batch placement (the RNG tracker's keys: tests/test_dp_and_rng.py)."""
from __future__ import annotations

import io
import os
import time
import types

import torch

from megalite.device import host_value, to_device
from megalite.resilience.faults import HangWatchdog
from megalite.parallel import comm
from megalite.observe.timers import Clock, StepTimers


def test_hang_watchdog_names_the_last_collective_and_group():
    group = object()
    grid = types.SimpleNamespace(rank=3, tp_group=group, tp_ranks=[2, 3])
    for kind in ("cp", "dp", "dp_cp", "pp", "mp", "tp_cp", "embedding"):
        setattr(grid, f"{kind}_group", None)
    comm.LAST_COLLECTIVE = ("all_reduce", group)
    out = io.StringIO()
    watchdog = HangWatchdog(grid, timeout_s=0.2, stream=out, poll_s=0.05)
    try:
        time.sleep(0.6)
    finally:
        watchdog.stop()
    text = out.getvalue()
    assert text.count("megalite: rank 3: no progress") == 1  # once, not once per poll
    assert "all_reduce on the tp group (ranks [2, 3])" in text and "flight recorder" in text


def test_hang_watchdog_quiet_while_beating():
    grid = types.SimpleNamespace(rank=0)
    out = io.StringIO()
    watchdog = HangWatchdog(grid, timeout_s=0.3, stream=out, poll_s=0.05)
    try:
        for _ in range(8):
            time.sleep(0.05)
            watchdog.beat()
    finally:
        watchdog.stop()
    assert out.getvalue() == ""


def test_host_clock_and_timers():
    clock = Clock(torch.device("cpu"))
    assert not clock.cuda
    timers = StepTimers(clock)
    a = timers.mark()
    time.sleep(0.01)
    timers.add("forward", a, timers.mark())
    timers.add_seconds("backward", 0.5)
    ms = timers.milliseconds()
    assert ms["backward"] == 500.0 and 9.0 < ms["forward"] < 500.0


def test_batches_move_to_the_device():
    batch = {"tokens": torch.arange(6).view(2, 3)}
    assert to_device(batch, torch.device("cpu")) is batch
    meta = to_device(batch, torch.device("meta"))
    assert meta["tokens"].device.type == "meta" and meta["tokens"].shape == (2, 3)
    assert host_value(torch.tensor(2.5)) == 2.5
    assert host_value(torch.empty((), device="meta")) != host_value(torch.empty((), device="meta"))  # NaN


def test_allocator_setting_precedes_the_first_cuda_call(monkeypatch):
    """``PYTORCH_CUDA_ALLOC_CONF`` is read once, when CUDA initializes: setup() must put
    expandable segments in the environment before its first ``torch.cuda`` call, on one GPU
    too. torch.cuda is patched to record the environment each call sees."""
    from megalite.train.pretrain import setup

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    seen = []

    def recorder(name, result=None):
        def call(*args, **kwargs):
            seen.append((name, os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
            return result
        return call

    for name, result in (("is_available", True), ("device_count", 1), ("set_device", None), ("init", None),
                         ("_lazy_init", None), ("current_device", 0), ("get_device_name", "H200")):
        monkeypatch.setattr(torch.cuda, name, recorder(name, result))
    setup(["--device", "cuda", "--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
           "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
           "--train-iters", "1"])
    assert ("set_device", "expandable_segments:True") in seen, seen
    assert seen and all(conf == "expandable_segments:True" for _, conf in seen), seen


def test_allocator_setting_keeps_the_users(monkeypatch):
    from megalite.device import cuda_allocator_environment

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    cuda_allocator_environment()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
