"""From command-line data options to train/valid/test micro-batch iterators.

Each iterator yields micro-batches for *this* data-parallel rank as dicts of
torch tensors, with ``b = micro_batch_size`` and ``s = seq_length``:

* ``tokens``       (b, s) int64:   sample[:, :-1], the model inputs;
* ``labels``       (b, s) int64:   sample[:, 1:], the next token of each input;
* ``loss_mask``    (b, s) float32: all ones (every position is trained on);
* ``position_ids`` (b, s) int64:   0 .. s-1 in every row.

The train iterator is finite: it reads samples ``consumed_train_samples ..
train_samples`` in :class:`~megalite.data.sampler.PretrainingSampler` order
and then stops.  The valid and test iterators are endless: after their last
micro-batch they start again from their first, so an evaluation of ``N``
steps always just calls ``next()`` ``N`` times and later evaluations continue
where the previous one stopped (wrapping around).  An iterator is ``None``
when its split has no documents or is asked for 0 samples.
"""
from __future__ import annotations

import numpy as np
import torch

from megalite.data.blended import build_blended_datasets, parse_data_path
from megalite.data.gpt_dataset import GPTDataset, MockGPTDataset, split_documents
from megalite.data.indexed_dataset import DatasetError, IndexedDataset
from megalite.data.sampler import PretrainingSampler

SPLIT_NAMES = ("train", "valid", "test")


def collate(samples: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Stack samples of ``s + 1`` tokens into a micro-batch dict (see module doc)."""
    batch = torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))
    b, s = batch.shape[0], batch.shape[1] - 1
    return {
        "tokens": batch[:, :-1].contiguous(),
        "labels": batch[:, 1:].contiguous(),
        "loss_mask": torch.ones(b, s, dtype=torch.float32),
        "position_ids": torch.arange(s, dtype=torch.int64).repeat(b, 1),
    }


class MicroBatchIterator:
    """Iterates collated micro-batches of ``dataset`` in ``sampler`` order.

    With ``cyclic=True`` it never ends: when the sampler is exhausted it starts
    over from the sampler's first micro-batch.
    """

    def __init__(self, dataset, sampler: PretrainingSampler, cyclic: bool):
        if cyclic and len(sampler) == 0:
            raise ValueError("a cyclic iterator needs at least one micro-batch")
        self.dataset = dataset
        self.sampler = sampler
        self.cyclic = cyclic
        self._indices = iter(sampler)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        try:
            indices = next(self._indices)
        except StopIteration:
            if not self.cyclic:
                raise
            self._indices = iter(self.sampler)
            indices = next(self._indices)
        return collate([self.dataset[i] for i in indices])


def check_dataset_vocab(dataset: IndexedDataset, vocab_size: int) -> None:
    """Every token id of the dataset lies in [0, vocab_size) (else DatasetError)."""
    max_id = int(dataset.tokens.max()) if dataset.num_tokens else -1
    if max_id >= vocab_size:
        raise DatasetError(
            f"Dataset {dataset.prefix} contains token id {max_id}, but the vocabulary size "
            f"is {vocab_size} (ids must be < {vocab_size}). Use the tokenizer the data was "
            f"preprocessed with, or re-run tools/preprocess_data.py with this tokenizer."
        )


def _check_vocab(dataset: IndexedDataset, vocab_size: int, eod_token: int | None) -> None:
    check_dataset_vocab(dataset, vocab_size)
    if eod_token is not None and not 0 <= eod_token < vocab_size:
        raise ValueError(f"eod_token={eod_token} must lie in [0, {vocab_size}) "
                         f"(vocab_size={vocab_size}).")


def build_datasets(*, data_prefix: str | list[str] | None, mock: bool, split: str,
                   vocab_size: int, seq_length: int, seed: int, num_samples: list[int],
                   eod_token: int | None = None) -> list:
    """The [train, valid, test] datasets (``None`` for an empty split).

    ``mock=True`` takes precedence over ``data_prefix``; mock splits use seeds
    ``3*seed + k`` (k = 0, 1, 2) so they differ from each other.  Real data is
    split by documents with :func:`split_documents` and every split uses
    ``seed`` (their documents differ already).  ``data_prefix`` is one prefix
    or the ``--data-path`` values of a blend (``["0.7", "A", "0.3", "B"]``; see
    :mod:`megalite.data.blended`); a single prefix behaves as it always has.
    """
    if mock:
        return [MockGPTDataset(vocab_size, seq_length, n, 3 * seed + k) if n > 0 else None
                for k, n in enumerate(num_samples)]
    if not data_prefix:
        raise ValueError("No training data: pass --data-path PREFIX (made by "
                         "tools/preprocess_data.py) or --mock-data.")
    prefixes, weights = parse_data_path(data_prefix)
    if len(prefixes) > 1:
        blend = [IndexedDataset(prefix) for prefix in prefixes]
        for indexed in blend:
            _check_vocab(indexed, vocab_size, eod_token)
        return build_blended_datasets(blend, weights, split=split, seq_length=seq_length,
                                      seed=seed, num_samples=num_samples)
    indexed = IndexedDataset(prefixes[0])
    _check_vocab(indexed, vocab_size, eod_token)
    ranges = split_documents(len(indexed), split)
    return [GPTDataset(indexed, doc_range, seq_length, n, seed)
            if n > 0 and len(doc_range) > 0 else None
            for doc_range, n in zip(ranges, num_samples)]


def build_data_iterators(*, data_prefix: str | list[str] | None, mock: bool, split: str,
                         vocab_size: int, seq_length: int, seed: int, micro_batch_size: int,
                         dp_rank: int,
                         dp_size: int, train_samples: int, valid_samples: int,
                         test_samples: int, consumed_train_samples: int = 0,
                         eod_token: int | None = None):
    """Return ``(train_iter, valid_iter, test_iter)``; see the module docstring."""
    num_samples = [train_samples, valid_samples, test_samples]
    step = micro_batch_size * dp_size
    for name, n in zip(SPLIT_NAMES, num_samples):
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{name}_samples={n!r} must be a non-negative integer.")
        if 0 < n < step:
            raise ValueError(
                f"{name}_samples={n} is smaller than one micro-batch step of "
                f"micro_batch_size x data-parallel size = {micro_batch_size} x {dp_size} "
                f"= {step} samples. Ask for at least {step} {name} samples, or 0 to skip."
            )
    datasets = build_datasets(data_prefix=data_prefix, mock=mock, split=split,
                              vocab_size=vocab_size, seq_length=seq_length, seed=seed,
                              num_samples=num_samples, eod_token=eod_token)
    iterators = []
    for k, (dataset, n) in enumerate(zip(datasets, num_samples)):
        if dataset is None:
            iterators.append(None)
            continue
        consumed = consumed_train_samples if k == 0 else 0
        sampler = PretrainingSampler(n, consumed, micro_batch_size, dp_rank, dp_size)
        iterators.append(MicroBatchIterator(dataset, sampler, cyclic=k > 0))
    return tuple(iterators)
