"""Timing that means something on a GPU: CUDA events there, the host clock elsewhere.

On a GPU the host only *queues* kernels; ``time.perf_counter`` around a forward measures
how long the launches took, not the work. A :class:`Clock` on a CUDA device records a CUDA
event on the current stream at each mark instead, and converts marks to seconds only when
asked (which waits for the device once, at the end of the step, not at every mark). On
the CPU (and on meta) a mark is simply ``time.perf_counter()``.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class Clock:
    """Marks on one device's timeline; ``seconds(mark)`` on the host clock's scale."""

    def __init__(self, device=None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._origin_host = time.perf_counter()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        """A mark as perf_counter seconds (events: origin + elapsed device time)."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self._origin_host + self._origin.elapsed_time(mark) / 1e3


class StepTimers:
    """Durations of named phases of one step (forward, backward, grad_sync, optimizer),
    summed over repeats: ``add(name, start_mark, end_mark)``, read once with
    :meth:`milliseconds` (one device synchronization on a GPU)."""

    def __init__(self, clock: Clock | None = None):
        self.clock = clock or Clock()
        self._spans: dict[str, list] = defaultdict(list)
        self._seconds: dict[str, float] = defaultdict(float)
        self._traces: list = []

    def mark(self):
        return self.clock.mark()

    def add(self, name: str, start, end) -> None:
        self._spans[name].append((start, end))

    def add_seconds(self, name: str, seconds: float) -> None:
        """A duration already resolved (e.g. from a pipeline trace)."""
        self._seconds[name] += seconds

    def add_trace(self, trace) -> None:
        """A pipeline schedule's trace: its F steps count as forward, its B and W steps (and
        BW, B and W fused) as backward, when the times are read (its marks are not resolved
        before, so no sync at the step)."""
        self._traces.append(trace)

    def milliseconds(self) -> dict[str, float]:
        out = {name: 1e3 * s for name, s in self._seconds.items()}
        for trace in self._traces:
            events = trace.events
            for op, key in (("F", "forward"), ("B", "backward"), ("W", "backward"), ("BW", "backward")):
                out[key] = out.get(key, 0.0) + 1e3 * sum(e[4] - e[3] for e in events if e[0] == op)
        for name, spans in self._spans.items():
            total = sum(self.clock.seconds(b) - self.clock.seconds(a) for a, b in spans)
            out[name] = out.get(name, 0.0) + 1e3 * total
        return out
