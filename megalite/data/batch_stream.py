"""The training loop's global batches, numbered, with windows that are read and not trained on.

Global batch ``n`` (numbered from 1, as iterations are) is ``M`` micro-batches of this DP
rank from the train iterator. A *skip window* ``(first, last)`` names batches that are read
and dropped: a bad stretch of data, given with ``--skip-batches`` or found by a rollback. The
data position is the number of batches read, skipped ones included, so a checkpoint's
``consumed_samples = batches x global batch`` resumes after a skipped window, and the
windows themselves are recorded beside it (metadata ``skipped_batches``).

Without skips, iteration ``i`` trains on batch ``i``; after skipping batch 7, iteration 7
trains on batch 8.
"""
from __future__ import annotations



def merge_windows(windows) -> list[tuple[int, int]]:
    """Inclusive (first, last) windows, sorted, overlapping or adjacent ones merged."""
    merged: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in windows):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def batches_in(windows) -> int:
    """Batches the (merged) skip windows take beyond the trained ones."""
    return sum(b - a + 1 for a, b in windows)


class BatchStream:
    def __init__(self, micro_batches, num_micro: int, global_batch_size: int, batches_read: int = 0,
                 windows=()):
        self.iterator, self.num_micro, self.global_batch_size = micro_batches, num_micro, global_batch_size
        self.batches_read = batches_read
        self.windows = merge_windows(windows)

    @property
    def consumed_samples(self) -> int:
        return self.batches_read * self.global_batch_size

    def skipped(self, number: int) -> bool:
        return any(a <= number <= b for a, b in self.windows)

    def next(self) -> tuple[int, list[dict]]:
        """(batch number, its micro-batches), past any skipped batches."""
        while self.skipped(self.batches_read + 1):
            self._read()
        batch = self._read()
        return self.batches_read, batch

    def _read(self) -> list[dict]:
        self.batches_read += 1
        return [next(self.iterator) for _ in range(self.num_micro)]

    def skip(self, first: int, last: int) -> None:
        self.windows = merge_windows([*self.windows, (first, last)])

    def rewind(self, batches_read: int) -> None:
        """Read again from after batch ``batches_read`` (the iterator repositions itself)."""
        self.iterator = self.iterator.at(batches_read * self.global_batch_size)
        self.batches_read = batches_read

    def reserve(self) -> int:
        return batches_in(self.windows)
