"""A memory-mapped dataset of token-id documents: ``PREFIX.bin`` + ``PREFIX.idx``.

``PREFIX.bin`` holds the token ids of all documents, concatenated, as raw
little-endian integers of one dtype (uint16 when the vocabulary fits in 16 bits,
else int32).  ``PREFIX.idx`` describes where each document lies (little-endian)::

    offset  size         field
    0       8            magic  b"MGLTIDX\\0"
    8       8  uint64    format version (currently 1)
    16      8  uint64    dtype code (1 = uint16, 2 = int32, 3 = uint8: per-token
                         loss masks, ``PREFIX_loss_mask``)
    24      8  uint64    number of documents  n
    32      8  uint64    number of tokens     t
    40      4n int32     sizes[n]: tokens in each document
    ...     0-4          zero padding to a multiple of 8 bytes
    ...     8(n+1) int64 offsets[n+1]: token offset where each document starts
                         in .bin (offsets[0] = 0, offsets[n] = t; the byte
                         offset is offsets[i] * itemsize)

Both files are memory-mapped when read, so opening a dataset is instant and
only the pages that are touched are loaded.  The builder writes both files
under temporary names and renames them into place at ``finalize()``.
"""
from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MGLTIDX\x00"
VERSION = 1
HEADER = struct.Struct("<8sQQQQ")  # magic, version, dtype code, num docs, num tokens
DTYPE_CODES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32), 3: np.dtype(np.uint8)}
FIX_HINT = "Re-create the dataset with tools/preprocess_data.py."


class DatasetError(ValueError):
    """A dataset file is missing, corrupt, or inconsistent with its index."""


