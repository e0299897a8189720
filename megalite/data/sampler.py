"""Which sample indices each data-parallel rank reads, micro-batch by micro-batch.

With micro-batch size ``b`` and data-parallel size ``D``, training walks the
sample indices in steps of ``b * D`` consecutive samples, starting at
``consumed_samples``.  In step ``k`` (first index ``s_k = consumed + k*b*D``)
rank ``r`` reads::

    [s_k + r*b, s_k + (r+1)*b)

A global batch of ``G = b * D * A`` samples (``A`` micro-batches of gradient
accumulation) is therefore always the contiguous block
``[consumed, consumed + G)``, whatever ``D`` is: changing the data-parallel
size only changes which rank reads which part of it.  Resuming with the saved
``consumed_samples`` continues exactly where training stopped.

A trailing step with fewer than ``b * D`` samples left is dropped.
"""
from __future__ import annotations

from typing import Iterator


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")


class PretrainingSampler:
    """Yields this rank's micro-batches as lists of sample indices, in order."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        _check_int("total_samples", total_samples, 1)
        _check_int("consumed_samples", consumed_samples, 0)
        _check_int("micro_batch_size", micro_batch_size, 1)
        _check_int("data_parallel_size", data_parallel_size, 1)
        _check_int("data_parallel_rank", data_parallel_rank, 0)
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank} must be < data_parallel_size="
                f"{data_parallel_size} (ranks are numbered 0..{data_parallel_size - 1})."
            )
        if consumed_samples >= total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} already reaches total_samples="
                f"{total_samples}: no training data is left. Raise --train-samples / "
                f"--train-iters to train further."
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    @property
    def step_size(self) -> int:
        """Samples read by all ranks together in one micro-batch step (``b * D``)."""
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Number of micro-batches this rank will yield."""
        return (self.total_samples - self.consumed_samples) // self.step_size

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for step in range(len(self)):
            start = first + step * self.step_size
            yield list(range(start, start + self.micro_batch_size))
