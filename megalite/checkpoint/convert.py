"""Hugging Face <-> megalite checkpoints, streamed one unit (embeddings, a layer) at a time.

Import reads ``config.json`` for the architecture (GPT-2, Llama, Qwen2/3, Mixtral, Qwen3-MoE,
DeepSeek-V3), then the tensors of one unit at a time from the (sharded) safetensors, maps them to
megalite's names and layout (:mod:`megalite.checkpoint.hf` for GPT-2,
:mod:`megalite.checkpoint.hf_llama` for Llama, Qwen2/3, Mixtral and Qwen3-MoE,
:mod:`megalite.checkpoint.hf_deepseek` for DeepSeek-V3, :mod:`megalite.checkpoint.hf_deepseek_mtp` for its
multi-token-prediction layers, which follow the model's) and writes that unit as one file of a
weights-only megalite checkpoint, which loads under any layout. Export assembles each unit's full tensors from any megalite
checkpoint (whatever layout wrote it), maps them back and writes safetensors shards with
their index, ``config.json`` and ``generation_config.json``, in the dtype of the original
(or the training dtype). Memory: one unit, never the whole model.

Special tokens and tokenizer: the import records bos/eos/pad token ids (config.json, else
generation_config.json) and its folder in metadata.json's ``source``, and *copies* the tokenizer
files and generation_config.json it finds beside the weights into the checkpoint (folder
``huggingface/``; :mod:`megalite.checkpoint.settings` carries both through every later save,
``--finetune`` or resume). The export writes them back: the ids into config.json, the original
generation_config.json (its bos/eos/pad filled in where missing), the tokenizer files. A
checkpoint that carries no tokenizer gets one line saying which files to copy. The export
refuses a non-empty folder unless ``force``, and the folder it was imported from always.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch

from functools import partial

from megalite.checkpoint import hf as gpt2
from megalite.checkpoint import hf_deepseek as deepseek
from megalite.checkpoint import hf_deepseek_mtp as deepseek_mtp
from megalite.checkpoint import hf_llama as llama
from megalite.checkpoint.expert_bias import KIND as BIAS_KIND
from megalite.checkpoint.expert_bias import SUFFIX as BIAS_SUFFIX
from megalite.checkpoint.dcp_offline import DcpReader, is_dcp_checkpoint
from megalite.checkpoint.format import CheckpointError, PieceReader
from megalite.checkpoint.hf_io import HFReader, HFShardWriter, check_export_target
from megalite.checkpoint.settings import CARRIED, GENERATION_CONFIG, read_files, write_files
from megalite.checkpoint.serial import _checkpoint_dir, model_config_from, write_weights_checkpoint
from megalite.config_types import mtp_depths
from megalite.data.tokenizer import build_tokenizer
from megalite.observe.progress import track

GPT2 = SimpleNamespace(import_globals=gpt2.import_globals, import_layer=gpt2.import_layer,
                       export_globals=gpt2.export_globals, export_layer=gpt2.export_layer,
                       import_mtp_layer=None, export_mtp_layer=None)
LLAMA = SimpleNamespace(import_globals=llama.import_globals, import_layer=llama.import_layer,
                        export_globals=llama.export_globals, export_layer=llama.export_layer,
                        import_mtp_layer=None, export_mtp_layer=None)
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def _deepseek(interleaved: bool) -> SimpleNamespace:
    """DeepSeek-V3's unit functions for a checkpoint whose RoPE rows are (or are to be) interleaved."""
    return SimpleNamespace(import_globals=deepseek.import_globals, export_globals=deepseek.export_globals,
                           import_layer=partial(deepseek.import_layer, interleaved=interleaved),
                           export_layer=partial(deepseek.export_layer, interleaved=interleaved),
                           import_mtp_layer=partial(deepseek_mtp.import_mtp_layer, interleaved=interleaved),
                           export_mtp_layer=partial(deepseek_mtp.export_mtp_layer, interleaved=interleaved))


