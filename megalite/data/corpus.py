"""A default training corpus built from the Python standard library's sources.

megalite needs *some* text to train a tokenizer and a small GPT on a machine
with no network access.  Every Python installation ships its standard library
as ``.py`` source files, so we turn those into a JSONL corpus:

* one JSON object per line: ``{"text": "<document>"}`` (UTF-8, keys sorted);
* files are visited in sorted order of their path relative to
  ``sysconfig.get_paths()["stdlib"]``; test suites (``test/``, ``tests/``,
  e.g. ``lib2to3/tests``), ``site-packages``, ``idlelib`` and ``__pycache__``
  folders are skipped, and so are files that
  are not valid UTF-8;
* each module contributes its docstring (when it has one) as its own
  document, then its source split at top-level ``def``/``class`` boundaries
  into chunks of roughly ``MIN_CHUNK``..``MAX_CHUNK`` bytes;
* building stops before the first line that would take the file past
  ``max_bytes``.

The output depends only on the Python version's stdlib sources, so two runs on
the same interpreter produce byte-identical files.  The file is written to a
temporary name and renamed into place, so readers never see a partial corpus.
"""
from __future__ import annotations

import ast
import json
import os
import sysconfig
from typing import Iterator

MIN_CHUNK = 2048
MAX_CHUNK = 8192
MIN_DOCSTRING = 80  # shorter module docstrings ("Constants.") are not worth a document

SKIP_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__"})
BLOCK_STARTS = ("def ", "async def ", "class ", "@")


def iter_stdlib_files(root: str) -> Iterator[str]:
    """Yield the stdlib's ``.py`` files under ``root`` in sorted, stable order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _top_level_blocks(source: str) -> list[str]:
    """Split source text into blocks that each start at a top-level def/class.

    A decorator line starts the block of the function it decorates, so
    decorators stay attached.  Joining the blocks gives back ``source``.
    """
    blocks: list[list[str]] = [[]]
    previous_was_decorator = False
    for line in source.splitlines(keepends=True):
        starts_block = line.startswith(BLOCK_STARTS)
        if starts_block and not previous_was_decorator and blocks[-1]:
            blocks.append([])
        blocks[-1].append(line)
        if line.strip():
            previous_was_decorator = line.startswith("@")
    return ["".join(block) for block in blocks if block]


def _split_long(block: str) -> list[str]:
    """Cut a block longer than MAX_CHUNK bytes at line boundaries."""
    pieces, current, size = [], [], 0
    for line in block.splitlines(keepends=True):
        n = len(line.encode("utf-8"))
        if current and size + n > MAX_CHUNK:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += n
    if current:
        pieces.append("".join(current))
    return pieces


def split_module(source: str) -> list[str]:
    """Split one module's source into documents of about 2-8 KB.

    Consecutive top-level blocks are merged until a chunk reaches MIN_CHUNK
    bytes; blocks longer than MAX_CHUNK are cut at line boundaries.
    """
    chunks: list[str] = []
    current, size = [], 0
    for block in _top_level_blocks(source):
        for piece in _split_long(block):
            n = len(piece.encode("utf-8"))
            if current and size + n > MAX_CHUNK:
                chunks.append("".join(current))
                current, size = [], 0
            current.append(piece)
            size += n
            if size >= MIN_CHUNK:
                chunks.append("".join(current))
                current, size = [], 0
    if current:
        chunks.append("".join(current))
    return [c for c in chunks if c.strip()]


def module_documents(source: str) -> list[str]:
    """The documents contributed by one module: its docstring, then its chunks."""
    docs = []
    try:
        docstring = ast.get_docstring(ast.parse(source))
    except (SyntaxError, ValueError):
        docstring = None  # e.g. lib2to3 grammar fixtures for old syntax
    if docstring and len(docstring) >= MIN_DOCSTRING:
        docs.append(docstring)
    docs.extend(split_module(source))
    return docs


def build_default_corpus(out_path: str, max_bytes: int = 3_000_000) -> dict:
    """Write the stdlib corpus to ``out_path`` (JSONL) and return statistics.

    Returns a dict with ``path``, ``documents``, ``bytes``, ``files`` (modules
    that contributed), ``skipped_non_utf8`` and ``truncated`` (True when the
    ``max_bytes`` limit stopped the build before the stdlib ran out).
    """
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(
            f"max_bytes={max_bytes!r} is invalid: it must be a positive integer "
            f"(the corpus size limit in bytes), e.g. 3000000."
        )
    root = sysconfig.get_paths()["stdlib"]
    stats = {"path": out_path, "documents": 0, "bytes": 0, "files": 0,
             "skipped_non_utf8": 0, "truncated": False}
    tmp_path = f"{out_path}.tmp.{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    try:
        with open(tmp_path, "wb") as out:
            for path in iter_stdlib_files(root):
                with open(path, "rb") as f:
                    raw = f.read()
                try:
                    source = raw.decode("utf-8")
                except UnicodeDecodeError:
                    stats["skipped_non_utf8"] += 1
                    continue
                docs = module_documents(source)
                if docs:
                    stats["files"] += 1
                for doc in docs:
                    line = json.dumps({"text": doc}, ensure_ascii=False, sort_keys=True)
                    data = (line + "\n").encode("utf-8")
                    if stats["bytes"] + len(data) > max_bytes:
                        stats["truncated"] = True
                        break
                    out.write(data)
                    stats["bytes"] += len(data)
                    stats["documents"] += 1
                if stats["truncated"]:
                    break
        os.replace(tmp_path, out_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    return stats
