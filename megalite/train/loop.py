"""The training loop of ``pretrain``: steps, the log, evaluation, checkpoints, rollback, stops.

One iteration: the next global batch (:class:`~megalite.data.batch_stream.BatchStream`, past
skipped windows), the train step, and its :class:`~megalite.observe.step_log.PendingStep`. The host
reads the device only at a flush (the log line, an evaluation, a save, a stop, the end), so
between flushes the GPU stays fed. At a flush the records are checked (non-finite values,
spikes: :mod:`megalite.resilience.rollback`); a bad step is rolled back or stops the run.

A rollback (``--max-rollbacks K``): wait for an in-flight asynchronous save, load the latest
checkpoint under ``--save`` (weights, optimizer, loss scale, RNG, data position; the run's
``--load`` checkpoint if none was saved yet), add the faulty iteration's batch and the N-1
before it to the skip windows (``--rollback-skip-batches N``), rewind the data to the
checkpoint's position and train on. Batches are skipped, iterations are not: the run still
makes ``--train-iters`` updates, on the LR schedule it would have had. The JSON log gets an
``{"event": "rollback", ...}`` line; later checkpoints record the windows, so a resume does not
replay them. Losses after a rollback equal those of a run given the same ``--skip-batches``
from the start (tests/test_rollback.py).

Saves: synchronous, or asynchronous (``--async-save``: the state is staged into host buffers
and a writer thread writes and commits it while training goes on; at most one in flight;
a stop, the end and an exception wait for it).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import torch
import torch.distributed as dist

from megalite.checkpoint import load_checkpoint, save_checkpoint
from megalite.checkpoint.async_save import AsyncCheckpointSaver
from megalite.checkpoint.dcp import AsyncDcpSaver, save_dcp_checkpoint
from megalite.checkpoint.format import CheckpointError, resolve_checkpoint
from megalite.config_types import Config
from megalite.data.batch_stream import BatchStream
from megalite.data.builder import MicroBatchIterator
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.device import to_device
from megalite.resilience.faults import HangWatchdog, hang_report, looks_like_timeout
from megalite.observe.memory_tracker import MemoryTracker
from megalite.observe.monitor import Monitor, attended_length, memory_line
from megalite.parallel.comm import count_collectives
from megalite.parallel.grid import ProcessGrid
from megalite.pipeline.trace import Trace
from megalite.observe.profiling import Profiler
from megalite.resilience.fault_injection import FaultInjector
from megalite.resilience.flags import ResilienceSettings
from megalite.resilience.straggler import StragglerMonitor
from megalite.resilience.rollback import (WARMUP_LOSSES, LossSentinel, agree, checkpoint_losses, exhausted,
                                          no_checkpoint, recent_good_losses)
from megalite.run_settings import CheckpointSettings, LoggingSettings, RunPlan
from megalite.observe.step_log import PendingStep, StepLog, json_line
from megalite.observe.step_values import LossScaler
from megalite.observe.timers import Clock
from megalite.train.step import evaluate, train_step


class TermSignal:
    """SIGTERM sets a flag; the loop checks it (agreed by all ranks) after each iteration,
    saves a checkpoint and exits cleanly."""

    def __init__(self):
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def agreed(self, grid) -> bool:
        """Any rank signalled: a host value, so a CPU tensor on the gloo control group."""
        flag = torch.tensor([1.0 if self.received else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=grid.control_group)
        return bool(flag.item())

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def step_trace(log: LoggingSettings, iteration: int, t, device) -> Trace | None:
    """The pipeline trace of the last iteration (``--pipeline-trace``; ``iteration`` 0-based),
    timed on the device's clock: CUDA events on a GPU (host timestamps time the launches only)."""
    if not log.pipeline_trace or iteration != t.train_iters - 1:
        return None
    return Trace(Clock(device))


def write_trace(trace_dir: str, trace, grid, num_micro: int, num_chunks: int, schedule: str = "1f1b") -> None:
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"trace_rank{grid.rank:03d}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": grid.rank, "pp_rank": grid.pp_rank, "tp_rank": grid.tp_rank,
                   "dp_rank": grid.dp_rank, "P": grid.layout.pp, "V": num_chunks, "M": num_micro,
                   "schedule": schedule, "events": trace.events}, f)
    os.replace(path + ".tmp", path)


