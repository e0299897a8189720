"""Hugging Face <-> megalite checkpoints, streamed one unit (embeddings, a layer) at a time.

Import reads ``config.json`` for the architecture (GPT-2, Llama, Qwen2, Mixtral), then the tensors
of one unit at a time from the (sharded) safetensors, maps them to megalite's names and
layout (:mod:`megalite.checkpoint.hf` for GPT-2, :mod:`megalite.checkpoint.hf_llama` for
Llama, Qwen2 and Mixtral) and writes that unit as one file of a weights-only megalite checkpoint,
which loads under any layout. Export assembles each unit's full tensors from any megalite
checkpoint (whatever layout wrote it), maps them back and writes safetensors shards with
their index, ``config.json`` and ``generation_config.json``, in the dtype of the original
(or the training dtype). Memory: one unit, never the whole model.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from megalite.checkpoint import hf as gpt2
from megalite.checkpoint import hf_llama as llama
from megalite.checkpoint.format import CheckpointError, PieceReader
from megalite.checkpoint.hf_io import HFReader, HFShardWriter
from megalite.checkpoint.serial import _checkpoint_dir, model_config_from, write_weights_checkpoint
from megalite.progress import track

GPT2 = SimpleNamespace(import_globals=gpt2.import_globals, import_layer=gpt2.import_layer,
                       export_globals=gpt2.export_globals, export_layer=gpt2.export_layer)
LLAMA = SimpleNamespace(import_globals=llama.import_globals, import_layer=llama.import_layer,
                        export_globals=llama.export_globals, export_layer=llama.export_layer)
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def _family(model_type: str | None):
    if model_type in (None, "gpt2"):
        return GPT2
    if model_type in llama.ARCHITECTURES:
        return LLAMA
    raise llama.UnsupportedModel(f"config.json model_type {model_type!r} is not supported: megalite converts "
                                 f"gpt2, {', '.join(llama.ARCHITECTURES)}.")


def import_hf(hf_dir: str, save: str, seq_length: int | None = None, progress: bool = True) -> str:
    """Write ``hf_dir``'s model as a weights-only megalite checkpoint under ``save``. ``progress``: a
    bar of the units converted on stderr, when stderr is a terminal."""
    reader = HFReader(hf_dir)
    hf = reader.config
    model_type = hf.get("model_type", "gpt2")
    family = _family(model_type)
    cfg = gpt2.model_config_from_hf(hf) if family is GPT2 else llama.model_config_from_hf_llama(hf, seq_length)

    def get(name: str) -> torch.Tensor:  # GPT2Model (no LM head) saves names without "transformer."
        return reader.get(name if reader.has(name) else name.removeprefix("transformer."))

    def units():  # one at a time: the embeddings and head, then each layer
        yield family.import_globals(get, cfg)
        for i in range(cfg.num_layers):
            yield family.import_layer(get, i, cfg)

    source = {"format": "huggingface", "model_type": model_type,
              "torch_dtype": str(reader.dtype()).removeprefix("torch."),
              **{k: hf[k] for k in SPECIAL if hf.get(k) is not None}}
    bar = track(units(), total=cfg.num_layers + 1, enabled=progress, unit=" unit",
                desc=f"import {model_type}: embeddings + {cfg.num_layers} layers")
    return write_weights_checkpoint(save, cfg, bar, source=source)


def export_hf(load: str, hf_dir: str, model_type: str | None = None, dtype: str | None = None,
              max_shard_bytes: int = 5 * 2**30, progress: bool = True) -> str:
    """Write any megalite checkpoint of a GPT-2 or Llama-family model as a Hugging Face model.
    ``progress``: a bar of the units converted on stderr, when stderr is a terminal."""
    reader = PieceReader(_checkpoint_dir(load))
    meta = reader.metadata
    cfg = model_config_from(meta["config"]["model"])
    source = meta.get("source") or {}
    train = meta["config"].get("train", {})
    if cfg.position_embedding_type == "learned_absolute":
        model_type = model_type or "gpt2"
    else:
        model_type = model_type or source.get("model_type") or ("mixtral" if cfg.num_experts else
                                                                "qwen2" if cfg.add_qkv_bias else "llama")
    family = _family(model_type)
    dtype_name = dtype or source.get("torch_dtype") or ("bfloat16" if train.get("bf16") else
                                                        "float16" if train.get("fp16") else "float32")
    torch_dtype = getattr(torch, dtype_name)
    special = {k: source[k] for k in SPECIAL if k in source}
    if family is GPT2:
        if cfg.num_experts:
            raise CheckpointError(f"{load}: a GPT-2-style mixture-of-experts checkpoint ({cfg.num_experts} "
                                  f"experts); Hugging Face has no such architecture (an MoE model exports as "
                                  f"Mixtral: rope, RMSNorm, SwiGLU). Fix: load it with megalite (tools/generate.py, "
                                  f"--load), or train the Llama shape to export it.")
        config = gpt2.hf_config_from(cfg)
        config["torch_dtype"] = dtype_name
        config.update(special)
    else:  # before any weight is written: a model HF cannot express is refused first
        config = llama.hf_config_from_llama(cfg, model_type, torch_dtype, special)

    def get(name: str) -> torch.Tensor:
        return reader.full_tensor(name, "weight", cfg.vocab_size)

    writer = HFShardWriter(hf_dir, max_shard_bytes)
    for i in track(range(-1, cfg.num_layers), enabled=progress, unit=" unit",
                   desc=f"export {model_type}: embeddings + {cfg.num_layers} layers"):
        unit = family.export_globals(get, cfg) if i < 0 else family.export_layer(get, i, cfg)
        for name, tensor in unit.items():
            writer.add(name, tensor.to(torch_dtype))
    writer.close()
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
                  "do_sample": False}
    with open(os.path.join(hf_dir, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)
    return hf_dir