def _family(model_type: str | None, interleaved: bool = True):
    if model_type in (None, "gpt2"):
        return GPT2
    if model_type in llama.ARCHITECTURES:
        return LLAMA
    if model_type == deepseek.MODEL_TYPE:
        return _deepseek(interleaved)
    raise llama.UnsupportedModel(f"config.json model_type {model_type!r} is not supported: megalite converts "
                                 f"gpt2, {', '.join(llama.ARCHITECTURES)}, {deepseek.MODEL_TYPE}.")


def import_hf(hf_dir: str, save: str, seq_length: int | None = None, progress: bool = True) -> str:
    """Write ``hf_dir``'s model as a weights-only megalite checkpoint under ``save``. ``progress``: a
    bar of the units converted on stderr, when stderr is a terminal."""
    reader = HFReader(hf_dir)
    hf = reader.config
    model_type = hf.get("model_type", "gpt2")
    interleaved = bool(hf.get("rope_interleave", True))
    family = _family(model_type, interleaved)
    if family is GPT2:
        cfg = gpt2.model_config_from_hf(hf)
    elif family is LLAMA:
        cfg = llama.model_config_from_hf_llama(hf, seq_length)
    else:
        cfg = deepseek.model_config_from_hf(hf, seq_length, reader.weight_map)

    def get(name: str) -> torch.Tensor:  # GPT2Model (no LM head) saves names without "transformer."
        return reader.get(name if reader.has(name) else name.removeprefix("transformer."))

    if model_type == deepseek.MODEL_TYPE:  # multi-token prediction: checked before anything is written
        deepseek_mtp.check_mtp(get, reader.has, cfg)
        note = deepseek_mtp.absent_mtp_note(hf, cfg)
        if note:
            print(note, file=sys.stderr)
    depths = mtp_depths(cfg)

    def units():  # one at a time: the embeddings and head, then each layer, then each MTP depth
        yield family.import_globals(get, cfg)
        for i in range(cfg.num_layers):
            yield family.import_layer(get, i, cfg)
        for k in range(depths):
            yield family.import_mtp_layer(get, k, cfg)

    files = read_files(hf_dir)  # tokenizer and generation config: copied into the checkpoint
    generation = json.loads(files.get(GENERATION_CONFIG, b"{}"))
    source = {"format": "huggingface", "model_type": model_type, "hf_dir": os.path.abspath(hf_dir),
              "torch_dtype": str(reader.dtype()).removeprefix("torch."),
              **{k: generation[k] for k in SPECIAL if generation.get(k) is not None},
              **{k: hf[k] for k in SPECIAL if hf.get(k) is not None},
              **({"rope_interleave": interleaved} if model_type == deepseek.MODEL_TYPE else {})}
    bar = track(units(), total=cfg.num_layers + 1 + depths, enabled=progress, unit=" unit",
                desc=f"import {model_type}: embeddings + {cfg.num_layers} layers" + _mtp_desc(depths))
    final = write_weights_checkpoint(save, cfg, bar, source=source)
    write_files(os.path.join(final, CARRIED), files)  # none found: the export says what to copy
    return final


