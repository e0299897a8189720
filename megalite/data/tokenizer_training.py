"""Training a byte-fallback SentencePiece tokenizer for source code and text.

SentencePiece learns from *sentences*; we feed it every non-blank line of
every document.  The settings are chosen so that ``detokenize(tokenize(s))``
gives back ``s`` exactly, which matters for code:

* ``normalization_rule_name="identity"``, ``remove_extra_whitespaces=False``
  and ``add_dummy_prefix=False``: the text is not rewritten;
* ``byte_fallback=True``: characters outside the vocabulary become UTF-8
  byte pieces ``<0x..>`` instead of ``<unk>``;
* ``"\\n"`` is a user-defined piece (lines are trained separately, so the
  trainer never sees a newline otherwise) and whitespace-only pieces such as
  four spaces of indentation are allowed;
* ``hard_vocab_limit=False``: a small corpus may give fewer pieces than asked.

Training is deterministic: every line is used (``input_sentence_size=0``, no
shuffling), the random generator is seeded and one thread is used.  The
special ids are SentencePiece's defaults: ``<unk>``=0, ``<s>``=1, ``</s>``=2
(the end-of-document id), no padding piece.
"""
from __future__ import annotations

import os
from typing import Iterator

from megalite.data.documents import iter_documents

MODEL_TYPES = ("bpe", "unigram")
TRAINING_SEED = 1234


def _training_lines(input_path: str, json_key: str) -> Iterator[str]:
    for doc in iter_documents(input_path, json_key):
        for line in doc.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(input_path: str, model_prefix: str, vocab_size: int,
                        model_type: str = "bpe", json_key: str = "text",
                        verbose: bool = False) -> str:
    """Train a tokenizer on ``input_path``; return the written ``.model`` path.

    Writes ``model_prefix + ".model"`` (and SentencePiece's ``.vocab`` listing);
    the folder of ``model_prefix`` is created when missing.
    """
    import sentencepiece

    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; use one of {MODEL_TYPES} "
            f"(--model-type)."
        )
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(
            f"vocab_size={vocab_size!r} is too small: byte fallback alone needs 256 byte "
            f"pieces plus special pieces. Use --vocab-size 300 or more (e.g. 4096)."
        )
    folder = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(folder, exist_ok=True)
    sentencepiece.set_random_generator_seed(TRAINING_SEED)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(input_path, json_key),
            model_prefix=model_prefix,
            model_type=model_type,
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            byte_fallback=True,
            character_coverage=0.9995,  # rare characters fall back to bytes
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=["\n"],
            max_sentence_length=16384,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=1,
            minloglevel=0 if verbose else 2,
        )
    except RuntimeError as exc:
        raise RuntimeError(
            f"SentencePiece training on {input_path!r} failed: {exc}. Check that the "
            f"corpus holds text and that --vocab-size {vocab_size} suits its size."
        ) from None
    return model_prefix + ".model"
