"""Blends of several indexed datasets: ``--data-path 0.7 A 0.3 B`` (Megatron's syntax).

``--data-path`` takes one prefix (as before) or pairs ``WEIGHT PREFIX``; the
weights are normalized to sum to 1.  For each of the train/valid/test splits:

1. Every dataset is split by documents with its own ``--split``
   (:func:`~megalite.data.gpt_dataset.split_documents`), and a
   :class:`~megalite.data.gpt_dataset.GPTDataset` over its part is asked for
   ``ceil(w * n * (1 + BLEND_MARGIN))`` samples, ``n`` being the split's
   sample count (enough: the order below never takes more than ``ceil(w * n)``).
2. The blend's sample ``i`` comes from the dataset whose achieved fraction of
   samples so far is furthest below its weight, i.e. the largest
   ``w_d * max(i, 1) - taken_d`` (the lowest dataset id on a tie), and is that
   dataset's next unused sample.  This is Megatron's greedy error-minimizing
   order: every prefix of the blend holds each dataset within one sample of
   its share.  It uses no randomness (each GPTDataset shuffles with the seed),
   so the blend is the same under any parallel layout; the data-parallel
   sampler cuts it as it cuts a single dataset, and resuming with
   ``consumed_samples`` works unchanged.
3. The blend index (dataset id, sample index within it; ``n x 2`` int32) is
   cached as ``<first prefix>.blend-<hash>.npy`` (``.npy`` without pickle),
   keyed by a hash of its inputs: the prefixes with the size and mtime of
   their ``.idx``, the weights, ``--split``, the split's name, ``--seq-length``,
   the sample counts and the seed.  A changed input gives a new file.  Every
   rank may build it at once: each writes a uniquely named temporary file and
   renames it into place (atomic), so readers see a whole file or none.  Where
   the folder is not writable the index is kept in memory only.

A valid or test split in which some datasets have no documents blends the
others (weights renormalized); a dataset with no training documents is an error.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
import warnings

import numpy as np

from megalite.data.gpt_dataset import GPTDataset, split_documents

BLEND_MARGIN = 0.005  # extra samples asked of each dataset, as in Megatron
CACHE_VERSION = 1
SPLIT_NAMES = ("train", "valid", "test")
_EXAMPLE = "e.g. --data-path 0.7 data/web 0.3 data/code"


def parse_data_path(data_path) -> tuple[list[str], list[float]]:
    """``--data-path`` values -> (prefixes, weights normalized to sum to 1).

    One value is one prefix (weight 1); more values must be ``WEIGHT PREFIX`` pairs.
    """
    values = [data_path] if isinstance(data_path, str) else list(data_path or [])
    if not values or any(not isinstance(v, str) or not v for v in values):
        raise ValueError(f"--data-path got {values!r}; it takes one prefix PREFIX (a .bin/.idx "
                         f"pair from tools/preprocess_data.py) or a blend of weights and "
                         f"prefixes, {_EXAMPLE}.")
    if len(values) == 1:
        return values, [1.0]
    if len(values) % 2:
        raise ValueError(f"--data-path got {len(values)} values {values}: a blend takes pairs of "
                         f"WEIGHT PREFIX (an even number of values), {_EXAMPLE}. Fix: give "
                         f"every prefix a weight before it.")
    weights, prefixes = [], []
    for k in range(0, len(values), 2):
        text, prefix = values[k], values[k + 1]
        try:
            weight = float(text)
        except ValueError:
            raise ValueError(f"--data-path value {k + 1} is {text!r}, where a blend needs a "
                             f"weight: the values are WEIGHT PREFIX pairs, {_EXAMPLE}. Fix: put "
                             f"a number before each prefix.") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"--data-path weight {text!r} of {prefix!r} must be a positive "
                             f"number ({_EXAMPLE}). Fix: give it a weight > 0, or leave the "
                             f"dataset out of the blend.")
        weights.append(weight)
        prefixes.append(prefix)
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def blend_order(weights, size: int) -> np.ndarray:
    """Dataset id of each of ``size`` blended samples (module docstring, step 2)."""
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    order = []
    append = order.append
    if len(w) == 2:  # the common case, without the inner loop
        w0, w1 = w
        for n in range(size):
            m = n if n > 0 else 1
            d = 1 if w1 * m - taken[1] > w0 * m - taken[0] else 0
            taken[d] += 1
            append(d)
    else:
        datasets = range(1, len(w))
        for n in range(size):
            m = n if n > 0 else 1
            best, best_error = 0, w[0] * m - taken[0]
            for d in datasets:
                error = w[d] * m - taken[d]
                if error > best_error:
                    best, best_error = d, error
            taken[best] += 1
            append(best)
    return np.asarray(order, dtype=np.int32)


def blend_index(weights, size: int) -> np.ndarray:
    """``size x 2`` int32: (dataset id, sample index within that dataset) per sample."""
    index = np.empty((size, 2), dtype=np.int32)
    index[:, 0] = order = blend_order(weights, size)
    for d in range(len(weights)):
        where = order == d
        index[where, 1] = np.arange(int(where.sum()), dtype=np.int32)
    return index


class BlendedDataset:
    """Sample ``i`` is ``datasets[index[i, 0]][index[i, 1]]``."""

    def __init__(self, datasets: list, weights: list[float], names: list[str],
                 index: np.ndarray, cache_path: str | None = None, cache_status: str = "memory"):
        self.datasets, self.weights, self.names = datasets, weights, names
        self.index = index
        self.cache_path = cache_path
        self.cache_status = cache_status  # "built", "loaded" or "memory" (not cached)
        self.counts = np.bincount(index[:, 0], minlength=len(datasets))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self.index):
            raise IndexError(f"sample index {i} is out of range for {len(self.index)} samples")
        d, j = self.index[i]
        return self.datasets[int(d)][int(j)]


def _cache_key(indexed, weights, split, split_name, seq_length, size, counts, seed) -> str:
    files = []
    for ds in indexed:
        st = os.stat(ds.idx_path)
        files.append([os.path.abspath(ds.prefix), st.st_size, st.st_mtime_ns])
    inputs = {"version": CACHE_VERSION, "datasets": files, "weights": [repr(w) for w in weights],
              "split": str(split), "split_name": split_name, "seq_length": seq_length,
              "samples": size, "per_dataset": [int(c) for c in counts], "seed": seed}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _load(path: str, size: int, num_datasets: int) -> np.ndarray | None:
    try:
        index = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    if index.shape != (size, 2) or index.dtype != np.int32 or \
            (size and not 0 <= int(index[:, 0].min()) <= int(index[:, 0].max()) < num_datasets):
        return None  # not ours, or damaged: rebuild it
    return index


def _save(path: str, index: np.ndarray) -> bool:
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            np.save(f, index, allow_pickle=False)
        os.replace(tmp, path)  # atomic: concurrent ranks each write their own tmp
        return True
    except OSError as exc:
        warnings.warn(f"could not cache the blend index at {path} ({exc}); it is rebuilt "
                      f"every run. Make the folder writable to cache it.")
        try:
            os.remove(tmp)
        except OSError:
            pass
        return False


def _cached_blend_index(indexed, weights, split, split_name, seq_length, size, seed):
    # The per-dataset counts are a function of (weights, size) and so add nothing to the
    # key's uniqueness, but they make the file's content plain from its inputs.
    counts = [math.ceil(w * size * (1 + BLEND_MARGIN)) for w in weights]
    key = _cache_key(indexed, weights, split, split_name, seq_length, size, counts, seed)
    path = f"{indexed[0].prefix}.blend-{key}.npy"
    index = _load(path, size, len(weights)) if os.path.exists(path) else None
    if index is not None:
        return index, path, "loaded"
    index = blend_index(weights, size)
    return index, path, ("built" if _save(path, index) else "memory")


def build_blended_datasets(indexed: list, weights: list[float], *, split: str, seq_length: int,
                           seed: int, num_samples: list[int], loss_masks: list | None = None) -> list:
    """[train, valid, test] :class:`BlendedDataset` (``None`` for an empty split).

    ``indexed`` are the opened :class:`~megalite.data.indexed_dataset.IndexedDataset`
    of the blend and ``weights`` their normalized weights (:func:`parse_data_path`);
    ``loss_masks`` their SFT loss masks (``None`` entries: no mask).
    """
    loss_masks = loss_masks or [None] * len(indexed)
    ranges = [split_documents(len(ds), split) for ds in indexed]
    names = [ds.prefix for ds in indexed]
    result = []
    for k, (split_name, size) in enumerate(zip(SPLIT_NAMES, num_samples)):
        members = [d for d in range(len(indexed)) if len(ranges[d][k]) > 0]
        if k == 0 and size > 0 and len(members) < len(indexed):
            empty = next(d for d in range(len(indexed)) if d not in members)
            raise ValueError(
                f"Blended dataset {names[empty]} has no training documents with --split "
                f"{split} ({len(indexed[empty])} documents in all). Fix: give train a larger "
                f"--split weight, or use more data for it."
            )
        if size <= 0 or not members:
            result.append(None)
            continue
        total = sum(weights[d] for d in members)
        w = [weights[d] / total for d in members]
        index, path, status = _cached_blend_index([indexed[d] for d in members], w, split,
                                                  split_name, seq_length, size, seed)
        counts = np.bincount(index[:, 0], minlength=len(members))
        datasets = []
        for j, d in enumerate(members):
            wanted = max(math.ceil(w[j] * size * (1 + BLEND_MARGIN)), int(counts[j]), 1)
            datasets.append(GPTDataset(indexed[d], ranges[d][k], seq_length, wanted, seed,
                                       loss_mask_dataset=loss_masks[d]))
        result.append(BlendedDataset(datasets, w, [names[d] for d in members], index,
                                     path, status))
    return result


def describe_data(dataset) -> list[str]:
    """Lines describing a training dataset (real data: name, weight, documents, tokens,
    samples and epochs of each dataset); ``[]`` for anything else (mock data)."""
    if isinstance(dataset, BlendedDataset):
        parts = list(zip(dataset.names, dataset.weights, dataset.datasets,
                         (int(c) for c in dataset.counts)))
        lines = [f"data: blend of {len(parts)} datasets, {len(dataset):,} training samples "
                 f"(blend index {dataset.cache_path}: {dataset.cache_status})"]
    elif isinstance(dataset, GPTDataset):
        parts = [(dataset.indexed_dataset.prefix, 1.0, dataset, len(dataset))]
        lines = [f"data: {len(dataset):,} training samples"]
    else:
        return []
    for name, weight, ds, samples in parts:
        indexed = ds.indexed_dataset
        epochs = samples * ds.seq_length / max(ds.tokens_per_epoch, 1)
        lines.append(f"  {name}: weight {weight:.4f}, {len(indexed):,} documents, "
                     f"{indexed.num_tokens:,} tokens ({len(ds.doc_range):,} documents, "
                     f"{ds.tokens_per_epoch:,} tokens in train); {samples:,} samples = "
                     f"{epochs:.3f} epochs")
        if ds.loss_mask_dataset is not None:
            lines.append(f"    loss mask {ds.loss_mask_dataset.prefix}: only its tokens marked 1 "
                         f"(SFT responses) are trained on")
    return lines
