"""The record of one pipeline step on one rank: (op, micro-batch, chunk, start, end) for every
operation the executor runs (``F``, ``B``, ``W`` or ``BW``; :mod:`megalite.pipeline.orders`)."""
from __future__ import annotations

from megalite.observe.timers import Clock


class Trace:
    """(op, micro-batch, chunk, start, end) for every step of this rank, in perf_counter
    seconds. On a GPU the marks are CUDA events (see :mod:`megalite.observe.timers`), resolved to
    times when ``events`` is first read, so the trace shows when the device ran each step."""

    def __init__(self, clock: Clock | None = None):
        self.clock = clock or Clock()
        self._marks: list[tuple[str, int, int, object, object]] = []

    def record(self, op: str, micro: int, chunk: int, fn):
        start = self.clock.mark()
        result = fn()
        self._marks.append((op, micro, chunk, start, self.clock.mark()))
        return result

    @property
    def events(self) -> list[tuple[str, int, int, float, float]]:
        seconds = self.clock.seconds
        return [(op, micro, chunk, seconds(a), seconds(b)) for op, micro, chunk, a, b in self._marks]
