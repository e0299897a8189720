"""A checkpoint's files written durably: fsynced, replaced atomically, hashed as they are written.

- :func:`write_json_atomic`: a JSON file written beside its target, fsynced, then renamed over it,
  so a reader sees the old file or the new one, never half of one;
- :func:`write_safetensors`: a safetensors file written straight from the tensors' memory, with
  its SHA-256 computed over the same bytes (one pass), in the order :func:`safetensors_order`
  gives (by dtype, widest first, then by name: the order ``safetensors`` itself writes);
- :func:`sha256_file` and :func:`fsync_path`, which readers and the atomic renames use.

:mod:`megalite.checkpoint.format` re-exports each name; the format (what the files hold) is there.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os

import torch


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# safetensors' dtype names, in the order its writer sorts tensors by (descending) before their names.
_ST_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
              torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3",
              torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_ST_ORDER = {name: i for i, name in enumerate(_ST_DTYPES.values())}


def safetensors_order(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The order of the tensors' bytes in a safetensors file (by dtype, widest first, then by
    name): what :func:`write_safetensors` writes, and how a staging buffer lays them out."""
    return sorted(tensors, key=lambda k: (_ST_ORDER[_ST_DTYPES[tensors[k].dtype]], k))


def _byte_runs(tensors: dict[str, torch.Tensor], order: list[str]):
    """The tensors' bytes in ``order``, as memoryviews; tensors that lie one after the other in
    one host buffer (an asynchronous save's staging buffer) come as one run, so a background
    writer drops and takes back the GIL a few times per file, not a few times per tensor."""
    run = None  # [start address, end address, tensors kept alive]
    for key in order:
        t = tensors[key].detach()
        if t.numel() == 0:
            continue
        t = t.cpu().contiguous()
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if run is not None and run[1] == start:
            run[1] = end
            run[2].append(t)
            continue
        if run is not None:
            yield memoryview((ctypes.c_ubyte * (run[1] - run[0])).from_address(run[0]))
        run = [start, end, [t]]
    if run is not None:
        yield memoryview((ctypes.c_ubyte * (run[1] - run[0])).from_address(run[0]))


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write ``tensors`` as a safetensors file (the bytes ``safetensors.torch.save_file``
    writes: an 8-byte header length, the JSON header padded with spaces to 8 bytes, then each
    tensor's bytes, sorted by dtype and name), fsync it, and return its SHA-256.

    Why not ``save_file``: it holds the GIL while it serializes, so a background writer
    (:mod:`megalite.checkpoint.async_save`) would stall the training thread; here the bytes go
    to the file (and the hash) straight from the tensors' memory, in runs as long as the
    memory allows, and ``write`` and ``update`` release the GIL. Device tensors are copied to
    the host one at a time."""
    order = safetensors_order(tensors)
    header, offset = {"__metadata__": dict(sorted(metadata.items()))}, 0
    for key in order:
        t = tensors[key]
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(text).to_bytes(8, "little"), text):
            f.write(chunk)
            digest.update(chunk)
        for data in _byte_runs(tensors, order):
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()
