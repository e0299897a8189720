"""The checkpoint format: layout-agnostic pieces of global tensors, safetensors + JSON.

A checkpoint of iteration N is the directory ``iter_000000N`` holding

- ``metadata.json`` (rank 0): format version, iteration, consumed samples, the config, the
  layout it was written under, optimizer step, loss-scaler state and the update rule's record
  (:mod:`megalite.checkpoint.rule_record`);
- ``rankXXXXX.safetensors`` (each rank that owns something): its *pieces* and its RNG state;
- ``rankXXXXX.json``: what each piece is, and the file's SHA-256, checked at load;
- ``tokenizer/`` (rank 0): copies of the files of the tokenizer the run trained with (a
  sentencepiece ``.model``, or a Hugging Face folder's tokenizer files), described by
  metadata.json's ``tokenizer`` record: ``type``, ``vocab_size``, ``eod``, ``bos``,
  ``add_bos``, ``model`` (the path to build it from, relative to the iteration directory, or
  null for a ``NullTokenizer``, which has no files) and ``files`` (relative path -> SHA-256).

A piece is a flat range of one tensor of one parameter, in global terms:
``{key, name, kind, tp_rank, tp_size, split, local_shape, range}``. ``name`` is the global
parameter name (``layers.7.mlp.fc1.weight``), ``kind`` is ``weight`` (the fp32 master
weights) or one of the update rule's state tensors (AdamW: ``exp_avg``, ``exp_avg_sq``); the rank's tensor-parallel shard of the parameter
has shape ``local_shape`` (cut from the full tensor by ``split`` = [dim, sections], or
replicated when null) and the piece is elements ``range`` of that shard, flattened. So a
ZeRO rank writes the flat ranges of its optimizer shard, a DP-replicated tensor is written
once (DP rank 0), a TP-replicated one once (TP rank 0), and the tied embedding's copy on
the last pipeline stage not at all. Any layout reads any other: pieces are assembled into
the full tensor of a name, then cut again for the reader's layout.

Vocabulary rows: the embedding and output layer are stored without padding rows (the
padding depends on TP) and padded with zeros at load. Nothing is pickled.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict

import torch
from safetensors import safe_open

from megalite.checkpoint.file_writes import (_byte_runs, fsync_path, safetensors_order,  # noqa: F401 - re-exported
                                             sha256_file, write_json_atomic, write_safetensors)
from megalite.parallel.sharding import TPSplit, unshard_tensors

FORMAT_VERSION = 1
VOCAB_PARAMS = ("word_embeddings.weight", "output_layer.weight")
REQUIRED = ("format_version", "iteration", "config", "layout", "files")  # metadata.json's keys every reader needs


TOKENIZER_DIR = "tokenizer"  # the folder in an iteration directory
# A Hugging Face tokenizer folder's files (copied into a checkpoint, and carried by HF exports).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                   "chat_template.jinja", "chat_template.json")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, incomplete or does not fit the run."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def write_rank_files(directory: str, rank: int, tensors: dict[str, torch.Tensor], pieces: list[dict]) -> None:
    """rankXXXXX.safetensors (fsynced) and its description with the file's checksum."""
    path = os.path.join(directory, f"rank{rank:05d}.safetensors")
    sha = write_safetensors(path, tensors, {"format": f"megalite-checkpoint-v{FORMAT_VERSION}"})
    write_json_atomic(path[: -len(".safetensors")] + ".json",
                      {"file": os.path.basename(path), "sha256": sha, "pieces": pieces})


