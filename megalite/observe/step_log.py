"""The training loop's log records, read from the device once per log interval.

Each iteration leaves a :class:`PendingStep` (its :class:`~megalite.observe.step_values.StepResult`,
still on the device, and what the host measured: collectives handed, memory, its start
time). :meth:`StepLog.flush` runs at the log line (and before evaluation, a checkpoint, a
stop, the end): it reads every pending step's values with one sync, checks them for
divergence, and turns them into the records that the monitor prints, the JSON log keeps
and ``pretrain`` returns. Between flushes the host never waits for the GPU, so it keeps
queueing the next steps' kernels.

Times: without a sync per step, a step's host time is how long its launches took. The
window from the first pending step's start to the flush's sync is the true time of the
window's steps, so each record's ``elapsed_ms`` (and its tokens/s, TFLOP/s, MFU) is the
window's mean; with ``--log-interval 1`` that is the step's own time, as before. Each record
also carries ``run_elapsed_s`` (wall time since this run's first iteration began, evaluation
and saves included) and ``eta_s`` (the iterations left to ``--train-iters`` times the mean
step time of the last :data:`ETA_WINDOW` iterations): :class:`RunClock`.

The ``--log-json`` file is strict JSON (:func:`json_line`): JSON has no NaN or Infinity, so a
non-finite number is written as ``null`` and named, with its value as text, under the
record's ``non_finite`` field (``{"loss": "nan", "grad_norm": "inf"}``).
"""
from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass

from megalite.resilience.faults import bytes_by_group, check_finite
from megalite.observe.step_values import StepResult, resolve_steps


@dataclass
class PendingStep:
    iteration: int                 # 1-based, as logged
    result: StepResult
    start: float                   # perf_counter at the step's start (before its data)
    traffic: dict                  # count_collectives() of the step
    memory: str                    # the memory column of the log line
    memory_stats: dict
    tracked: dict | None = None    # the memory tracker's summary (--track-memory)
    attended: float | None = None  # packed documents: mean attended length (monitor.attended_length)
    extra: dict | None = None      # fields the loop adds to the record (a straggler report)


ETA_WINDOW = 20  # the ETA's step time: the mean over this many most recent iterations


def _finite_or_none(value, path: str, non_finite: dict):
    """``value`` with each non-finite float replaced by None, its text kept in ``non_finite``
    under its dotted path (``times_ms.forward``)."""
    if isinstance(value, float) and not math.isfinite(value):
        non_finite[path] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v, f"{path}.{k}" if path else str(k), non_finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v, f"{path}.{i}", non_finite) for i, v in enumerate(value)]
    return value


def json_line(record: dict) -> str:
    """One ``--log-json`` line of ``record``: strict JSON, which any parser reads (a bare
    ``NaN`` is not JSON): non-finite numbers become ``null`` and are named under
    ``non_finite``, e.g. ``"loss": null, ..., "non_finite": {"loss": "nan"}``."""
    non_finite: dict[str, str] = {}
    clean = _finite_or_none(record, "", non_finite)
    if non_finite:
        clean["non_finite"] = non_finite
    return json.dumps(clean, allow_nan=False)


class RunClock:
    """Elapsed wall time of the run and its ETA: ``start`` at the first iteration's start,
    then ``stamp`` each logged iteration with its step time and its end; the ETA is the
    iterations left to ``train_iters`` times the mean step time of the last ``window``
    iterations (so a slow start, or a change of speed, fades out of it)."""

    def __init__(self, train_iters: int, window: int = ETA_WINDOW):
        self.train_iters = train_iters
        self.started: float | None = None
        self.recent: deque[float] = deque(maxlen=window)

    def start(self, when: float) -> None:
        if self.started is None:
            self.started = when

    def stamp(self, iteration: int, step_seconds: float, end: float) -> dict:
        """``run_elapsed_s`` (from the start to ``end``) and ``eta_s`` of iteration ``iteration``."""
        self.recent.append(step_seconds)
        mean = sum(self.recent) / len(self.recent)
        return {"run_elapsed_s": end - self.started, "eta_s": mean * max(0, self.train_iters - iteration)}


class StepLog:
    """Pending steps and their records; see the module docstring."""

    def __init__(self, monitor, grid, *, check: bool, fp16: bool, meta: bool, skipped_total: int = 0):
        self.monitor, self.grid = monitor, grid
        self.check, self.fp16, self.meta = check, fp16, meta
        self.skipped_total = skipped_total
        self.pending: list[PendingStep] = []
        self.clock = RunClock(monitor.train_iters)

    def add(self, step: PendingStep) -> None:
        self.clock.start(step.start)
        self.pending.append(step)

    def flush(self) -> list[dict]:
        """Records of the pending steps, in order (one sync for all of them). Raises
        :class:`~megalite.resilience.faults.TrainingDiverged` at the first non-finite bf16/fp32 step."""
        steps, self.pending = self.pending, []
        if not steps:
            return []
        resolve_steps([s.result for s in steps])
        elapsed = (time.perf_counter() - steps[0].start) / len(steps)
        records = []
        for k, s in enumerate(steps):
            r = s.result
            if self.check:  # a meta or fake-group run has no values / made-up collectives
                check_finite(r, s.iteration, self.fp16)
            self.skipped_total += int(r.skipped)
            record = {"iteration": s.iteration, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                      "loss_scale": r.loss_scale, "skipped": r.skipped, "skipped_total": self.skipped_total,
                      "elapsed_ms": elapsed * 1e3,
                      **self.clock.stamp(s.iteration, elapsed, steps[0].start + (k + 1) * elapsed),
                      **self.monitor.metrics(elapsed, s.attended), "times_ms": r.times_ms,
                      "comm_bytes": {k: v["bytes"] for k, v in s.traffic.items()}, "memory_bytes": s.memory_stats,
                      "comm_bytes_by_group": bytes_by_group(self.grid, s.traffic), **(r.moe or {})}
            if r.mtp_loss is not None:
                record["mtp_loss"] = r.mtp_loss
            if r.max_attention_logit is not None:  # QK-clip's statistic (megalite.model.qk_clip)
                record["max_attention_logit"] = r.max_attention_logit
            if s.tracked is not None:
                record["memory_tracked"] = s.tracked
            record.update(s.extra or {})
            if self.meta:  # nothing was computed: no values to report (n/a), unlike a NaN
                record.update({k: None for k in ("loss", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mfu", "mtp_loss",
                                                 "max_attention_logit")
                               if k in record})
            records.append(record)
        return records