def export_hf(load: str, hf_dir: str, model_type: str | None = None, dtype: str | None = None,
              max_shard_bytes: int = 5 * 2**30, progress: bool = True, force: bool = False) -> str:
    """Write any megalite checkpoint of a GPT-2, Llama-family or DeepSeek-V3 model as a Hugging Face model,
    with the special tokens, generation config and tokenizer files it carries. ``progress``: a
    bar of the units converted on stderr, when stderr is a terminal. ``force``: write into a
    non-empty folder (never the one the checkpoint was imported from)."""
    directory = _checkpoint_dir(load)
    reader = DcpReader(directory) if is_dcp_checkpoint(directory) else PieceReader(directory)
    meta = reader.metadata
    cfg = model_config_from(meta["config"]["model"])
    source = meta.get("source") or {}
    train = meta["config"].get("train", {})
    if cfg.position_embedding_type == "learned_absolute":
        model_type = model_type or "gpt2"
    else:
        model_type = model_type or source.get("model_type") or (
            deepseek.MODEL_TYPE if cfg.multi_latent_attention else "mixtral" if cfg.num_experts else
            "qwen2" if cfg.add_qkv_bias else "llama")
    interleaved = bool(source.get("rope_interleave", True))
    family = _family(model_type, interleaved)
    dtype_name = dtype or source.get("torch_dtype") or ("bfloat16" if train.get("bf16") else
                                                        "float16" if train.get("fp16") else "float32")
    torch_dtype = getattr(torch, dtype_name)
    files = read_files(os.path.join(directory, CARRIED))
    special = {k: source[k] for k in SPECIAL if k in source} or _special_from_tokenizer(files)
    if family is GPT2:
        if cfg.num_experts:
            raise CheckpointError(f"{load}: a GPT-2-style mixture-of-experts checkpoint ({cfg.num_experts} "
                                  f"experts); Hugging Face has no such architecture (an MoE model exports as "
                                  f"Mixtral: rope, RMSNorm, SwiGLU). Fix: load it with megalite (tools/generate.py, "
                                  f"--load), or train the Llama shape to export it.")
        config = gpt2.hf_config_from(cfg)
        config["torch_dtype"] = dtype_name
        config.update(special)
    elif family is LLAMA:  # before any weight is written: a model HF cannot express is refused first
        config = llama.hf_config_from_llama(cfg, model_type, torch_dtype, special)
    else:
        config = deepseek.hf_config_from(cfg, torch_dtype, special, interleaved)
    biases = set(reader.names(BIAS_KIND))

    def get(name: str) -> torch.Tensor:
        if name.endswith(BIAS_SUFFIX):  # a router's expert bias: its own kind; zeros if trained without
            return reader.full_tensor(name, BIAS_KIND) if name in biases else torch.zeros(cfg.num_experts)
        return reader.full_tensor(name, "weight", cfg.vocab_size)

    check_export_target(hf_dir, force, source.get("hf_dir"))
    writer = HFShardWriter(hf_dir, max_shard_bytes)
    depths = mtp_depths(cfg)
    for i in track(range(-1, cfg.num_layers + depths), enabled=progress, unit=" unit",
                   desc=f"export {model_type}: embeddings + {cfg.num_layers} layers" + _mtp_desc(depths)):
        for name, tensor in _export_unit(family, get, cfg, i).items():
            keep = name.endswith(deepseek.KEEP_FP32)  # fp32 in HF's model too
            writer.add(name, tensor.float() if keep else tensor.to(torch_dtype))
    writer.close()
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    generation = json.loads(files.pop(GENERATION_CONFIG, b"{}")) or {"do_sample": False}
    for k in SPECIAL:  # the source's own file first; the ids of config.json where it has none
        if generation.get(k) is None and config.get(k) is not None:
            generation[k] = config[k]
    with open(os.path.join(hf_dir, GENERATION_CONFIG), "w") as f:
        json.dump(generation, f, indent=2)
    write_files(hf_dir, files)
    if not files:
        print(f"note: {load} carries no tokenizer: copy tokenizer.json, tokenizer_config.json and "
              f"special_tokens_map.json (or tokenizer.model) of the model's tokenizer into {hf_dir}", file=sys.stderr)
    return hf_dir


def _export_unit(family, get, cfg, i: int) -> dict:
    """Unit i of the export: -1 the embeddings and head, then the layers, then the MTP depths."""
    if i < 0:
        return family.export_globals(get, cfg)
    if i < cfg.num_layers:
        return family.export_layer(get, i, cfg)
    return family.export_mtp_layer(get, i - cfg.num_layers, cfg)


def _mtp_desc(depths: int) -> str:
    return f" + {depths} MTP layer{'s' * (depths > 1)}" if depths else ""


def _special_from_tokenizer(files: dict[str, bytes]) -> dict:
    """bos/eos ids of carried tokenizer files (a checkpoint trained with a HuggingFaceTokenizer
    folder and never imported); none without them or without the tokenizers package."""
    if "tokenizer.json" not in files:
        return {}
    with tempfile.TemporaryDirectory() as folder:
        write_files(folder, files)
        try:
            tok = build_tokenizer("HuggingFaceTokenizer", folder)
        except (ImportError, ValueError):
            return {}
    eos = tok.eos_ids[0] if len(tok.eos_ids) == 1 else tok.eos_ids or None
    return {k: v for k, v in (("bos_token_id", tok.bos), ("eos_token_id", eos)) if v is not None}