def complete_iterations(root: str) -> list[int]:
    """The iterations under ``root`` whose directory is complete (holds metadata.json)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith("iter_") and name[5:].isdigit() and is_iteration_dir(os.path.join(root, name)):
            found.append(int(name[5:]))
    return sorted(found)


def same_layout(saved: dict, current: dict) -> bool:
    """Whether two layouts match (a checkpoint older than a grid field has that field's default)."""
    defaults = {"ep": 1, "experts": False}
    return all(saved.get(k, defaults.get(k)) == v for k, v in current.items())


def is_iteration_dir(path: str) -> bool:
    """Whether ``path`` is one iteration's checkpoint (it holds the metadata file)."""
    return os.path.isfile(os.path.join(path, "metadata.json")) and not path.rstrip(os.sep).endswith(".tmp")


def _available(root: str) -> str:
    done = complete_iterations(root)
    if not done:
        return f"There is no complete iteration in {root!r}."
    return (f"The complete iterations in {root!r}: {', '.join(map(str, done))}. Fix: --load {root} "
            f"--ckpt-step N, or --load {iteration_dir(root, done[-1])}.")


def read_latest(root: str) -> int:
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root!r} does not exist. Fix: check --load.")
    path = os.path.join(root, "latest")
    if not os.path.exists(path):
        if complete_iterations(root):
            raise CheckpointError(f"{root!r} has no 'latest' file. {_available(root)}")
        raise CheckpointError(f"{root!r} has no 'latest' file, so no complete checkpoint was ever "
                              f"written there. Fix: point --load at a directory written with --save.")
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path!r} should hold an iteration number, found {text[:40]!r}.")
    return int(text)


def is_hugging_face_folder(path: str) -> bool:
    """A Hugging Face model folder: config.json beside its weights (safetensors or pytorch_model*.bin)."""
    files = os.listdir(path) if os.path.isdir(path) else []
    return "config.json" in files and any(f.endswith(".safetensors") or re.fullmatch(r"pytorch_model.*\.bin", f)
                                          for f in files)


def resolve_checkpoint(path: str, iteration: int | None = None) -> str:
    """The iteration directory that ``--load PATH [--ckpt-step N]`` names: PATH itself when it
    is one (it holds metadata.json), else PATH/iter_N, else the one PATH's 'latest' names."""
    parent = os.path.dirname(path.rstrip(os.sep)) or "."
    name = os.path.basename(path.rstrip(os.sep))
    if name.endswith(".tmp"):
        raise CheckpointError(f"{path!r} is an unfinished save (a .tmp directory). {_available(parent)}")
    if not os.path.isdir(path):
        named = name.startswith("iter_") and os.path.isdir(parent)
        raise CheckpointError(f"checkpoint directory {path!r} does not exist. "
                              + (_available(parent) if named else "Fix: check --load."))
    if is_iteration_dir(path):
        if iteration is not None and name.startswith("iter_") and name[5:].isdigit() and int(name[5:]) != iteration:
            raise CheckpointError(f"--ckpt-step {iteration} contradicts --load {path} (iteration {int(name[5:])}). "
                                  f"Fix: give the checkpoint root with --ckpt-step, or the iteration directory alone.")
        return path
    if name.startswith("iter_") and name[5:].isdigit():  # an iteration directory without its metadata
        raise CheckpointError(f"{path!r} is not a complete checkpoint (no metadata.json: an interrupted save "
                              f"or a partial copy). {_available(parent)}")
    if is_hugging_face_folder(path):
        folder = path.rstrip(os.sep)
        raise CheckpointError(f"{path!r} is a Hugging Face model folder (config.json and its weights), not a megalite "
                              f"checkpoint. Fix: convert it once with `python tools/convert_hf.py --direction import "
                              f"--hf-dir {folder} --save {folder}-megalite`, then --load {folder}-megalite.")
    if iteration is None:
        iteration = read_latest(path)
        what = f"'latest' names iteration {iteration}, but"
    else:
        what = f"--ckpt-step {iteration}:"
    directory = iteration_dir(path, iteration)
    if not is_iteration_dir(directory):
        state = "is incomplete (no metadata.json)" if os.path.isdir(directory) else "does not exist"
        raise CheckpointError(f"{what} {directory!r} {state}. {_available(path)}")
    return directory