class DatasetFileNotFoundError(DatasetError, FileNotFoundError):
    """A ``.bin`` or ``.idx`` file does not exist."""


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest supported dtype holding ids ``0 .. vocab_size - 1``."""
    if not isinstance(vocab_size, (int, np.integer)) or not 0 < vocab_size < 2**31:
        raise ValueError(f"vocab_size={vocab_size!r} must be an integer in [1, 2**31).")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, known in DTYPE_CODES.items():
        if known == dtype:
            return code
    raise ValueError(f"dtype {dtype} is not supported; use numpy.uint16 or numpy.int32 "
                     f"(best_dtype(vocab_size) picks one), or numpy.uint8 for masks.")


def _index_layout(num_docs: int) -> tuple[int, int, int]:
    """(sizes offset, offsets offset, total .idx size) in bytes for ``num_docs``."""
    sizes_at = HEADER.size
    offsets_at = (sizes_at + 4 * num_docs + 7) // 8 * 8
    return sizes_at, offsets_at, offsets_at + 8 * (num_docs + 1)


class IndexedDatasetBuilder:
    """Stream documents into ``prefix.bin``/``prefix.idx``.

    Call :meth:`add_document` for each document, then :meth:`finalize`.  Used
    as a context manager, the temporary files are removed if the block exits
    before ``finalize()`` (for example on an error).
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(self.dtype)
        self._max_id = int(np.iinfo(self.dtype).max)
        self._sizes: list[int] = []
        self._num_tokens = 0
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._tmp_bin = f"{prefix}.bin.tmp.{os.getpid()}"
        self._tmp_idx = f"{prefix}.idx.tmp.{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self.finalized = False

    def add_document(self, ids) -> None:
        """Append one document (a 1-D sequence of non-negative integer ids)."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"Document {len(self._sizes)} must be a 1-D sequence of "
                             f"integer ids; got shape {arr.shape}, dtype {arr.dtype}.")
        if arr.size and (arr.min() < 0 or arr.max() > self._max_id):
            raise ValueError(
                f"Document {len(self._sizes)} has ids in [{arr.min()}, {arr.max()}] but "
                f"dtype {self.dtype} holds only [0, {self._max_id}]. Build with "
                f"dtype=best_dtype(vocab_size)."
            )
        if arr.size >= 2**31:
            raise ValueError(f"Document {len(self._sizes)} has {arr.size} tokens; the "
                             f"limit is 2**31 - 1. Split it into smaller documents.")
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._sizes.append(int(arr.size))
        self._num_tokens += int(arr.size)

    def finalize(self) -> dict:
        """Write the index and move both files into place; return counts."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype="<i4")
        offsets = np.zeros(len(sizes) + 1, dtype="<i8")
        np.cumsum(sizes, out=offsets[1:])
        sizes_at, offsets_at, _ = _index_layout(len(sizes))
        with open(self._tmp_idx, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, self._code, len(sizes), self._num_tokens))
            f.write(sizes.tobytes())
            f.write(b"\x00" * (offsets_at - sizes_at - sizes.nbytes))
            f.write(offsets.tobytes())
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(self._tmp_idx, self.prefix + ".idx")
        self.finalized = True
        return {"documents": len(sizes), "tokens": self._num_tokens}

    def abort(self) -> None:
        """Close and delete the temporary files (nothing is left behind)."""
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if not self.finalized:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin`` + ``prefix.idx``.

    ``len(ds)`` is the number of documents, ``ds[i]`` the ids of document
    ``i``, ``ds.sizes`` the per-document token counts (int32) and
    ``ds.tokens`` all ids as one flat array.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.idx_path, self.bin_path = prefix + ".idx", prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                stem, ext = os.path.splitext(prefix)
                if ext in (".bin", ".idx"):  # the file's name given instead of the pair's prefix
                    raise DatasetFileNotFoundError(
                        f"Dataset file {path!r} does not exist: --data-path takes the prefix of the "
                        f".bin/.idx pair, without the extension. Fix: --data-path {stem}")
                raise DatasetFileNotFoundError(
                    f"Dataset file {path!r} does not exist (expected both {prefix}.idx and "
                    f"{prefix}.bin). Check --data-path, or create the dataset with "
                    f"tools/preprocess_data.py --output-prefix {prefix}."
                )
        self._read_index()
        expected = self.num_tokens * self.dtype.itemsize
        found = os.path.getsize(self.bin_path)
        if found != expected:
            raise DatasetError(
                f"{self.bin_path} holds {found} bytes but {self.idx_path} expects "
                f"{expected} ({self.num_tokens} tokens x {self.dtype.itemsize} bytes of "
                f"{self.dtype}); the files do not belong together or one is truncated. "
                f"{FIX_HINT}"
            )
        if self.num_tokens:
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype.newbyteorder("<"),
                                    mode="r", shape=(self.num_tokens,))
        else:  # mmap cannot map an empty file
            self.tokens = np.empty(0, dtype=self.dtype)

    def _fail(self, what: str) -> DatasetError:
        return DatasetError(f"{self.idx_path} is not a valid megalite index: {what}. {FIX_HINT}")

    def _read_index(self) -> None:
        size = os.path.getsize(self.idx_path)
        if size < HEADER.size:
            raise self._fail(f"expected a {HEADER.size}-byte header, found a {size}-byte "
                             f"file (truncated)")
        with open(self.idx_path, "rb") as f:
            magic, version, code, num_docs, num_tokens = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise self._fail(f"expected magic bytes {MAGIC!r}, found {magic!r} (not an "
                             f"index written by megalite)")
        if version != VERSION:
            raise self._fail(f"expected format version {VERSION}, found {version}")
        if code not in DTYPE_CODES:
            raise self._fail(f"expected dtype code in {sorted(DTYPE_CODES)}, found {code}")
        sizes_at, offsets_at, expected = _index_layout(num_docs)
        if size != expected:
            state = "truncated" if size < expected else "trailing bytes"
            raise self._fail(f"expected {expected} bytes for {num_docs} documents, found "
                             f"{size} ({state})")
        self.dtype = DTYPE_CODES[code]
        self.num_tokens = int(num_tokens)
        self.sizes = np.memmap(self.idx_path, dtype="<i4", mode="r", offset=sizes_at,
                               shape=(num_docs,)) if num_docs else np.empty(0, np.int32)
        self.offsets = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=offsets_at,
                                 shape=(num_docs + 1,))
        if (self.offsets[0] != 0 or self.offsets[-1] != num_tokens
                or not np.array_equal(np.diff(self.offsets), self.sizes)):
            raise self._fail(f"document sizes and offsets disagree with {num_tokens} tokens")

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Ids ``[offset, offset + length)`` of document ``i`` (a zero-copy view)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document index {i} is out of range for {n} documents")
        i = i + n if i < 0 else i
        size = int(self.sizes[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"span offset={offset}, length={length} does not fit in "
                             f"document {i} of {size} tokens")
        start = int(self.offsets[i]) + offset
        return np.asarray(self.tokens[start:start + length])

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, documents={len(self)}, "
                f"tokens={self.num_tokens}, dtype={self.dtype})")
