"""Straggler reports (``--straggler-report-interval N``): every N iterations, name the ranks
whose compute is slower than their peers', with their place in the grid and their host.

What is measured, and why not the step time. Every step ends in collectives (the gradient
all-reduce, the loss average, pipeline sends), so a slow rank makes every peer wait for it:
the peers' step times grow by the same amount and all ranks report (nearly) the same step
time. What differs is where the time goes. So each rank measures

    compute = step time - time blocked in collectives and p2p waits

where "blocked" is the time spent inside the synchronous collectives of
:mod:`megalite.parallel.comm`, inside ``wait()`` on its asynchronous handles and inside the
pipeline / ring / expert waits (``with comm.blocked(): ...``). The slow rank's peers spend
the extra time blocked, so their compute stays normal, while the slow rank's compute holds
the extra time. (Blocked time also holds the wire time of each collective: the transfer is
not compute either.)

Clocks. On a CPU the host clock (``time.perf_counter``) around the step and around each wait.
On a GPU the host does not wait for an NCCL collective (``wait()`` only makes the current
stream wait), so the same points are CUDA events recorded on the current stream: the step's
pair and one pair per wait. Nothing is read until a report iteration, where one
synchronization reads them all (the elapsed time between a pair is the time the stream spent
between them: blocked in the wait, or computing in the step). Events are reused from a pool.

Cost. Off (interval 0): none; ``comm.blocked()`` returns a shared no-op context and the
async handles are torch's own. On: two clock reads (CPU) or two event records (GPU) per wait
and per step, and per report ONE all-gather of one float per rank on ``grid.control_group``
(gloo, host values). The host names travel once, when the monitor is built.

Who is a straggler. Ranks of one pipeline stage do the same work; stages need not (the first
holds the embedding, the last the output layer and loss, and a 2-core test machine shows the
last stage 50% slower). So a rank is compared with the median compute of its own stage, and
named when ``compute > (1 + threshold) * median``. The median is the lower one of an even
count (``statistics.median_low``): in a stage of two ranks the reference is the faster one, so
a slow rank's excess is measured whole rather than halved into the mean. A stage of one rank
(pipeline parallelism alone) has no peer doing its work: it is compared with the lower median
of all ranks.
"""
from __future__ import annotations

import socket
import statistics
import time

import torch
import torch.distributed as dist

from megalite.parallel import comm

HOST_BYTES = 64  # a host name is sent as this many UTF-8 bytes (longer names are cut)


