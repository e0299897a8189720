"""GPT training samples cut from an indexed dataset, plus a mock dataset.

Sample construction (``GPTDataset``), with ``L = seq_length``:

1. The documents of ``doc_range`` are shuffled with the seed, once per epoch
   (a fresh permutation for every epoch), and the epochs are concatenated
   into one document order.  Enough epochs are used that the resulting token
   stream has at least ``num_samples * L + 1`` tokens.
2. Sample ``j`` is the window ``stream[j*L : j*L + L + 1]``: ``L + 1`` tokens,
   so inputs ``[:-1]`` and labels ``[1:]`` both have length ``L``.
   Consecutive windows share one token (the last of ``j`` is the first of
   ``j + 1``) and windows run across document and epoch boundaries.
3. ``ds[i]`` returns window ``sample_order[i]``, where ``sample_order`` is a
   seeded permutation of ``0 .. num_samples - 1``.

The stream is never materialised: ``stream_starts`` holds the stream offset
where each document of the order begins, and a window is located with
``np.searchsorted``.  Everything is a function of the seed, so two datasets
built with the same arguments return identical samples.

Supervised fine-tuning data carries a second indexed dataset of the same
document sizes, ``PREFIX_loss_mask`` (uint8, 1 on the tokens to be predicted;
see :mod:`megalite.data.sft`).  When it is given, the same window is cut from it
and a sample is ``{"tokens": ..., "token_mask": ...}`` (both ``L + 1`` long);
otherwise a sample is the token array alone.
"""
from __future__ import annotations

import math
import re

import numpy as np

from megalite.data.indexed_dataset import DatasetError, IndexedDataset


def parse_split(split: str) -> list[float]:
    """Parse a Megatron ``--split`` string ("969,30,1") into 3 normalized weights.

    Weights are separated by ``,`` or ``/``; fewer than three are padded with
    zeros ("90,10" means no test split).
    """
    parts = [p.strip() for p in re.split(r"[,/]", str(split))]
    hint = "Use 1 to 3 non-negative numbers separated by commas, e.g. --split 969,30,1."
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r} is not a list of numbers. {hint}") from None
    if len(weights) > 3:
        raise ValueError(f"--split {split!r} has {len(weights)} parts; at most 3 "
                         f"(train, valid, test). {hint}")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"--split {split!r} has a negative or non-finite weight. {hint}")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--split {split!r} sums to zero, so no split gets any data. {hint}")
    weights += [0.0] * (3 - len(weights))
    return [w / total for w in weights]


def split_documents(num_docs: int, split: str = "969,30,1") -> list[range]:
    """Divide documents ``0 .. num_docs - 1`` into [train, valid, test] ranges.

    Boundary ``k`` is ``round(num_docs * (w_0 + ... + w_{k-1}))``, so the ranges
    are contiguous, cover every document and the last one ends at ``num_docs``.
    """
    if not isinstance(num_docs, int) or num_docs < 0:
        raise ValueError(f"num_docs={num_docs!r} must be a non-negative integer.")
    weights = parse_split(split)
    bounds = [0]
    for k in range(1, 3):
        bounds.append(min(num_docs, int(round(num_docs * sum(weights[:k])))))
    bounds.append(num_docs)
    return [range(bounds[k], bounds[k + 1]) for k in range(3)]


