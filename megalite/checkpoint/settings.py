"""``--load``: the model's settings come from the checkpoint, not from the command line.

A checkpoint fixes the model (layers, sizes, heads, KV groups, FFN size, positions and their
RoPE base and scaling, norm and its epsilon, SwiGLU, biases, tied or not, vocabulary, experts
and their FFN size, which layers are MoE, the shared expert): a user
resuming or fine-tuning does not retype them. A flag given on the command line that agrees
is fine; one that contradicts the checkpoint is refused, naming both values. Settings a
checkpoint does not fix (sequence length, dropout, recomputation, kernels) come from the flags.

What a checkpoint carries beyond the model, from save to save (a ``--finetune`` run, an ordinary
resume): the ``source`` record of metadata.json (a Hugging Face import's model type, dtype,
folder and bos/eos/pad token ids) and the folder ``huggingface/`` inside the iteration directory,
which holds the tokenizer and generation files the import found next to the weights. The
import *copies* those files into the checkpoint rather than recording where they were, so a
moved or deleted download does not lose them: :func:`adopt_checkpoint_model` reads both when a
run loads a checkpoint (the files are small: a tokenizer is a few MB) and every save writes
them again (:func:`carry_forward`). A run that trains with a ``HuggingFaceTokenizer`` folder and
loaded none carries that folder's tokenizer files instead.
"""
from __future__ import annotations

import json
import os

from megalite.checkpoint.format import TOKENIZER_FILES, same_layout  # noqa: F401 - re-exported
from megalite.config_types import ConfigError, ModelConfig
from megalite.flag_spec import fixed_settings

CARRIED = "huggingface"  # the folder in an iteration directory
GENERATION_CONFIG = "generation_config.json"
_RECORD = "_checkpoint_record"  # attribute of the run's ModelConfig (not a field: never in config.json)

# The model settings a checkpoint fixes, derived from the ``fixed`` marks of ModelConfig's fields
# (megalite.config_types): model field -> (the flag that sets it, the argparse destinations of its flags).
# ``--load`` adopts them (:func:`adopt_checkpoint_model`) and the load refuses a checkpoint whose
# values differ from the run's (``SHAPE_FIELDS``, read by :func:`megalite.checkpoint.core.check_config`).
# Others (dropout, init std, backends) may change at load.
FIXED = fixed_settings(ModelConfig)
SHAPE_FIELDS = tuple(FIXED)


def checkpoint_config(load: str) -> dict:
    """The config a checkpoint was written with (sections model, parallel, train, data)."""
    from megalite.checkpoint.format import PieceReader
    from megalite.checkpoint.serial import _checkpoint_dir

    return PieceReader(_checkpoint_dir(load)).metadata["config"]


def read_files(folder: str | None, names=TOKENIZER_FILES + (GENERATION_CONFIG,)) -> dict[str, bytes]:
    """``{name: content}`` of the files ``names`` present in ``folder`` (none if it is not a folder)."""
    if not folder or not os.path.isdir(folder):
        return {}
    out = {}
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def write_files(folder: str, files: dict[str, bytes]) -> None:
    if not files:
        return
    os.makedirs(folder, exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content)


def checkpoint_record(directory: str) -> dict:
    """What the iteration directory ``directory`` carries: its source record and files."""
    with open(os.path.join(directory, "metadata.json")) as f:
        source = json.load(f).get("source") or {}
    return {"source": source, "files": read_files(os.path.join(directory, CARRIED))}


def carry_forward(config, directory: str) -> dict:
    """At a save (rank 0): write the carried files into ``directory``/huggingface and return the
    source record for metadata.json. When the loaded checkpoint carried no files (or none was
    loaded), the tokenizer files of the HuggingFaceTokenizer folder the run trains with are carried."""
    record = getattr(config.model, _RECORD, None) or {"source": {}, "files": {}}
    files, data = record["files"], config.data
    if not files and data.tokenizer_type == "HuggingFaceTokenizer" and data.tokenizer_model:
        folder = data.tokenizer_model
        files = read_files(folder if os.path.isdir(folder) else os.path.dirname(folder), TOKENIZER_FILES)
    write_files(os.path.join(directory, CARRIED), files)
    return record["source"]


def adopt_checkpoint_model(model: ModelConfig, saved: dict, given: set[str], tokenizer_vocab: int,
                           load: str) -> list[str]:
    """Set ``model``'s fixed fields to the checkpoint's; refuse flags in ``given`` (argparse
    destinations typed on the command line) that contradict it. Returns the fields taken."""
    conflicts, taken = [], []
    for field, (flag, dests) in FIXED.items():
        if field not in saved:
            continue  # a checkpoint older than the field: the run's value (its default) stands
        value, mine = saved[field], getattr(model, field)
        if field == "vocab_size":
            continue  # below: the tokenizer decides what the command line says
        if value == mine:
            continue
        if any(d in given for d in dests):
            conflicts.append(f"{flag}: the checkpoint has {value!r}, the command line gives {mine!r}")
        else:
            setattr(model, field, value)
            taken.append(field)
    if tokenizer_vocab > saved["vocab_size"]:
        conflicts.append(f"vocabulary: the tokenizer has {tokenizer_vocab} ids but the checkpoint's model only "
                         f"{saved['vocab_size']} (the tokenizer does not belong to this model)")
    elif model.vocab_size != saved["vocab_size"]:
        model.vocab_size = saved["vocab_size"]  # a model vocabulary larger than the tokenizer's is fine
        taken.append("vocab_size")
    if conflicts:
        raise ConfigError(f"--load {load}: the model's settings come from the checkpoint, and these flags "
                          f"contradict it:\n  " + "\n  ".join(conflicts) +
                          "\nFix: drop those flags (the checkpoint's values are used), or load another checkpoint.")
    from megalite.checkpoint.serial import _checkpoint_dir

    setattr(model, _RECORD, checkpoint_record(_checkpoint_dir(load)))  # carried on by every save
    return taken


def describe_layout_change(meta: dict, grid, t) -> str | None:
    """What changed since the checkpoint was written (layout, accumulation), when anything did."""

    then, now = meta["layout"], grid.layout.record()
    if same_layout(then, now):
        return None
    saved = meta["config"]["train"]
    micro_then = saved["global_batch_size"] // (saved["micro_batch_size"] * then["dp"])
    micro_now = t.global_batch_size // (t.micro_batch_size * now["dp"])
    dims = ", ".join(f"{d.upper()} {then.get(d, 1)} -> {now[d]}" for d in ("tp", "cp", "dp", "pp", "ep")
                     if then.get(d, 1) != now[d])
    return (f"layout changed since the checkpoint: {dims} (world {grid.layout.world_size}); the checkpoint was "
            f"re-cut for it (ZeRO shards included). Global batch {t.global_batch_size} "
            f"{'kept' if saved['global_batch_size'] == t.global_batch_size else 'CHANGED from ' + str(saved['global_batch_size'])}"
            f": accumulation steps {micro_then} -> {micro_now} per data-parallel rank.")