class BlockedTimer:
    """The process's blocked-time accumulator (installed with :func:`comm.time_blocked`):
    a reusable context manager; nested uses count once (the outermost)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0  # CPU: total of this step
        self.pairs: list[tuple] = []  # GPU: (start, end) events of this step
        self._depth = 0
        self._t0 = 0.0
        self._open = None
        self._pool: list = []

    def event(self):
        return self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)

    def release(self, events) -> None:
        self._pool.extend(events)

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            if self.cuda:
                self._open = self.event()
                self._open.record()
            else:
                self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        self._depth -= 1
        if self._depth == 0:
            if self.cuda:
                end = self.event()
                end.record()
                self.pairs.append((self._open, end))
            else:
                self.seconds += time.perf_counter() - self._t0
        return False

    def reset(self) -> None:
        """Start a new step: forget what was timed since the last one (outside the window)."""
        self.seconds = 0.0
        if self.pairs:
            self.release([e for pair in self.pairs for e in pair])
            self.pairs = []

    def take_pairs(self) -> list[tuple]:
        pairs, self.pairs = self.pairs, []
        return pairs


def role_text(layout, rank: int) -> str:
    """A rank's place in the grid: ``pp 0, tp 1, dp 0`` (+ ``cp c`` with context
    parallelism, ``ep e`` with experts)."""
    c = layout.coord(rank)
    parts = [f"pp {c.pp}", f"tp {c.tp}"]
    if layout.cp > 1:
        parts.append(f"cp {c.cp}")
    parts.append(f"dp {c.dp}")
    if layout.experts:
        parts.append(f"ep {layout.expert_coord(rank)[0]}")
    return ", ".join(parts)


def references(compute_ms: list[float], stages: list[int]) -> list[float]:
    """Each rank's reference time: the lower median of its stage, or of all ranks where the
    stage is the rank alone (module docstring)."""
    overall = statistics.median_low(compute_ms)
    by_stage: dict[int, list[float]] = {}
    for ms, stage in zip(compute_ms, stages):
        by_stage.setdefault(stage, []).append(ms)
    return [statistics.median_low(by_stage[s]) if len(by_stage[s]) > 1 else overall for s in stages]


def build_report(iteration: int, compute_ms: list[float], threshold: float, stages: list[int],
                 roles: list[str], hosts: list[str]) -> dict:
    """The report of gathered compute times (pure: every rank builds the same one)."""
    refs = references(compute_ms, stages)
    stragglers = []
    for rank, (ms, ref) in enumerate(zip(compute_ms, refs)):
        if ref > 0 and ms > (1 + threshold) * ref:
            stragglers.append({"rank": rank, "compute_ms": round(ms, 3), "median_ms": round(ref, 3),
                               "slower_by": round(ms / ref - 1, 4),
                               "role": roles[rank], "host": hosts[rank]})
    stragglers.sort(key=lambda s: -s["compute_ms"])
    return {"iteration": iteration, "compute_ms": [round(ms, 3) for ms in compute_ms],
            "median_ms": round(statistics.median(compute_ms), 3), "threshold": threshold,
            "stragglers": stragglers}


def format_report(report: dict) -> str:
    """``stragglers at iteration 30: rank 1 (pp 0, tp 0, dp 1, host h) 512 ms vs median 21 ms
    (+2338%)``, or ``stragglers at iteration 30: none (compute median 21 ms, max 25 ms on rank 3)``."""
    head = f"stragglers at iteration {report['iteration']}:"
    if not report["stragglers"]:
        ms = report["compute_ms"]
        slowest = max(range(len(ms)), key=ms.__getitem__)
        return (f"{head} none (compute median {report['median_ms']:.1f} ms, max {ms[slowest]:.1f} ms "
                f"on rank {slowest}; threshold +{report['threshold']:.0%})")
    named = [f"rank {s['rank']} ({s['role']}, host {s['host']}) {s['compute_ms']:.1f} ms vs median "
             f"{s['median_ms']:.1f} ms (+{s['slower_by']:.0%})" for s in report["stragglers"]]
    return f"{head} " + "; ".join(named)


class StragglerMonitor:
    """Times each step's compute on this rank; every ``interval`` iterations gathers the
    ranks' mean compute time and names the stragglers (module docstring).

    The loop calls :meth:`start_step` once the batch is on the device, :meth:`end_step` after
    the train step, then :meth:`report` (every rank: it holds a collective on report
    iterations). ``interval`` 0: everything is a no-op and nothing is installed."""

    def __init__(self, grid, interval: int, threshold: float, device):
        self.grid, self.interval, self.threshold = grid, int(interval), float(threshold)
        self.device = torch.device(device)
        self.timer = BlockedTimer(self.device)
        self._compute_s, self._steps = 0.0, 0  # CPU: this interval's total
        self._pending: list[tuple] = []  # GPU: (step start, step end, wait pairs) per step
        self._t0, self._start = 0.0, None
        if not self.interval:
            return
        layout = grid.layout
        self.world = layout.world_size
        self.stages = [layout.coord(r).pp for r in range(self.world)]
        self.roles = [role_text(layout, r) for r in range(self.world)]
        self.hosts = self._gather_hosts()
        comm.time_blocked(self.timer)

    @property
    def _distributed(self) -> bool:
        return self.world > 1 and dist.is_available() and dist.is_initialized()

    def _gather_hosts(self) -> list[str]:
        name = socket.gethostname()
        if not self._distributed:
            return [name] * self.world
        mine = torch.zeros(HOST_BYTES, dtype=torch.uint8)
        raw = name.encode()[:HOST_BYTES]
        mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        out = torch.empty(self.world * HOST_BYTES, dtype=torch.uint8)
        comm._all_gather_flat(out, mine, group=self.grid.control_group)
        rows = out.view(self.world, HOST_BYTES).tolist()
        return [bytes(b for b in row if b).decode(errors="replace") for row in rows]

    def close(self) -> None:
        """Uninstall the blocked-time accumulator (a later monitor or none may follow)."""
        if self.interval and comm._BLOCKED is self.timer:
            comm.time_blocked(None)

    def start_step(self) -> None:
        if not self.interval:
            return
        self.timer.reset()
        if self.timer.cuda:
            self._start = self.timer.event()
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def end_step(self) -> None:
        if not self.interval:
            return
        if self.timer.cuda:
            end = self.timer.event()
            end.record()
            self._pending.append((self._start, end, self.timer.take_pairs()))
        else:
            self._compute_s += time.perf_counter() - self._t0 - self.timer.seconds
            self.timer.seconds = 0.0
            self._steps += 1

    def _fold_events(self) -> None:
        """GPU: read the steps' events (one synchronization), then return them to the pool."""
        if not self._pending:
            return
        self._pending[-1][1].synchronize()  # the last step's end: every earlier event is done too
        for start, end, pairs in self._pending:
            blocked = sum(a.elapsed_time(b) for a, b in pairs)
            self._compute_s += (start.elapsed_time(end) - blocked) / 1e3
            self._steps += 1
            self.timer.release([start, end] + [e for pair in pairs for e in pair])
        self._pending = []

    def mean_compute_ms(self) -> float:
        """This rank's mean compute time per step since the last report (and forget it)."""
        self._fold_events()
        ms = 1e3 * self._compute_s / self._steps if self._steps else 0.0
        self._compute_s, self._steps = 0.0, 0
        return ms

    def report(self, iteration: int) -> dict | None:
        """On multiples of the interval: the report (the same dict on every rank); else None."""
        if not self.interval or iteration % self.interval:
            return None
        mine = torch.tensor([self.mean_compute_ms()], dtype=torch.float64)
        if self._distributed:
            out = torch.empty(self.world, dtype=torch.float64)
            comm._all_gather_flat(out, mine, group=self.grid.control_group)
            compute_ms = out.tolist()
        else:
            compute_ms = mine.tolist() * self.world
        return build_report(iteration, compute_ms, self.threshold, self.stages, self.roles, self.hosts)

    def format(self, report: dict) -> str:
        return format_report(report)
