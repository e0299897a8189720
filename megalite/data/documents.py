"""Reading raw documents from a corpus file.

Two input formats are understood, chosen by file extension:

* ``.jsonl`` / ``.json``: one JSON object per line; the document is the
  string stored under ``json_key`` (default ``"text"``).  Blank lines are
  skipped.
* anything else (e.g. ``.txt``): plain UTF-8 text where documents are blocks
  of lines separated by one or more blank lines.  Each block is yielded with
  its lines joined by ``"\\n"`` (no trailing newline).
"""
from __future__ import annotations

import json
import os
from typing import Iterator


def is_jsonl(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


def _iter_jsonl(path: str, json_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno} is not valid JSON ({exc.msg}). Each line of a "
                    f".jsonl corpus must be one JSON object such as {{\"text\": \"...\"}}."
                ) from None
            if not isinstance(record, dict) or json_key not in record:
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{lineno} has no key {json_key!r} (found {found}). Pass the "
                    f"right key with --json-keys."
                )
            text = record[json_key]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: {json_key!r} holds a {type(text).__name__}, "
                    f"expected a string."
                )
            yield text


def _iter_paragraphs(path: str) -> Iterator[str]:
    block: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if line.strip():
                block.append(line)
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def check_input(path: str) -> None:
    """The corpus is one readable file (else FileNotFoundError naming the fix)."""
    if os.path.isdir(path):
        raise FileNotFoundError(f"Input corpus {path!r} is a directory; --input takes one .jsonl or text file. "
                                f"Fix: concatenate the files (cat DIR/*.jsonl > corpus.jsonl) and pass that.")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Input corpus {path!r} does not exist. Check --input, or build the default "
            f"corpus with: python tools/build_default_corpus.py --output {path}"
        )


def iter_documents(path: str, json_key: str = "text") -> Iterator[str]:
    """Yield the documents of a ``.jsonl`` or plain-text corpus, in file order."""
    check_input(path)
    if is_jsonl(path):
        return _iter_jsonl(path, json_key)
    return _iter_paragraphs(path)
