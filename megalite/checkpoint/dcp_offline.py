"""torch_dcp checkpoints without a process group: read full tensors, write full tensors.

Offline tools (tools/reshard_checkpoint.py, the serial loader) see a torch_dcp checkpoint
through :class:`DcpReader`, which answers as :class:`megalite.checkpoint.format.PieceReader`
does (``metadata``, ``names``, ``has``, ``full_tensor``): DCP assembles each full tensor
from the stored chunks, one tensor per read, so memory stays near one full tensor.
:func:`write_full_checkpoint` writes a state dict of full tensors with DCP (one process,
``no_dist``); the result loads under any layout like a training save.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megalite.checkpoint.expert_bias import KIND as BIAS_KIND
from megalite.checkpoint.expert_bias import load_expert_biases
from megalite.checkpoint.format import FORMAT_VERSION, VOCAB_PARAMS, CheckpointError, resolve_checkpoint
from megalite.checkpoint.names import global_pieces

CKPT_FORMAT = "torch_dcp"
# DCP says so each time it runs in one process: here, that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized",
                        category=UserWarning)


def is_dcp_checkpoint(directory: str) -> bool:
    """Whether an iteration directory holds a torch_dcp checkpoint (metadata.json says so)."""
    try:
        with open(os.path.join(directory, "metadata.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("ckpt_format") == CKPT_FORMAT


def read_dcp_index(directory: str) -> dict:
    """DCP's {key: storage metadata} (its ``.metadata`` file: a pickle, see docs/checkpoints.md)."""
    try:
        return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any failure to read DCP's index is a broken checkpoint
        raise CheckpointError(f"{os.path.join(directory, '.metadata')}: DCP's index cannot be read "
                              f"({type(e).__name__}: {e}): the checkpoint is incomplete or corrupt.") from e


class _IndexedReader(dcp.FileSystemReader):
    """A FileSystemReader that unpickles DCP's index once, however many reads follow."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self._index = None

    def read_metadata(self, *args, **kwargs):
        if self._index is None:
            self._index = super().read_metadata(*args, **kwargs)
        return self._index


def read_tensors(directory: str, shapes: dict, reader=None) -> dict:
    """Full tensors ``{key: tensor}`` for ``shapes`` ({key: (shape, dtype)}), read by DCP in
    this process (``reader``: a FileSystemReader of ``directory`` to reuse)."""
    state = {k: torch.empty(list(shape), dtype=dtype) for k, (shape, dtype) in shapes.items()}
    with read_errors(directory):
        dcp.load(state, storage_reader=reader or dcp.FileSystemReader(directory), no_dist=True)
    return state


@contextlib.contextmanager
def read_errors(directory: str):
    """DCP's read failures (a missing or truncated ``.distcp`` file) as one CheckpointError.
    DCP's files carry no checksums: a flipped bit that still parses is not detected."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        first = [line for line in str(e).strip().splitlines() if line.strip()]
        raise CheckpointError(f"checkpoint {directory!r}: DCP could not read its files ({type(e).__name__}: "
                              f"{first[-1] if first else e}): the checkpoint is incomplete or corrupt. Fix: load an "
                              f"earlier iteration (iter_* directories) or re-save.") from e


class DcpReader:
    """PieceReader's reading interface over a torch_dcp checkpoint directory."""

    def __init__(self, directory: str):
        self.directory = directory
        try:
            with open(os.path.join(directory, "metadata.json")) as f:
                self.metadata = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{os.path.join(directory, 'metadata.json')}: unreadable ({e}): the "
                                  f"checkpoint's metadata is corrupt.") from None
        if not isinstance(self.metadata, dict) or self.metadata.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{os.path.join(directory, 'metadata.json')}: not a megalite format "
                                  f"version {FORMAT_VERSION} record: the checkpoint's metadata is corrupt.")
        self.index = {k: md for k, md in read_dcp_index(directory).items() if isinstance(md, TensorStorageMetadata)}
        self._reader = _IndexedReader(directory)

    def names(self, kind: str = "weight") -> list[str]:
        return sorted(k[len(kind) + 1:] for k in self.index if k.startswith(kind + "/"))

    def has(self, name: str, kind: str) -> bool:
        return f"{kind}/{name}" in self.index

    def full_tensor(self, name: str, kind: str, vocab_size: int | None = None) -> torch.Tensor:
        """The full tensor (vocabulary rows unpadded, as stored)."""
        key = f"{kind}/{name}"
        md = self.index.get(key)
        if md is None:
            raise CheckpointError(f"checkpoint {self.directory!r} has no {kind!r} for parameter {name!r}.")
        full = read_tensors(self.directory, {key: (md.size, md.properties.dtype)}, self._reader)[key]
        if vocab_size is not None and name in VOCAB_PARAMS:
            full = full[:vocab_size]
        return full


def write_full_checkpoint(directory: str, tensors: dict) -> None:
    """DCP's files for a state dict of full tensors, written by this process alone."""
    dcp.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
             storage_writer=dcp.FileSystemWriter(directory), no_dist=True)


def load_dcp_serial_model(path: str, dtype: torch.dtype = torch.float32):
    """:func:`megalite.checkpoint.serial.load_serial_model` for a torch_dcp checkpoint: a
    single-process GPTModel with its weights, in eval mode."""
    from megalite.checkpoint.serial import model_config_from
    from megalite.model.gpt import GPTModel

    directory = resolve_checkpoint(path)
    reader = DcpReader(directory)
    cfg = model_config_from(reader.metadata["config"]["model"])
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    model = GPTModel(cfg)
    params = dict(model.named_parameters())
    wanted = {}
    for name, p in params.items():
        for global_name, _, _, _ in global_pieces(name, p):
            md = reader.index.get(f"weight/{global_name}")
            if md is None:
                raise CheckpointError(f"checkpoint {directory!r} has no 'weight' for parameter {global_name!r}.")
            wanted[f"weight/{global_name}"] = (md.size, torch.float32)
    full = read_tensors(directory, wanted)
    with torch.no_grad():
        for name, p in params.items():
            if name in VOCAB_PARAMS:
                value = full[f"weight/{name}"]
                p.zero_()
                p[: value.shape[0]] = value
                continue
            for global_name, start, numel, _ in global_pieces(name, p):
                p.view(-1)[start: start + numel] = full[f"weight/{global_name}"].reshape(-1)
        load_expert_biases(model, {n: reader.full_tensor(n, BIAS_KIND) for n in reader.names(BIAS_KIND)})
    return model.to(dtype).eval()
