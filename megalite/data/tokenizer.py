"""Tokenizers: one interface over SentencePiece, Hugging Face and null tokenizers.

Every tokenizer exposes

* ``vocab_size``: number of ids; valid ids are ``0 .. vocab_size - 1``;
* ``eod``: the end-of-document id appended after each document by
  ``tools/preprocess_data.py --append-eod``;
* ``bos``: the beginning-of-sequence id, or ``None``; ``add_bos``: whether
  ``tokenize`` puts ``bos`` first (only ``HuggingFaceTokenizer`` ever does);
* ``eos_ids``: every id that ends a generation (``eod`` first);
* ``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``;
* ``config``: the keyword arguments of :func:`build_tokenizer` that rebuild
  it, so worker processes can load their own copy instead of receiving one.

Types (the ``--tokenizer-type`` values):

* ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer``: load a
  SentencePiece ``.model`` file.  Both behave the same in megalite (in
  Megatron the first also adds BERT/T5 special tokens, which GPT training does
  not use): ``tokenize`` adds no BOS/EOS, and ``eod`` is the model's EOS id.
* ``HuggingFaceTokenizer``: a local Hugging Face tokenizer folder (``DIR`` with
  ``tokenizer.json``, or the path of the ``tokenizer.json`` itself), read with
  the ``tokenizers`` package (optional: ``pip install tokenizers``); never
  downloads anything.  See :class:`HuggingFaceTokenizer` for BOS/EOS.
* ``NullTokenizer``: for ``--mock-data``.  Text is whitespace-separated
  integers, the ids are the integers themselves, and ``eod = vocab_size - 1``.
"""
from __future__ import annotations

import json
import os

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")


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
        bos = int(self._sp.bos_id())
        self.bos = bos if bos >= 0 else None
        self.add_bos = False
        self.eos_ids = [self.eod]

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


def _read_json(path: str) -> dict:
    """A JSON object from ``path``, or ``{}`` if the file does not exist."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot read {path} as JSON ({exc}). Fix or remove the file.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, expected an object.")
    return data


def _id_list(value, path: str, key: str) -> list[int]:
    """``bos_token_id``/``eos_token_id`` values: an int, a list of ints, or null."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{path}: {key}={value!r} must be a non-negative integer or a list "
                         f"of them.")
    return list(values)


