"""Fail before the work, not after it: checks run at startup, before any process group,
model or step, so a bad path or bad data never costs the iterations before the first save.

- ``--save``: the directory can be created and written, and its filesystem has room for one
  checkpoint (estimated: fp32 master weights and two fp32 Adam moments, 12 bytes per
  parameter of the whole model; each value is written by exactly one rank).
- ``--data-path``: every dataset opens (headers checked) and holds no token id outside the
  model's vocabulary.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid

from megalite.checkpoint.format import CheckpointError

CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weight + exp_avg + exp_avg_sq


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_save_location(root: str, num_parameters: int) -> None:
    """Raise CheckpointError naming the path, the problem and the fix."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".megalite-write-test-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        why = {errno.ENOTDIR: "a part of the path is a file, not a directory",
               errno.EEXIST: "it exists and is not a directory",
               errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied",
               errno.EPERM: "not permitted: a read-only or special filesystem",
               errno.ENOSPC: "the filesystem is full"}.get(e.errno, e.strerror or str(e))
        raise CheckpointError(f"--save {root}: cannot create and write checkpoints there ({why}). Fix: "
                              f"choose a writable directory for --save.") from e
    needed = CHECKPOINT_BYTES_PER_PARAMETER * num_parameters
    free = shutil.disk_usage(root).free
    if free < needed:
        raise CheckpointError(f"--save {root}: {_gib(free)} free on that filesystem, but one checkpoint needs "
                              f"about {_gib(needed)} ({num_parameters:,} parameters x 12 bytes: fp32 weights "
                              f"and two Adam moments). Fix: free space there, or point --save elsewhere.")


def check_datasets(prefixes: list[str], vocab_size: int) -> None:
    """Open every dataset (missing or corrupt files raise DatasetError) and check its ids."""
    from megalite.data.builder import check_dataset_vocab
    from megalite.data.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        check_dataset_vocab(IndexedDataset(prefix), vocab_size)