class PieceReader:
    """Reads the pieces of one checkpoint directory and assembles full tensors by name."""

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint {directory!r} does not exist. Fix: check --load / "
                                  f"the 'latest' file, or pick an existing iter_* directory.")
        meta_path = os.path.join(directory, "metadata.json")
        if not os.path.exists(meta_path):
            raise CheckpointError(f"{meta_path!r} is missing: the checkpoint is incomplete.")
        self.directory = directory
        try:
            self.metadata = json.load(open(meta_path))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{meta_path}: not valid JSON ({e}): the checkpoint's metadata is corrupt.") from None
        if not isinstance(self.metadata, dict):
            raise CheckpointError(f"{meta_path}: not a JSON object: the checkpoint's metadata is corrupt.")
        if self.metadata.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{meta_path}: format version {self.metadata.get('format_version')}, "
                                  f"this megalite reads version {FORMAT_VERSION}.")
        missing = [k for k in REQUIRED if k not in self.metadata]
        if missing:
            raise CheckpointError(f"{meta_path}: lacks {', '.join(missing)}: the checkpoint's metadata is corrupt.")
        self.index: dict[tuple[str, str], list[tuple[str, dict]]] = defaultdict(list)
        self.descriptions = {}
        for name in self.metadata["files"]:
            desc_path = os.path.join(directory, name[: -len(".safetensors")] + ".json")
            if not os.path.exists(desc_path) or not os.path.exists(os.path.join(directory, name)):
                raise CheckpointError(f"checkpoint {directory!r} lists {name} but it (or its .json) "
                                      f"is missing: the checkpoint is incomplete.")
            desc = json.load(open(desc_path))
            self.descriptions[name] = desc
            for piece in desc["pieces"]:
                self.index[(piece["name"], piece["kind"])].append((name, piece))
        self._verified: set[str] = set()
        self._open = {}

    def _file(self, name: str):
        if name not in self._verified:
            path = os.path.join(self.directory, name)
            expected = self.descriptions[name]["sha256"]
            actual = sha256_file(path)
            if actual != expected:
                raise CheckpointError(f"{path}: checksum mismatch (expected {expected[:16]}..., found "
                                      f"{actual[:16]}...): the file is corrupt or truncated. Fix: load "
                                      f"an earlier checkpoint (iter_* directories) or re-save.")
            self._verified.add(name)
            try:
                self._open[name] = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file
                raise CheckpointError(f"{path}: cannot be read as safetensors ({e}).") from e
        return self._open[name]

    def names(self, kind: str = "weight") -> list[str]:
        return sorted({n for n, k in self.index if k == kind})

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.index

    def rank_tensor(self, rank_file: str, key: str) -> torch.Tensor:
        return self._file(rank_file).get_tensor(key)

    def full_tensor(self, name: str, kind: str, vocab_size: int | None = None) -> torch.Tensor:
        """The full (unsharded) tensor, assembled from every piece; vocab rows unpadded."""
        entries = self.index.get((name, kind))
        if not entries:
            if self.metadata.get("ckpt_format") == "torch_dcp":
                raise CheckpointError(f"checkpoint {self.directory!r} is in the torch_dcp format: read it through "
                                      f"megalite.checkpoint (load_checkpoint, load_serial_model) or convert it with "
                                      f"tools/reshard_checkpoint.py --to-format megalite.")
            raise CheckpointError(f"checkpoint {self.directory!r} has no {kind!r} for parameter {name!r}.")
        by_tp: dict[int, torch.Tensor] = {}
        filled: dict[int, int] = defaultdict(int)
        split = tp_size = None
        for file_name, piece in entries:
            split = piece["split"]
            # Not TP-split: whichever TP rank wrote it (experts under TP x EP are written by the
            # rank that holds them, TP rank 1 included) holds the whole tensor.
            tp_rank, tp_size = (piece["tp_rank"], piece["tp_size"]) if split else (0, 1)
            shape = piece["local_shape"]
            if tp_rank not in by_tp:
                by_tp[tp_rank] = torch.zeros(int(torch.tensor(shape).prod()) if shape else 1)
            lo, hi = piece["range"]
            by_tp[tp_rank][lo:hi] = self._file(file_name).get_tensor(piece["key"]).float()
            filled[tp_rank] += hi - lo
        shape = entries[0][1]["local_shape"]
        count = by_tp[next(iter(by_tp))].numel()
        missing = [r for r in range(tp_size if split else 1) if filled.get(r, 0) != count]
        if missing:
            raise CheckpointError(f"checkpoint {self.directory!r} is incomplete: parameter {name!r} "
                                  f"({kind}) lacks pieces of tensor-parallel rank(s) {missing}.")
        if split is None:
            full = by_tp[0].view(shape)
        else:
            full = unshard_tensors([by_tp[r].view(shape) for r in range(tp_size)], TPSplit(*split))
        if vocab_size is not None and name in VOCAB_PARAMS:
            full = full[:vocab_size]
        return full