def _chat_template(folder: str, tok_config: dict, tok_config_path: str) -> str | None:
    """The default chat template: ``chat_template.jinja`` of the folder (newer
    transformers save it there), else ``chat_template`` of ``tokenizer_config.json``
    (a string, or a list of named templates of which "default" is taken)."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{tok_config_path}: chat_template must be a string or a list of "
                         f"{{\"name\", \"template\"}} with a \"default\" one.")
    return template


class HuggingFaceTokenizer:
    """A local Hugging Face ``tokenizer.json`` behind the megalite tokenizer interface.

    ``path`` is a folder holding ``tokenizer.json`` (as saved by
    ``save_pretrained`` or found in a model repository) or the path of the
    ``tokenizer.json`` itself; the other files are read from its folder.  It is
    loaded with the ``tokenizers`` package only: no ``transformers``, no network.

    Special tokens, first source that has them wins:

    * ``eod`` (the end-of-document id appended by ``--append-eod``):
      ``eos_token`` of ``tokenizer_config.json`` (a string or a dict with
      ``"content"``), else the first ``eos_token_id`` of
      ``generation_config.json``, else of ``config.json``.  ``None`` if none of
      them names one.
    * ``eos_ids``: ``eod`` and every ``eos_token_id`` of those files (a list
      in instruction-tuned models such as Llama 3): the ids that stop generation.
    * ``bos``: ``bos_token`` of ``tokenizer_config.json``, else ``bos_token_id``
      of ``generation_config.json``, else of ``config.json``, else ``None``.
    * ``add_bos``: ``add_bos_token`` of ``tokenizer_config.json`` when present;
      otherwise whether the tokenizer's own post-processor puts ``bos`` first
      (Llama 3 adds ``<|begin_of_text|>`` this way).  ``add_bos=True/False``
      overrides it.

    ``tokenize(text)`` never runs the post-processor (so no EOS or other
    template tokens are added); it puts ``bos`` first when ``add_bos`` is true,
    or as the ``add_bos`` argument says.  Preprocessing for pretraining therefore
    writes ``[bos] + text + [eod]`` per document when the tokenizer adds BOS,
    as Megatron's preprocessing does.  ``vocab_size`` counts the added
    tokens too (``get_vocab_size(with_added_tokens=True)``, raised to the
    largest id + 1 should an id lie beyond it).
    """

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, path: str, add_bos: bool | None = None):
        if not path:
            raise ValueError(
                "HuggingFaceTokenizer needs a tokenizer folder but --tokenizer-model was not "
                "given. Pass --tokenizer-model DIR, the folder holding tokenizer.json."
            )
        if os.path.isdir(path):
            folder, json_path = path, os.path.join(path, "tokenizer.json")
        else:
            folder, json_path = os.path.dirname(path) or ".", path
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Hugging Face tokenizer {path!r} does not exist. Check --tokenizer-model: it "
                f"must be a local folder holding tokenizer.json (nothing is downloaded)."
            )
        if not os.path.isfile(json_path):
            raise FileNotFoundError(
                f"{json_path!r} does not exist: --tokenizer-model {path!r} must hold a "
                f"tokenizer.json (the 'fast' tokenizer file of a Hugging Face model). A model "
                f"with only tokenizer.model or vocab.json + merges.txt: load it once with "
                f"transformers.AutoTokenizer and save_pretrained() it to write tokenizer.json."
            )
        try:
            import tokenizers  # optional: only needed for this tokenizer type
        except ImportError:
            raise ImportError(
                "HuggingFaceTokenizer needs the 'tokenizers' package, which is not installed. "
                "Fix: pip install tokenizers (or pip install 'megalite[hf]')."
            ) from None
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(json_path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(int(self._tok.get_vocab_size(with_added_tokens=True)),
                              max(vocab.values(), default=-1) + 1)

        tok_config_path = os.path.join(folder, "tokenizer_config.json")
        tok_config = _read_json(tok_config_path)
        sources = [(os.path.join(folder, name), _read_json(os.path.join(folder, name)))
                   for name in ("generation_config.json", "config.json")]

        def token_id(key: str) -> int | None:
            token = tok_config.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            if token is None:
                return None
            if not isinstance(token, str) or self._tok.token_to_id(token) is None:
                raise ValueError(f"{tok_config_path}: {key}={token!r} is not a token of "
                                 f"{json_path}. Fix the file or remove the entry.")
            return int(self._tok.token_to_id(token))

        eos_ids: list[int] = []
        eod = token_id("eos_token")
        if eod is not None:
            eos_ids.append(eod)
        bos = token_id("bos_token")
        for source_path, source in sources:
            eos_ids += _id_list(source.get("eos_token_id"), source_path, "eos_token_id")
            bos_ids = _id_list(source.get("bos_token_id"), source_path, "bos_token_id")
            if bos is None and bos_ids:
                bos = bos_ids[0]
        self.eos_ids = list(dict.fromkeys(eos_ids))  # unique, in order
        self.eod = self.eos_ids[0] if self.eos_ids else None
        self.bos = bos
        for name, value in (("eod", self.eod), ("bos", self.bos)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"The {name} id {value} of {folder} is outside the "
                                 f"tokenizer's vocabulary [0, {self.vocab_size}).")
        if add_bos is None:
            add_bos = tok_config.get("add_bos_token")
            if add_bos is None:  # does the tokenizer's post-processor put BOS first?
                plain = self._tok.encode("a", add_special_tokens=False).ids
                full = self._tok.encode("a", add_special_tokens=True).ids
                add_bos = (bos is not None and full[:1] == [bos] and plain[:1] != [bos])
        self.add_bos = bool(add_bos) and self.bos is not None
        # For SFT preprocessing: the chat template and the special-token strings it may use.
        self.chat_template = _chat_template(folder, tok_config, tok_config_path)
        self.special_tokens = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = tok_config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                self.special_tokens[key] = token

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` (no BOS, no post-processor, as ``apply_chat_template``
        tokenizes a rendered chat) and each token's character span in ``text``."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(span) for span in encoding.offsets]

    @property
    def config(self) -> dict:
        return {"tokenizer_type": self.tokenizer_type, "tokenizer_model": self.path,
                "add_bos": self.add_bos}

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        """The ids of ``text``, after ``bos`` if ``add_bos`` (default: ``self.add_bos``)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos):
            if self.bos is None:
                raise ValueError(f"add_bos=True, but the tokenizer {self.path!r} has no BOS "
                                 f"token (bos_token in tokenizer_config.json).")
            ids = [self.bos] + ids
        return ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return (f"HuggingFaceTokenizer({self.path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos}, eod={self.eod}, add_bos={self.add_bos})")


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
        self.bos = None
        self.add_bos = False
        self.eos_ids = [self.eod]

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
                    vocab_size: int | None = None, add_bos: bool | None = None):
    """Build a tokenizer by type name (see the module docstring for the types).

    ``tokenizer_model`` is required for the SentencePiece types and
    ``HuggingFaceTokenizer`` (a folder holding ``tokenizer.json``), and
    ``vocab_size`` for ``NullTokenizer``; the other argument is ignored.
    ``add_bos`` (``HuggingFaceTokenizer`` only) overrides the tokenizer
    config's choice of putting BOS first.
    """
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        cls = SentencePieceTokenizer if tokenizer_type == "SentencePieceTokenizer" \
            else GPTSentencePieceTokenizer
        return cls(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, add_bos=add_bos)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"Unknown tokenizer type {tokenizer_type!r}; expected one of "
        f"{', '.join(TOKENIZER_TYPES)}. Fix --tokenizer-type."
    )
