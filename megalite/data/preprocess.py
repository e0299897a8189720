"""Tokenize a corpus into an indexed dataset (the core of tools/preprocess_data.py).

Each document of the input (see :mod:`megalite.data.documents` for the
formats) is tokenized with ``tokenizer.tokenize`` (which puts BOS first when the
tokenizer's ``add_bos`` says so: a Hugging Face tokenizer such as Llama's; BOS
per document, as Megatron does); with ``append_eod`` the tokenizer's
end-of-document id is appended.  Documents that tokenize to nothing (or to BOS
alone) are skipped.  The ids are written, in input order, to
``output_prefix.bin``/``.idx`` with the smallest dtype that holds the
vocabulary (see :mod:`megalite.data.indexed_dataset`).

With ``workers > 1`` tokenization runs in a pool of processes (started with
"spawn", so it is safe after torch is imported).  Each worker rebuilds the
tokenizer from ``tokenizer.config``; results come back in input order, so the
output is identical for any number of workers.

With ``json_format="sft"`` each JSONL line is a supervised fine-tuning
conversation (see :mod:`megalite.data.sft`): the ids go to
``output_prefix.bin``/``.idx`` as usual, every document ends with EOD (whatever
``append_eod`` says), and the per-token loss mask (uint8, 1 on response tokens)
goes to ``output_prefix_loss_mask.bin``/``.idx`` with the same document sizes.
"""
from __future__ import annotations

import multiprocessing
import time
from typing import TextIO

import numpy as np

from megalite.data.documents import iter_documents
from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megalite.data.sft import (SFTEncoder, encode_in_sft_worker, init_sft_worker, iter_sft_records,
                               loss_mask_prefix)
from megalite.data.tokenizer import build_tokenizer
from megalite.observe.progress import is_terminal, progress_bar

_worker_tokenizer = None


def _init_worker(config: dict) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(**config)


def _encode_in_worker(text: str) -> np.ndarray:
    return np.asarray(_worker_tokenizer.tokenize(text), dtype=np.int64)