def _tokenizer_sources(tokenizer, kind: str) -> tuple[dict[str, str], str | None]:
    """(name in tokenizer/ -> source file, the name the tokenizer is built from) for ``tokenizer``."""
    if kind in SENTENCEPIECE_TYPES:
        name = os.path.basename(tokenizer.model_path)
        return {name: tokenizer.model_path}, name
    if kind == "HuggingFaceTokenizer":

        path = tokenizer.path
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        sources = {n: os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))}
        if os.path.isdir(path):
            return sources, ""
        sources[os.path.basename(path)] = path  # a tokenizer.json given by its own (any) name
        return sources, os.path.basename(path)
    return {}, None


def write_tokenizer(directory: str, tokenizer) -> dict:
    """Copy ``tokenizer``'s files into ``directory``/tokenizer (rank 0, into the unfinished
    iteration directory) and return metadata.json's ``tokenizer`` record (see the module
    docstring). A ``NullTokenizer`` (mock data) is recorded with no model and no files."""
    kind = getattr(tokenizer, "tokenizer_type", type(tokenizer).__name__)
    record = {"type": kind, "vocab_size": int(tokenizer.vocab_size), "eod": tokenizer.eod,
              "bos": getattr(tokenizer, "bos", None), "add_bos": bool(getattr(tokenizer, "add_bos", False)),
              "model": None, "files": {}}
    sources, model = _tokenizer_sources(tokenizer, kind)
    if not sources:
        return record
    os.makedirs(os.path.join(directory, TOKENIZER_DIR), exist_ok=True)
    for name, source in sorted(sources.items()):
        target = os.path.join(directory, TOKENIZER_DIR, name)
        shutil.copyfile(source, target)
        record["files"][f"{TOKENIZER_DIR}/{name}"] = sha256_file(target)
    record["model"] = f"{TOKENIZER_DIR}/{model}" if model else TOKENIZER_DIR
    return record


def checkpoint_tokenizer(directory: str, metadata: dict) -> dict | None:
    """The ``tokenizer`` record of a checkpoint, its files verified against their SHA-256,
    with ``path`` added (the absolute path to build it from; None for a NullTokenizer). None
    when the checkpoint records no tokenizer. A missing or altered file: CheckpointError."""
    record = metadata.get("tokenizer")
    if record is None:
        return None
    if not isinstance(record, dict) or "type" not in record or not isinstance(record.get("files", {}), dict):
        raise CheckpointError(f"{os.path.join(directory, 'metadata.json')}: the tokenizer record is corrupt.")
    for name, expected in sorted(record.get("files", {}).items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: the checkpoint records it as a file of its tokenizer "
                                  f"({record['type']}). Fix: copy the iteration directory whole, or give "
                                  f"--tokenizer-type and --tokenizer-model.")
        actual = sha256_file(path)
        if actual != expected:
            raise CheckpointError(f"{path}: checksum mismatch (expected {expected[:16]}..., found {actual[:16]}...): "
                                  f"the checkpoint's tokenizer file was altered or is corrupt. Fix: restore it, or "
                                  f"give --tokenizer-type and --tokenizer-model.")
    model = record.get("model")
    return {**record, "path": os.path.join(directory, model) if model else None}
