"""Fail before the work, not after it: checks run at startup, before any process group,
model or step, so a bad path or bad data never costs the iterations before the first save.

- ``--save``: the directory can be created and written, and its filesystem has room for one
  checkpoint (estimated: fp32 master weights and two fp32 Adam moments, 12 bytes per
  parameter of the whole model; each value is written by exactly one rank).
- every other output flag (``--log-json``, ``--tensorboard-dir``, ``--wandb-save-dir``,
  ``--pipeline-trace``, ``--profile-dir`` with ``--profile``): its folder (the parent folder for
  a file flag) is created and written to, or the run is refused naming the flag, the path and why.
- ``--data-path``: every dataset opens (headers checked) and holds no token id outside the
  model's vocabulary.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid

from megalite.checkpoint.format import CheckpointError
from megalite.config import ConfigError
from megalite.data_parallel.update_rule import DEFAULT_RULE, UpdateRule
from megalite.run_settings import LoggingSettings


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _why(e: OSError) -> str:
    return {errno.ENOTDIR: "a part of the path is a file, not a directory",
            errno.EEXIST: "it exists and is not a directory",
            errno.EISDIR: "it is a directory, not a file",
            errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "not permitted: a read-only or special filesystem",
            errno.ENOSPC: "the filesystem is full"}.get(e.errno, e.strerror or str(e))


def _writable_folder(folder: str) -> None:
    """Create ``folder`` (and its parents) and write a probe file there; OSError if not possible."""
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, f".megalite-write-test-{uuid.uuid4().hex}")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


# (LoggingSettings field, flag, is a directory); --save has its own check (room for a checkpoint): check_save_location.
OUTPUT_FLAGS = (("log_json", "--log-json", False), ("tensorboard_dir", "--tensorboard-dir", True),
                ("wandb_save_dir", "--wandb-save-dir", True), ("pipeline_trace", "--pipeline-trace", True),
                ("profile_dir", "--profile-dir", True))


def output_paths(log: LoggingSettings) -> list[tuple[str, str, bool]]:
    """(flag, path, is a directory) of every output the run will write besides --save."""
    out = []
    for attr, flag, is_dir in OUTPUT_FLAGS:
        path = getattr(log, attr)
        if path and (attr != "profile_dir" or log.profile):
            out.append((flag, path, is_dir))
    return out


def check_output_paths(log: LoggingSettings) -> None:
    """Create every output folder of ``log`` now, before the model is built, or raise ConfigError
    with one line per unusable path naming the flag, the path, the reason and the fix."""
    problems = []
    for flag, path, is_dir in output_paths(log):
        folder = path if is_dir else os.path.dirname(os.path.abspath(path))
        what = "create and write that directory" if is_dir else f"create and write its folder {folder}"
        try:
            _writable_folder(folder)
            if not is_dir and os.path.isdir(path):
                what, e = "write that file", IsADirectoryError(errno.EISDIR, "is a directory", path)
                raise e
            if not is_dir and os.path.exists(path):
                what = "write that file"
                open(path, "a").close()  # writable? (appends nothing)
        except OSError as e:
            kind = "directory" if is_dir else "file path"
            problems.append(f"{flag} {path}: cannot {what} ({_why(e)}). Fix: choose a writable {kind} for {flag}.")
    if problems:
        raise ConfigError("\n".join(problems))


def check_save_location(root: str, num_parameters: int, rule: UpdateRule = DEFAULT_RULE,
                        matrix_parameters: int = 0) -> None:
    """Raise CheckpointError naming the path, the problem and the fix. A checkpoint holds
    ``rule.bytes_per_parameter`` per parameter: fp32 master weights and the update rule's state;
    ``rule.bytes_of(True)`` for the ``matrix_parameters`` of them in the rule's matrix class
    (Muon's matrices: 8, :func:`megalite.model.counting.total_matrix_parameters`)."""
    try:
        _writable_folder(root)
    except OSError as e:
        raise CheckpointError(f"--save {root}: cannot create and write checkpoints there ({_why(e)}). Fix: "
                              f"choose a writable directory for --save.") from e
    needed = rule.state_bytes_total(matrix_parameters, num_parameters - matrix_parameters)
    free = shutil.disk_usage(root).free
    if free < needed:
        per = (f"{num_parameters:,} parameters x {rule.bytes_per_parameter} bytes" if not matrix_parameters else
               f"{matrix_parameters:,} matrix parameters x {rule.bytes_of(True)} bytes and "
               f"{num_parameters - matrix_parameters:,} others x {rule.bytes_of(False)}")
        raise CheckpointError(f"--save {root}: {_gib(free)} free on that filesystem, but one checkpoint needs "
                              f"about {_gib(needed)} ({per}: fp32 weights and {rule.describe_state()}). Fix: free "
                              f"space there, or point --save elsewhere.")


def check_datasets(prefixes: list[str], vocab_size: int) -> None:
    """Open every dataset (missing or corrupt files raise DatasetError) and check its ids."""
    from megalite.data.builder import check_dataset_vocab
    from megalite.data.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        check_dataset_vocab(IndexedDataset(prefix), vocab_size)
