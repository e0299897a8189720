"""From command-line data options to train/valid/test micro-batch iterators.

Each iterator yields micro-batches for *this* data-parallel rank as dicts of
torch tensors, with ``b = micro_batch_size`` and ``s = seq_length``:

* ``tokens``       (b, s) int64:   sample[:, :-1], the model inputs;
* ``labels``       (b, s) int64:   sample[:, 1:], the next token of each input;
* ``loss_mask``    (b, s) float32: 1 where the label is trained on: all ones,
  except 0 where the input is the EOD token (``--eod-mask-loss``) and, for SFT
  data (a ``PREFIX_loss_mask`` beside the dataset), 0 where the label is a
  prompt token;
* ``position_ids`` (b, s) int64:   0 .. s-1 in every row, or restarting at 0
  after each EOD token (``--reset-position-ids``);
* with ``--reset-attention-mask`` only: ``doc_start`` and ``doc_end`` (b, s)
  int32, where the document of each token starts and ends (exclusive) in the
  row.

See :mod:`megalite.data.packing` for the EOD rule.  All of it is computed here,
on the host; the training step never derives it from token values.

The train iterator is finite: it reads samples ``consumed_train_samples ..
train_samples`` in :class:`~megalite.data.sampler.PretrainingSampler` order
and then stops.  The valid and test iterators are endless: after their last
micro-batch they start again from their first, so an evaluation of ``N``
steps always just calls ``next()`` ``N`` times and later evaluations continue
where the previous one stopped (wrapping around).  An iterator is ``None``
when its split has no documents or is asked for 0 samples.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from megalite.data.blended import build_blended_datasets, parse_data_path
from megalite.data.gpt_dataset import GPTDataset, MockGPTDataset, split_documents
from megalite.data.indexed_dataset import DatasetError, IndexedDataset
from megalite.data.packing import Packing, batch_fields, check_packing
from megalite.data.sampler import PretrainingSampler
from megalite.data.sft import loss_mask_prefix

SPLIT_NAMES = ("train", "valid", "test")


def collate(samples: list, packing: Packing = Packing()) -> dict[str, torch.Tensor]:
    """Stack samples of ``s + 1`` tokens into a micro-batch dict (see module doc).

    A sample is a token array, or a dict with ``tokens`` and ``token_mask`` (SFT: 1 on
    the tokens to predict); a token array alone predicts every token.
    """
    has_mask = any(isinstance(sample, dict) for sample in samples)
    rows = [sample["tokens"] if isinstance(sample, dict) else sample for sample in samples]
    batch = np.stack(rows).astype(np.int64, copy=False)
    label_mask = None
    if has_mask:
        label_mask = np.stack([sample["token_mask"][1:] if isinstance(sample, dict)
                               else np.ones(len(sample) - 1, np.uint8) for sample in samples])
    tokens = np.ascontiguousarray(batch[:, :-1])
    fields = batch_fields(tokens, label_mask, packing)
    out = {"tokens": torch.from_numpy(tokens),
           "labels": torch.from_numpy(np.ascontiguousarray(batch[:, 1:]))}
    out.update({key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in fields.items()})
    return out


class MicroBatchIterator:
    """Iterates collated micro-batches of ``dataset`` in ``sampler`` order.

    With ``cyclic=True`` it never ends: when the sampler is exhausted it starts
    over from the sampler's first micro-batch.
    """

    def __init__(self, dataset, sampler: PretrainingSampler, cyclic: bool,
                 packing: Packing = Packing()):
        if cyclic and len(sampler) == 0:
            raise ValueError("a cyclic iterator needs at least one micro-batch")
        self.packing = packing
        self.dataset = dataset
        self.sampler = sampler
        self.cyclic = cyclic
        self._indices = iter(sampler)

    def __iter__(self):
        return self

    def at(self, consumed_samples: int) -> "MicroBatchIterator":
        """The same samples, read from position ``consumed_samples`` (a rollback's rewind)."""
        s = self.sampler
        sampler = PretrainingSampler(s.total_samples, consumed_samples, s.micro_batch_size,
                                     s.data_parallel_rank, s.data_parallel_size)
        return MicroBatchIterator(self.dataset, sampler, self.cyclic, self.packing)

    def __next__(self) -> dict[str, torch.Tensor]:
        try:
            indices = next(self._indices)
        except StopIteration:
            if not self.cyclic:
                raise
            self._indices = iter(self.sampler)
            indices = next(self._indices)
        return collate([self.dataset[i] for i in indices], self.packing)


def check_dataset_vocab(dataset: IndexedDataset, vocab_size: int) -> None:
    """Every token id of the dataset lies in [0, vocab_size) (else DatasetError)."""
    max_id = int(dataset.tokens.max()) if dataset.num_tokens else -1
    if max_id >= vocab_size:
        raise DatasetError(
            f"Dataset {dataset.prefix} contains token id {max_id}, but the vocabulary size "
            f"is {vocab_size} (ids must be < {vocab_size}). Use the tokenizer the data was "
            f"preprocessed with, or re-run tools/preprocess_data.py with this tokenizer."
        )


def _check_vocab(dataset: IndexedDataset, vocab_size: int, eod_token: int | None,
                 packing: Packing = Packing()) -> None:
    check_dataset_vocab(dataset, vocab_size)
    if eod_token is not None and not 0 <= eod_token < vocab_size:
        raise ValueError(f"eod_token={eod_token} must lie in [0, {vocab_size}) "
                         f"(vocab_size={vocab_size}).")
    if packing.any and dataset.num_tokens and not _holds(dataset, packing.eod_token):
        flags = " ".join(packing.flags())
        raise DatasetError(
            f"{flags}: dataset {dataset.prefix} holds no end-of-document token (id "
            f"{packing.eod_token}), so it has no document boundaries to use. Fix: re-run "
            f"tools/preprocess_data.py with --append-eod (and this tokenizer), or drop {flags}.")


def _holds(dataset: IndexedDataset, token: int, chunk: int = 1 << 24) -> bool:
    """Whether ``token`` occurs in the dataset: the documents' last tokens first (EOD with
    --append-eod), then the whole stream in chunks (no token-sized temporary)."""
    if len(dataset) and np.any(dataset.tokens[np.asarray(dataset.offsets[1:]) - 1] == token):
        return True
    return any(np.any(dataset.tokens[k:k + chunk] == token)
               for k in range(0, dataset.num_tokens, chunk))


def open_loss_mask(prefix: str) -> IndexedDataset | None:
    """``PREFIX_loss_mask`` (written by SFT preprocessing) when it exists beside ``PREFIX``."""
    mask_prefix = loss_mask_prefix(prefix)
    if os.path.isfile(mask_prefix + ".idx") or os.path.isfile(mask_prefix + ".bin"):
        return IndexedDataset(mask_prefix)
    return None


def build_datasets(*, data_prefix: str | list[str] | None, mock: bool, split: str,
                   vocab_size: int, seq_length: int, seed: int, num_samples: list[int],
                   eod_token: int | None = None, packing: Packing = Packing()) -> list:
    """The [train, valid, test] datasets (``None`` for an empty split).

    ``mock=True`` takes precedence over ``data_prefix``; mock splits use seeds
    ``3*seed + k`` (k = 0, 1, 2) so they differ from each other.  Real data is
    split by documents with :func:`split_documents` and every split uses
    ``seed`` (their documents differ already).  ``data_prefix`` is one prefix
    or the ``--data-path`` values of a blend (``["0.7", "A", "0.3", "B"]``; see
    :mod:`megalite.data.blended`); a single prefix behaves as it always has.
    With a packed-document flag on, mock samples hold documents closed by
    ``packing.eod_token`` (see :class:`MockGPTDataset`).  A ``PREFIX_loss_mask``
    beside a prefix (SFT data) is cut into the same windows as its tokens.
    """
    mock_eod = packing.eod_token if packing.any else None
    if mock:
        return [MockGPTDataset(vocab_size, seq_length, n, 3 * seed + k, eod_token=mock_eod)
                if n > 0 else None for k, n in enumerate(num_samples)]
    if not data_prefix:
        raise ValueError("No training data: pass --data-path PREFIX (made by "
                         "tools/preprocess_data.py) or --mock-data.")
    prefixes, weights = parse_data_path(data_prefix)
    if len(prefixes) > 1:
        blend = [IndexedDataset(prefix) for prefix in prefixes]
        for indexed in blend:
            _check_vocab(indexed, vocab_size, eod_token, packing)
        return build_blended_datasets(blend, weights, split=split, seq_length=seq_length,
                                      seed=seed, num_samples=num_samples,
                                      loss_masks=[open_loss_mask(p) for p in prefixes])
    indexed = IndexedDataset(prefixes[0])
    _check_vocab(indexed, vocab_size, eod_token, packing)
    mask = open_loss_mask(prefixes[0])
    ranges = split_documents(len(indexed), split)
    return [GPTDataset(indexed, doc_range, seq_length, n, seed, loss_mask_dataset=mask)
            if n > 0 and len(doc_range) > 0 else None
            for doc_range, n in zip(ranges, num_samples)]


def build_data_iterators(*, data_prefix: str | list[str] | None, mock: bool, split: str,
                         vocab_size: int, seq_length: int, seed: int, micro_batch_size: int,
                         dp_rank: int,
                         dp_size: int, train_samples: int, valid_samples: int,
                         test_samples: int, consumed_train_samples: int = 0,
                         eod_token: int | None = None, reset_position_ids: bool = False,
                         reset_attention_mask: bool = False, eod_mask_loss: bool = False):
    """Return ``(train_iter, valid_iter, test_iter)``; see the module docstring.

    The three flags are Megatron's packed-document options; they need ``eod_token``.
    """
    packing = Packing(reset_position_ids, reset_attention_mask, eod_mask_loss, eod_token)
    check_packing(packing, "the tokenizer")
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
                              num_samples=num_samples, eod_token=eod_token, packing=packing)
    iterators = []
    for k, (dataset, n) in enumerate(zip(datasets, num_samples)):
        if dataset is None:
            iterators.append(None)
            continue
        consumed = consumed_train_samples if k == 0 else 0
        sampler = PretrainingSampler(n, consumed, micro_batch_size, dp_rank, dp_size)
        iterators.append(MicroBatchIterator(dataset, sampler, cyclic=k > 0, packing=packing))
    return tuple(iterators)


def build_data_iterators_from(config, *, dp_rank: int, dp_size: int, train_samples: int, valid_samples: int = 0,
                              test_samples: int = 0, consumed_train_samples: int = 0):
    """:func:`build_data_iterators` for a run's ``config`` (a :class:`megalite.config.Config`, read by
    attribute: this floor does not import it): ``config.data`` gives the data path, mock data, split,
    packed-document flags and the tokenizer's EOD id, ``config.model`` the vocabulary and sequence
    length, ``config.train`` the seed and micro-batch size. The caller gives what is its own: this
    rank's place in data parallelism and how many samples of each split it reads."""
    data, model, train = config.data, config.model, config.train
    return build_data_iterators(
        data_prefix=data.data_path, mock=data.mock_data, split=data.split, vocab_size=model.vocab_size,
        seq_length=model.seq_length, seed=train.seed, micro_batch_size=train.micro_batch_size, dp_rank=dp_rank,
        dp_size=dp_size, train_samples=train_samples, valid_samples=valid_samples, test_samples=test_samples,
        consumed_train_samples=consumed_train_samples, eod_token=data.eod_token,
        reset_position_ids=data.reset_position_ids, reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss)