class Progress:
    """Reports documents and tokens while preprocessing.

    On a terminal a tqdm bar counts the documents (with their rate) and shows the tokens
    written; otherwise (logs, CI) a plain line is printed every ``log_interval`` seconds.
    """

    def __init__(self, stream: TextIO | None, log_interval: float = 10.0):
        self.stream = stream
        self.tty = stream is not None and is_terminal(stream)
        self.interval = 0.2 if self.tty else log_interval
        self.start = self.last = time.perf_counter()
        self.bar = progress_bar(stream=stream, desc="tokenizing", unit=" docs", unit_scale=True) if self.tty else None

    def line(self, docs: int, tokens: int) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (f"{docs:,} docs, {tokens:,} tokens | {docs / elapsed:,.0f} docs/s, "
                f"{tokens / elapsed:,.0f} tokens/s")

    def tokens(self, tokens: int) -> str:
        return f"{tokens:,} tokens, {tokens / max(time.perf_counter() - self.start, 1e-9):,.0f} tokens/s"

    def update(self, docs: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(docs - self.bar.n)  # tqdm redraws at most every 0.1 s
        now = time.perf_counter()
        if self.stream is None or now - self.last < self.interval:
            return
        self.last = now
        if self.bar is not None:
            self.bar.set_postfix_str(self.tokens(tokens), refresh=False)
        else:
            self.stream.write(self.line(docs, tokens) + "\n")
            self.stream.flush()

    def close(self, docs: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(docs - self.bar.n)
            self.bar.set_postfix_str(self.tokens(tokens), refresh=False)
            self.bar.close()


def preprocess(input_path: str, output_prefix: str, tokenizer, json_key: str = "text",
               append_eod: bool = True, workers: int = 1,
               progress_stream: TextIO | None = None, json_format: str = "text") -> dict:
    """Tokenize ``input_path`` into ``output_prefix.bin``/``.idx``; return a summary.

    The summary dict has ``documents`` (written), ``skipped_empty``, ``tokens``,
    ``seconds``, ``dtype``, ``vocab_size`` and the two output paths; for SFT also
    ``response_tokens``, ``eod_inside`` (documents with an EOD before their end) and
    ``loss_mask`` (the mask's prefix).
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be an integer >= 1 (--workers).")
    if json_format == "sft":
        return preprocess_sft(input_path, output_prefix, tokenizer, workers, progress_stream)
    if json_format != "text":
        raise ValueError(f"json_format={json_format!r} is unknown; use 'text' or 'sft' "
                         f"(--json-format).")
    if append_eod and tokenizer.eod is None:
        raise ValueError(
            f"append_eod is set, but {tokenizer!r} has no end-of-document (EOS) token. Name "
            f"one (eos_token in tokenizer_config.json) or drop --append-eod."
        )
    bos = getattr(tokenizer, "bos", None) if getattr(tokenizer, "add_bos", False) else None
    start = time.perf_counter()
    docs = iter_documents(input_path, json_key)
    dtype = best_dtype(tokenizer.vocab_size)
    progress = Progress(progress_stream)
    written = skipped = tokens = 0
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(tokenizer.config,))
        encoded = pool.imap(_encode_in_worker, docs, chunksize=16)
    else:
        encoded = (tokenizer.tokenize(text) for text in docs)
    try:
        with IndexedDatasetBuilder(output_prefix, dtype) as builder:
            for ids in encoded:
                if len(ids) == 0 or (bos is not None and len(ids) == 1 and ids[0] == bos):
                    skipped += 1
                    continue
                if append_eod:
                    ids = np.append(np.asarray(ids, dtype=np.int64), tokenizer.eod)
                builder.add_document(ids)
                written += 1
                tokens += len(ids)
                progress.update(written, tokens)
            builder.finalize()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    progress.close(written, tokens)
    return {
        "documents": written, "skipped_empty": skipped, "tokens": tokens,
        "seconds": time.perf_counter() - start, "dtype": str(dtype),
        "vocab_size": tokenizer.vocab_size,
        "bin": output_prefix + ".bin", "idx": output_prefix + ".idx",
    }


def preprocess_sft(input_path: str, output_prefix: str, tokenizer, workers: int = 1,
                   progress_stream: TextIO | None = None) -> dict:
    """SFT JSONL -> ``output_prefix`` (ids) + ``output_prefix_loss_mask`` (uint8 mask)."""
    encoder = SFTEncoder(tokenizer, input_path)  # checks the EOD and compiles the template now
    start = time.perf_counter()
    records = iter_sft_records(input_path)
    dtype = best_dtype(tokenizer.vocab_size)
    progress = Progress(progress_stream)
    written = tokens = trained = eod_inside = 0
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=init_sft_worker, initargs=(tokenizer.config, input_path))
        encoded = pool.imap(encode_in_sft_worker, records, chunksize=16)
    else:
        encoded = (encoder.encode(lineno, record) for lineno, record in records)
    mask_prefix = loss_mask_prefix(output_prefix)
    try:
        with IndexedDatasetBuilder(output_prefix, dtype) as builder, \
                IndexedDatasetBuilder(mask_prefix, np.uint8) as mask_builder:
            for ids, mask in encoded:
                builder.add_document(ids)
                mask_builder.add_document(mask)
                written += 1
                tokens += len(ids)
                trained += int(mask.sum())
                eod_inside += bool(np.any(ids[:-1] == tokenizer.eod))
                progress.update(written, tokens)
            mask_builder.finalize()
            builder.finalize()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    progress.close(written, tokens)
    return {
        "documents": written, "skipped_empty": 0, "tokens": tokens,
        "seconds": time.perf_counter() - start, "dtype": str(dtype),
        "vocab_size": tokenizer.vocab_size,
        "bin": output_prefix + ".bin", "idx": output_prefix + ".idx",
        "response_tokens": trained, "eod_inside": eod_inside, "loss_mask": mask_prefix,
    }


def format_summary(summary: dict) -> str:
    """A human-readable multi-line summary of :func:`preprocess`'s result."""
    rate = summary["tokens"] / max(summary["seconds"], 1e-9)
    return "\n".join([
        f"documents written : {summary['documents']:,} "
        f"(skipped {summary['skipped_empty']:,} empty)",
        f"tokens            : {summary['tokens']:,} ({summary['dtype']}, "
        f"vocab {summary['vocab_size']:,})",
        f"time              : {summary['seconds']:.1f} s ({rate:,.0f} tokens/s)",
        f"output            : {summary['bin']}, {summary['idx']}",
    ] + ([
        f"loss mask         : {summary['loss_mask']}.bin/.idx, {summary['response_tokens']:,} "
        f"response tokens trained on",
    ] if "loss_mask" in summary else []) + ([
        f"warning           : {summary['eod_inside']:,} documents hold the EOD token before "
        f"their end (the chat template writes it after turns); with --reset-position-ids / "
        f"--reset-attention-mask each such part is a document of its own",
    ] if summary.get("eod_inside") else []))
