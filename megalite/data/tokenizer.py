"""Tokenizers: a common interface over SentencePiece models and a null tokenizer.

Every tokenizer exposes

* ``vocab_size``: number of ids; valid ids are ``0 .. vocab_size - 1``;
* ``eod``: the end-of-document id appended after each document by
  ``tools/preprocess_data.py --append-eod``;
* ``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``;
* ``config``: the keyword arguments of :func:`build_tokenizer` that rebuild
  it, so worker processes can load their own copy instead of receiving one.

Types (the ``--tokenizer-type`` values):

* ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer``: load a
  SentencePiece ``.model`` file.  Both behave the same in megalite (in
  Megatron the first also adds BERT/T5 special tokens, which GPT training does
  not use): ``tokenize`` adds no BOS/EOS, and ``eod`` is the model's EOS id.
* ``NullTokenizer``: for ``--mock-data``.  Text is whitespace-separated
  integers, the ids are the integers themselves, and ``eod = vocab_size - 1``.
"""
from __future__ import annotations

import os

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "NullTokenizer")


class SentencePieceTokenizer:
    """A SentencePiece model file behind the megalite tokenizer interface."""

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, model_path: str):
        if not model_path:
            raise ValueError(
                f"{self.tokenizer_type} needs a model file but --tokenizer-model was not "
                f"given. Pass --tokenizer-model PATH.model (train one with "
                f"tools/train_tokenizer.py)."
            )
        if not os.path.isfile(model_path):
            raise FileNotFoundError(
                f"SentencePiece model {model_path!r} does not exist. Check "
                f"--tokenizer-model, or train one with: python tools/train_tokenizer.py "
                f"--input corpus.jsonl --model-prefix DIR/tok --vocab-size 4096"
            )
        import sentencepiece  # imported lazily: only needed for real data

        self.model_path = model_path
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = int(self._sp.get_piece_size())
        self.eod = int(self._sp.eos_id())
        if self.eod < 0:
            raise ValueError(
                f"SentencePiece model {model_path!r} has no end-of-sentence piece "
                f"(eos_id={self.eod}), but megalite uses it as the end-of-document "
                f"token. Retrain it with tools/train_tokenizer.py (which keeps eos_id=2)."
            )

    @property
    def config(self) -> dict:
        return {"tokenizer_type": self.tokenizer_type, "tokenizer_model": self.model_path}

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_path!r}, vocab_size={self.vocab_size})"


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Same as SentencePieceTokenizer; the name matches Megatron's GPT option."""

    tokenizer_type = "GPTSentencePieceTokenizer"


class NullTokenizer:
    """Ids are the integers written in the text; ``eod = vocab_size - 1``."""

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size: int | None):
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
            raise ValueError(
                f"NullTokenizer got vocab_size={vocab_size!r}; it needs an integer >= 2 "
                f"(ids 0..vocab_size-2 for data, vocab_size-1 for end-of-document). "
                f"Pass --vocab-size N."
            )
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1

    @property
    def config(self) -> dict:
        return {"tokenizer_type": self.tokenizer_type, "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as exc:
            raise ValueError(
                f"NullTokenizer reads whitespace-separated integers, but got {text[:60]!r} "
                f"({exc}). Use a SentencePiece tokenizer for natural text."
            ) from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"NullTokenizer id {bad[0]} is outside [0, {self.vocab_size}) "
                f"(vocab_size={self.vocab_size}). Increase --vocab-size or fix the input."
            )
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size})"


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                    vocab_size: int | None = None):
    """Build a tokenizer by type name (see the module docstring for the types).

    ``tokenizer_model`` is required for the SentencePiece types and
    ``vocab_size`` for ``NullTokenizer``; the other argument is ignored.
    """
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        cls = SentencePieceTokenizer if tokenizer_type == "SentencePieceTokenizer" \
            else GPTSentencePieceTokenizer
        return cls(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"Unknown tokenizer type {tokenizer_type!r}; expected one of "
        f"{', '.join(TOKENIZER_TYPES)}. Fix --tokenizer-type."
    )