@dataclass
class Run:
    """What the loop works with, built by :func:`megalite.train.pretrain.pretrain`."""
    plan: RunPlan                  # the run's settings and what setup worked out (load_dir, ...)
    config: Config
    tokenizer: object              # any of megalite.data.tokenizer's classes (no common base; saved with the run)
    grid: ProcessGrid
    device: torch.device
    model: list[torch.nn.Module]   # this rank's pipeline chunks
    optimizer: DistributedOptimizer
    scaler: LossScaler
    stream: BatchStream            # the train data
    valid_iter: MicroBatchIterator | None
    start_iteration: int
    say: Callable[..., None]       # rank-0 printer
    monitor: Monitor
    steps: StepLog
    faults: FaultInjector
    saver: AsyncCheckpointSaver | AsyncDcpSaver | None = None  # --async-save's background saver
    save_fn: Callable[..., str] | None = None  # synchronous save function
    straggler: StragglerMonitor | None = None
    profiler: Profiler | None = None
    tracker: MemoryTracker | None = None
    watchdog: HangWatchdog | None = None
    log_file: TextIO | None = None
    log_lines: list[dict] = field(default_factory=list)


class TrainLoop:
    def __init__(self, run: Run):
        self.r = run
        t = run.config.train
        self.t = t
        self.ckpt: CheckpointSettings = run.plan.checkpoint
        self.res: ResilienceSettings = run.plan.resilience
        a = self.res
        self.num_micro = t.global_batch_size // (t.micro_batch_size * run.grid.layout.dp)
        self.term = TermSignal() if self.ckpt.save else None
        resumed = run.plan.load_dir if run.start_iteration > 0 else None  # not a --finetune / weights-only start
        self.loaded_losses = checkpoint_losses(resumed)  # a resume: the spike check is armed from its first step
        self.sentinel = LossSentinel(t.fp16, a.check_for_spiky_loss, a.spiky_loss_factor, a.spiky_loss_window,
                                     history=self.loaded_losses)
        self.checked = a.checked  # else StepLog stops on non-finite values
        self.rollbacks = 0
        self.batch_of: dict[int, int] = {}  # iteration -> the global batch it trained on
        self.memory = ""  # the memory column of the latest step's log line

    def prints(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` has a log line (every --log-interval, and the first)."""
        return iteration % self.t.log_interval == 0 or iteration == self.r.start_iteration + 1

    # -- one iteration -------------------------------------------------------------------
    def step(self, iteration: int):
        """Run iteration ``iteration`` (1-based); returns its PendingStep and its pipeline trace (or None)."""
        r, t = self.r, self.t
        if r.profiler:
            r.profiler.step(iteration)
        r.faults.before_step(iteration)
        step_start = time.perf_counter()
        number, host_batches = r.stream.next()
        self.batch_of[iteration] = number
        attended = attended_length(host_batches)  # packed documents: the attention work done (MFU)
        micro_batches = r.faults.corrupt(iteration, [to_device(b, r.device) for b in host_batches])
        if r.tracker is not None:  # the step's batches live on the device through the step
            r.tracker.register([x for b in micro_batches for x in b.values()], "data")
        trace = step_trace(r.plan.logging, iteration - 1, t, r.device)
        if r.straggler is not None:
            r.straggler.start_step()
        r.faults.slow_compute(iteration, r.device)
        try:
            with count_collectives() as traffic, r.tracker or contextlib.nullcontext():
                if r.tracker is not None:
                    r.tracker.reset_peak()
                result = train_step(r.model, r.optimizer, micro_batches, t, iteration - 1, r.scaler, r.grid, trace)
        except RuntimeError as error:
            if dist.is_initialized() and looks_like_timeout(error):
                raise hang_report(r.grid, r.plan.launch_settings.distributed_timeout_minutes * 60) from error
            raise
        extra = {}
        if r.straggler is not None:
            r.straggler.end_step()
            report = r.straggler.report(iteration)
            if report is not None:
                r.say(r.straggler.format(report))
                extra["straggler"] = report
        self.memory, memory_stats = memory_line(r.optimizer, reset_peak=self.prints(iteration), device=r.device)
        return PendingStep(iteration, result, step_start, traffic, self.memory, memory_stats,
                           r.tracker.summary() if r.tracker is not None else None, attended, extra), trace

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> list[dict]:
        r, t, c = self.r, self.t, self.ckpt
        iteration = r.start_iteration
        if self.res.check_for_spiky_loss:
            r.say(self.sentinel.describe_arming(iteration))
        try:
            while iteration < t.train_iters:
                iteration += 1
                pending, trace = self.step(iteration)
                r.steps.add(pending)
                print_line = self.prints(iteration)
                evaluate_now = r.valid_iter is not None and iteration % t.eval_interval == 0
                stop = self.term is not None and self.term.agreed(r.grid)
                save_now = bool(c.save and ((c.save_interval and iteration % c.save_interval == 0) or stop))
                if (print_line or evaluate_now or save_now or stop or iteration == t.train_iters
                        or r.faults.due("kill", iteration)):  # else: no sync, the GPU stays fed
                    if trace is not None:
                        write_trace(r.plan.logging.pipeline_trace, trace, r.grid, self.num_micro, len(r.model),
                                    t.pipeline_schedule)
                    back_to = self.flush(iteration, print_line, evaluate_now, pending.traffic)
                    if back_to is not None:
                        iteration = back_to
                        continue
                if r.watchdog is not None:
                    r.watchdog.beat()
                r.faults.after_step(iteration)
                if r.saver is not None:
                    for path in r.saver.poll():
                        r.say(f"saved checkpoint {os.path.abspath(path)}")
                if save_now:
                    self.save(iteration)
                if stop:
                    r.say(f"SIGTERM: saving iteration {iteration} and stopping" if r.saver is not None
                          else f"SIGTERM: saved iteration {iteration} and stopping")
                    break
            finished = bool(r.log_lines) and r.log_lines[-1]["iteration"] == t.train_iters
            if c.save and finished and not (c.save_interval and t.train_iters % c.save_interval == 0):
                self.save(t.train_iters)
        finally:
            if r.saver is not None:  # a stop, the end and an exception: the write in flight completes
                failing = sys.exc_info()[0] is not None  # an exception is on its way out
                try:
                    for path in r.saver.wait():
                        r.say(f"saved checkpoint {os.path.abspath(path)}")
                except CheckpointError as e:
                    if not failing:
                        raise
                    r.say(f"(and the asynchronous save failed: {e})")  # the first error stays the one reported
                finally:
                    r.saver.close()
            if self.term is not None:
                self.term.restore()
        return r.log_lines

    def flush(self, iteration: int, print_line: bool, evaluate_now: bool, traffic) -> int | None:
        """Read the pending steps, check them, log the good ones. Returns the iteration a
        rollback went back to (None: no rollback)."""
        r, t = self.r, self.t
        records = r.steps.flush()
        if self.checked:
            bad = agree(self.sentinel.first_bad(records), r.grid)
            if bad is not None:
                self._log(iteration, [x for x in records if x["iteration"] < bad.iteration], False, traffic)
                return self.rollback(bad)
        if evaluate_now:
            with r.optimizer.full_weights():
                val = evaluate(r.model, [to_device(next(r.valid_iter), r.device)
                                         for _ in range(t.eval_iters * self.num_micro)], t, r.grid)
            records[-1]["valid_loss"] = None if r.device.type == "meta" else val
        self._log(iteration, records, print_line, traffic)
        return None

    def _log(self, iteration, records, print_line, traffic) -> None:
        r = self.r
        for record in records:
            r.log_lines.append(record)
            if record["skipped"]:
                r.say(f"iteration {record['iteration']}: inf/nan gradients, step skipped "
                      f"(loss scale now {record['loss_scale']:g})")
            r.monitor.log(record, self.memory, print_line and record is records[-1])
            if record.get("valid_loss") is not None:
                r.say(f"validation at iter {record['iteration']}: loss {record['valid_loss']:.4f} | "
                      f"ppl {min(1e9, math.exp(min(record['valid_loss'], 30))):.2f}")
            if record["iteration"] == r.start_iteration + 1 and traffic:
                r.say(f"collectives/step (rank {r.grid.rank}, bytes handed): " + ", ".join(
                    f"{k} {v['calls']} calls {v['bytes'] / 2**20:.2f} MiB" for k, v in sorted(traffic.items())))
            self._write(record)

    def _write(self, record: dict) -> None:
        if self.r.log_file:
            self.r.log_file.write(json_line(record) + "\n")  # strict JSON: null for a NaN
            self.r.log_file.flush()

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, iteration: int) -> None:
        r, c = self.r, self.ckpt
        extra = {"skipped_batches": [list(w) for w in r.stream.windows], "data_batches": r.stream.batches_read,
                 "recent_losses": recent_good_losses(self.loaded_losses, r.log_lines, iteration,
                                                     max(self.res.spiky_loss_window, WARMUP_LOSSES))}
        save = r.saver.save if r.saver is not None else r.save_fn
        path = save(c.save, iteration, r.optimizer, r.scaler, r.config, r.grid, r.stream.consumed_samples,
                    c.keep_last, r.tokenizer, extra_meta=extra)
        if r.saver is not None:
            r.say(f"checkpoint {os.path.abspath(path)}: written in the background")
        else:
            r.say(f"saved checkpoint {os.path.abspath(path)}")
        if r.watchdog is not None:
            r.watchdog.beat()  # a long save is progress too

    # -- rollback --------------------------------------------------------------------------
    def rollback(self, bad) -> int:
        """Go back to the latest checkpoint and skip the batches that led to ``bad``; returns
        the checkpoint's iteration (the loop goes on from the one after it)."""
        r, a, t = self.r, self.res, self.t
        save = self.ckpt.save
        if self.rollbacks >= a.max_rollbacks:
            raise exhausted(bad, a.max_rollbacks, a.spiky_loss_factor, a.spiky_loss_window)
        if r.saver is not None:
            for path in r.saver.wait():  # the newest checkpoint may still be in flight
                r.say(f"saved checkpoint {os.path.abspath(path)}")
        directory = self._rollback_checkpoint(bad)
        meta = load_checkpoint(directory, r.optimizer, r.scaler, r.config, r.grid)
        back_to = meta["iteration"]
        if back_to >= bad.iteration:  # --save holds another run's later checkpoint
            raise no_checkpoint(bad, save, a.spiky_loss_factor, a.spiky_loss_window)
        batches = meta.get("data_batches", meta["consumed_samples"] // t.global_batch_size)
        for w in meta.get("skipped_batches", []):
            r.stream.skip(*w)
        last = self.batch_of[bad.iteration]
        first = max(last - a.rollback_skip_batches + 1, batches + 1)
        if a.rollback_skip_batches > 0:
            r.stream.skip(first, last)
        r.stream.rewind(batches)
        if r.valid_iter is not None:  # validation continues where it was at the checkpoint
            r.valid_iter = r.valid_iter.at(0)
            for _ in range((back_to // t.eval_interval) * t.eval_iters * self.num_micro):
                next(r.valid_iter)
        self.rollbacks += 1
        self.sentinel.forget_after(back_to)
        self.batch_of = {i: b for i, b in self.batch_of.items() if i <= back_to}
        r.log_lines[:] = [x for x in r.log_lines if x["iteration"] <= back_to]
        skipped = "no batch skipped" if a.rollback_skip_batches == 0 else (
            f"skipping global batch {first}" if first == last else f"skipping global batches {first}-{last}")
        r.say(f"rollback {self.rollbacks}/{a.max_rollbacks}: {bad.describe(a.spiky_loss_factor, a.spiky_loss_window)}; "
              f"restored {os.path.abspath(meta['directory'])} (iteration {back_to}), {skipped}; going on from iteration {back_to + 1}")
        self._write({"event": "rollback", "rollback": self.rollbacks, "iteration": bad.iteration, "kind": bad.kind,
                     "loss": bad.loss, "grad_norm": bad.grad_norm, "restored": os.path.abspath(meta["directory"]),
                     "restored_iteration": back_to, "skipped_batches": [first, last] if a.rollback_skip_batches else None})
        return back_to

    def _rollback_checkpoint(self, bad) -> str:
        a, save = self.res, self.ckpt.save
        resumed = self.r.plan.load_dir if self.r.start_iteration > 0 else None  # not a --finetune / weights-only start
        for root in (save, resumed):
            if not root:
                continue
            try:
                directory = resolve_checkpoint(root, None)
            except CheckpointError:  # nothing saved there yet
                continue
            return directory
        raise no_checkpoint(bad, save, a.spiky_loss_factor, a.spiky_loss_window)


def checkpoint_writer(c: CheckpointSettings) -> Callable[..., str]:
    """The synchronous save of ``--ckpt-format``."""
    return save_dcp_checkpoint if c.ckpt_format == "torch_dcp" else save_checkpoint


def checkpoint_saver(plan: RunPlan, grid: ProcessGrid) -> AsyncCheckpointSaver | AsyncDcpSaver | None:
    """The background saver of ``--async-save`` (None without it)."""
    c = plan.checkpoint
    if not c.async_save:
        return None
    if c.ckpt_format == "torch_dcp":
        return AsyncDcpSaver(grid)
    # as long as a collective may take
    return AsyncCheckpointSaver(grid, timeout_s=60 * plan.launch_settings.distributed_timeout_minutes)


def straggler_monitor(r: ResilienceSettings, grid: ProcessGrid, device: torch.device) -> StragglerMonitor | None:
    if not r.straggler_report_interval:
        return None
    return StragglerMonitor(grid, r.straggler_report_interval, r.straggler_threshold, device)
