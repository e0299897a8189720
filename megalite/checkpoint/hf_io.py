"""Streaming Hugging Face checkpoint files: read tensor by tensor, write in shards.

A Hugging Face model directory holds ``config.json`` and either one ``model.safetensors``
or shards ``model-0000k-of-0000n.safetensors`` listed by ``model.safetensors.index.json``
(``{"weight_map": {tensor name: shard file}}``). :class:`HFReader` opens a shard only when
one of its tensors is asked for and returns one tensor at a time, so converting a model needs
memory of the order of its largest tensor (or layer), never the whole model.
:class:`HFShardWriter` is the reverse: tensors are appended to the current shard, which is
written once it passes ``max_shard_bytes``; ``close()`` names the shards ``-of-N`` and writes
the index. Nothing is pickled.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megalite.checkpoint.format import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFReader:
    """The tensors of a Hugging Face model directory, by name, read lazily."""

    def __init__(self, directory: str):
        self.directory = directory
        config_path = os.path.join(directory, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"{config_path} is missing: a Hugging Face model directory has config.json "
                                  f"and model.safetensors (or shards with {INDEX}). Fix: point --hf-dir at "
                                  f"the directory save_pretrained wrote.")
        self.config = json.load(open(config_path))
        index_path = os.path.join(directory, INDEX)
        if os.path.isfile(index_path):
            self.weight_map = json.load(open(index_path))["weight_map"]
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            with safe_open(os.path.join(directory, SINGLE), framework="pt") as f:
                self.weight_map = {name: SINGLE for name in f.keys()}
        else:
            raise CheckpointError(f"{directory} has neither {SINGLE} nor {INDEX}: no weights to read (only "
                                  f"safetensors are read, never pickled .bin files). Fix: re-save with "
                                  f"save_pretrained(..., safe_serialization=True).")
        missing = sorted({f for f in self.weight_map.values() if not os.path.isfile(os.path.join(directory, f))})
        if missing:
            raise CheckpointError(f"{directory}: the index names shard(s) {missing} that are not there. Fix: "
                                  f"download or copy the missing files.")
        self._open: dict[str, object] = {}

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is not in the checkpoint (the architecture "
                                  f"in config.json expects it).")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.directory, file), framework="pt")
        return self._open[file].get_tensor(name)

    def dtype(self) -> torch.dtype:
        """The dtype the weights are stored in (of the first tensor)."""
        return self.get(next(iter(self.weight_map))).dtype


class HFShardWriter:
    """Writes tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards plus the index."""

    def __init__(self, directory: str, max_shard_bytes: int = 5 * 2**30):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        os.makedirs(directory, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per written shard
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous().cpu()
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def _tmp(self, k: int) -> str:
        return os.path.join(self.directory, f".shard-{k:05d}.tmp")

    def _flush(self) -> None:
        if not self._pending:
            return
        save_file(self._pending, self._tmp(len(self._shards)), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Name the shards, write the index (several shards) and return the file names."""
        self._flush()
        n = len(self._shards)
        names = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        weight_map = {}
        for k, (name, tensors) in enumerate(zip(names, self._shards)):
            os.replace(self._tmp(k), os.path.join(self.directory, name))
            weight_map.update({t: name for t in tensors})
        if n > 1:
            with open(os.path.join(self.directory, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return names


def check_export_target(directory: str, force: bool, imported_from: str | None = None) -> None:
    """Refuse, before anything is written, to export into a folder that holds files (unless
    ``force``) or, even with ``force``, into the folder the checkpoint was imported from: that
    would overwrite the original model."""
    if not os.path.isdir(directory) or not os.listdir(directory):
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise CheckpointError(f"--hf-dir {directory} is a file, not a folder. Fix: name a new folder.")
        return
    if imported_from and os.path.isdir(imported_from) and os.path.samefile(directory, imported_from):
        raise CheckpointError(f"--hf-dir {directory} is the folder this checkpoint was imported from: exporting "
                              f"there would overwrite the original model (even with --force). Fix: a new folder.")
    if not force:
        raise CheckpointError(f"--hf-dir {directory} is not empty ({len(os.listdir(directory))} entries); nothing "
                              f"written. Fix: a new or empty folder, or --force to overwrite.")
    for name in os.listdir(directory):  # stale shards or index of another model would be read with ours
        if name == INDEX or (name.startswith("model") and name.endswith(".safetensors")):
            os.remove(os.path.join(directory, name))
