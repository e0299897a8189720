"""megalite's data pipeline: corpus -> tokenizer -> indexed dataset -> micro-batches.

Modules:

* ``corpus``:            a default JSONL corpus from the Python stdlib sources;
* ``tokenizer``:         ``build_tokenizer`` (SentencePiece / Hugging Face / Null);
* ``tokenizer_training``: train a byte-fallback SentencePiece model;
* ``documents``:         read documents from ``.jsonl`` or ``.txt`` files;
* ``indexed_dataset``:   the memory-mapped ``.bin``/``.idx`` token format;
* ``preprocess``:        tokenize a corpus into an indexed dataset;
* ``sft``:               supervised fine-tuning JSONL (prompt/response, chat
  template) to ids plus a per-token loss mask;
* ``packing``:           packed documents: reset position ids, document bounds,
  EOD loss mask (Megatron's --reset-* / --eod-mask-loss);
* ``gpt_dataset``:       ``split_documents``, ``GPTDataset``, ``MockGPTDataset``;
* ``blended``:           ``BlendedDataset``: ``--data-path 0.7 A 0.3 B`` blends;
* ``sampler``:           ``PretrainingSampler`` (data-parallel micro-batches);
* ``builder``:           ``build_data_iterators`` for the training loop (``build_data_iterators_from``:
  from a run's config).

Names are imported lazily on first use, so tools that only tokenize (and their
worker processes) do not pay for importing torch.  (``preprocess`` is not
re-exported: its name is taken by the ``megalite.data.preprocess`` module.)
"""
import importlib

_EXPORTS = {
    "build_default_corpus": "corpus",
    "build_tokenizer": "tokenizer",
    "train_sentencepiece": "tokenizer_training",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "DatasetError": "indexed_dataset",
    "best_dtype": "indexed_dataset",
    "split_documents": "gpt_dataset",
    "GPTDataset": "gpt_dataset",
    "MockGPTDataset": "gpt_dataset",
    "BlendedDataset": "blended",
    "parse_data_path": "blended",
    "describe_data": "blended",
    "PretrainingSampler": "sampler",
    "build_data_iterators": "builder",
    "build_data_iterators_from": "builder",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megalite.data' has no attribute {name!r}")
    module = importlib.import_module(f"megalite.data.{_EXPORTS[name]}")
    return getattr(module, name)