def check_seed(seed) -> int:
    """Seeds feed ``np.random.default_rng``, which needs a non-negative integer."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer (--seed).")
    return int(seed)


class GPTDataset:
    """``num_samples`` windows of ``seq_length + 1`` tokens (see module docstring).

    ``shuffle=False`` keeps documents and samples in order (epoch after epoch
    of ``doc_range``); it exists for tests and debugging.
    """

    def __init__(self, indexed_dataset: IndexedDataset, doc_range: range, seq_length: int,
                 num_samples: int, seed: int, shuffle: bool = True,
                 loss_mask_dataset: IndexedDataset | None = None):
        if seq_length < 1 or num_samples < 1:
            raise ValueError(f"seq_length={seq_length} and num_samples={num_samples} must "
                             f"both be >= 1.")
        if len(doc_range) == 0:
            raise ValueError(
                f"GPTDataset got an empty document range {doc_range}: this split has no "
                f"documents. Give it a larger --split weight or use more data."
            )
        if doc_range.step != 1 or doc_range.start < 0 or doc_range.stop > len(indexed_dataset):
            raise ValueError(f"doc_range {doc_range} must be a contiguous range inside the "
                             f"dataset's {len(indexed_dataset)} documents.")
        if loss_mask_dataset is not None and not np.array_equal(loss_mask_dataset.sizes,
                                                                indexed_dataset.sizes):
            raise DatasetError(
                f"{loss_mask_dataset.prefix} (a loss mask) does not have the document sizes of "
                f"{indexed_dataset.prefix}: they were not written together. Re-create both with "
                f"tools/preprocess_data.py --json-format sft.")
        self.indexed_dataset = indexed_dataset
        self.loss_mask_dataset = loss_mask_dataset
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed = check_seed(seed)
        self.doc_range = doc_range
        docs = np.arange(doc_range.start, doc_range.stop, dtype=np.int64)
        tokens_per_epoch = int(indexed_dataset.sizes[doc_range.start:doc_range.stop].sum())
        self.tokens_per_epoch = tokens_per_epoch
        if tokens_per_epoch < seq_length + 1:
            raise ValueError(
                f"Documents {doc_range} hold {tokens_per_epoch} tokens, fewer than one "
                f"sample of seq_length + 1 = {seq_length + 1}. Use more documents (change "
                f"--split) or a shorter --seq-length."
            )
        needed = num_samples * seq_length + 1
        self.num_epochs = -(-needed // tokens_per_epoch)  # ceil division
        orders = [np.random.default_rng([seed, 0, epoch]).permutation(docs) if shuffle
                  else docs for epoch in range(self.num_epochs)]
        self.doc_order = np.concatenate(orders)
        sizes = np.asarray(indexed_dataset.sizes, dtype=np.int64)[self.doc_order]
        self.stream_starts = np.zeros(len(self.doc_order) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.stream_starts[1:])
        self.sample_order = (np.random.default_rng([seed, 1]).permutation(num_samples)
                             if shuffle else np.arange(num_samples))

    def __len__(self) -> int:
        return self.num_samples

    def window(self, j: int, source: IndexedDataset | None = None) -> np.ndarray:
        """Stream tokens ``[j*L, j*L + L + 1)`` (window ``j``, before sample shuffling),
        cut from ``source`` (default: the tokens; or the loss mask, same sizes)."""
        source = self.indexed_dataset if source is None else source
        start = j * self.seq_length
        stop = start + self.seq_length + 1
        first = int(np.searchsorted(self.stream_starts, start, side="right")) - 1
        last = int(np.searchsorted(self.stream_starts, stop - 1, side="right")) - 1
        pieces = []
        for k in range(first, last + 1):
            doc_start = int(self.stream_starts[k])
            lo = max(start - doc_start, 0)
            hi = min(stop - doc_start, int(self.stream_starts[k + 1]) - doc_start)
            if hi > lo:
                pieces.append(source.get(int(self.doc_order[k]), lo, hi - lo))
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {i} is out of range for {self.num_samples} samples")
        j = int(self.sample_order[i])
        if self.loss_mask_dataset is None:
            return self.window(j)
        return {"tokens": self.window(j), "token_mask": self.window(j, self.loss_mask_dataset)}


class MockGPTDataset:
    """Random token samples for ``--mock-data``: no files, no tokenizer.

    Sample ``i`` is ``seq_length + 1`` ids drawn uniformly from
    ``[0, vocab_size)`` by ``np.random.default_rng([seed, i])``, so it depends
    only on ``(seed, i)`` and not on which samples were read before.

    With ``eod_token`` (given when a packed-document flag is on) the sample
    holds documents instead: its ids are drawn from the vocabulary without
    ``eod_token``, then document lengths are drawn uniformly from
    ``[1, max(1, seq_length // 2)]`` by ``np.random.default_rng([seed, i, 1])``
    and an EOD closes each document (so about four documents per sample, a
    document of length 1 is two EODs in a row, and the first and last
    documents run over the sample's edges).
    """

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int,
                 eod_token: int | None = None):
        if vocab_size < 1 or seq_length < 1 or num_samples < 1:
            raise ValueError(f"MockGPTDataset needs vocab_size={vocab_size}, seq_length="
                             f"{seq_length} and num_samples={num_samples} all >= 1.")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = check_seed(seed)
        if eod_token is not None and (vocab_size < 2 or not 0 <= eod_token < vocab_size):
            raise ValueError(f"MockGPTDataset: eod_token={eod_token} must lie in [0, {vocab_size}) "
                             f"with vocab_size >= 2 (other ids are needed for the documents).")
        self.eod_token = eod_token

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {i} is out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, i])
        n = self.seq_length + 1
        if self.eod_token is None:
            return rng.integers(0, self.vocab_size, size=n, dtype=np.int64)
        ids = rng.integers(0, self.vocab_size - 1, size=n, dtype=np.int64)
        ids[ids >= self.eod_token] += 1  # every id but the EOD
        lengths = np.random.default_rng([self.seed, i, 1]).integers(
            1, max(1, self.seq_length // 2) + 1, size=n)
        ends = np.cumsum(lengths) - 1
        ids[ends[ends < n]] = self.eod_token
        return ids
