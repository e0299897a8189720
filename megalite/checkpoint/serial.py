"""Checkpoints as plain serial models: load one for inference, write one from full weights."""
from __future__ import annotations

import os

import torch

from megalite.checkpoint.expert_bias import KIND as BIAS_KIND
from megalite.checkpoint.expert_bias import SUFFIX as BIAS_SUFFIX
from megalite.checkpoint.expert_bias import load_expert_biases
from megalite.checkpoint.names import global_pieces
from megalite.checkpoint.format import (FORMAT_VERSION, VOCAB_PARAMS, PieceReader, iteration_dir,
                                        resolve_checkpoint, write_json_atomic, write_rank_files)
from megalite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig


def model_config_from(saved: dict) -> ModelConfig:
    """The saved model, built from megalite's own layers: a checkpoint written with
    ``--transformer-impl transformer_engine`` holds the same tensors under the same names, so
    offline tools (serial load, reshard, export) need no transformer-engine or GPU."""
    cfg = ModelConfig(**{k: v for k, v in saved.items() if k in ModelConfig.__dataclass_fields__})
    cfg.transformer_impl, cfg.fp8_format = "local", None
    return cfg


def _checkpoint_dir(path: str) -> str:
    """``path`` is an iter_* directory, or a --save root whose 'latest' names one."""
    return resolve_checkpoint(path)


def load_serial_model(path: str, dtype: torch.dtype = torch.float32):
    """A single-process GPTModel with the checkpoint's weights (and routers' expert biases), in eval mode:
    ``model(tokens[b, s])`` returns logits ``[b, s, vocab]``."""
    from megalite.model.gpt import GPTModel

    reader = PieceReader(_checkpoint_dir(path))
    cfg = model_config_from(reader.metadata["config"]["model"])
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    model = GPTModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in VOCAB_PARAMS:
                full = reader.full_tensor(name, "weight", cfg.vocab_size)
                p.zero_()
                p[: full.shape[0]] = full
                continue
            for global_name, start, numel, _ in global_pieces(name, p):  # experts: one tensor each
                p.view(-1)[start: start + numel] = reader.full_tensor(global_name, "weight").reshape(-1)
        load_expert_biases(model, {n: reader.full_tensor(n, BIAS_KIND) for n in reader.names(BIAS_KIND)})
    return model.to(dtype).eval()


def save_weights_checkpoint(root: str, model, iteration: int = 0, source: dict | None = None) -> str:
    """A weights-only checkpoint (no optimizer state) of a serial model, e.g. imported
    from Hugging Face; it loads under any layout (the optimizer starts fresh)."""
    return write_weights_checkpoint(root, model.cfg, [dict(model.named_parameters())], iteration, source)


def write_weights_checkpoint(root: str, cfg: ModelConfig, units, iteration: int = 0,
                             source: dict | None = None) -> str:
    """A weights-only checkpoint from full tensors given in units (an iterable of
    ``{global name: tensor}``), one file per unit, so a converter holds one unit (a layer, the
    embeddings) at a time; a router's expert bias (``...router.expert_bias``) is written as its own
    kind, :mod:`megalite.checkpoint.expert_bias`. ``source``: provenance kept in metadata.json (e.g. the Hugging Face
    model type and dtype, for the way back)."""
    final = iteration_dir(root, iteration)
    os.makedirs(final, exist_ok=True)
    files = []
    for k, unit in enumerate(units):
        tensors, pieces = {}, []
        for name, tensor in unit.items():
            value = tensor.detach().float()
            if name in VOCAB_PARAMS:
                value = value[: cfg.vocab_size]
            kind = BIAS_KIND if name.endswith(BIAS_SUFFIX) else "weight"
            key = f"{kind}/{name}/tp0/0"
            tensors[key] = value.reshape(-1)
            pieces.append({"key": key, "name": name, "kind": kind, "tp_rank": 0, "tp_size": 1, "split": None,
                           "local_shape": list(value.shape), "range": [0, value.numel()]})
        write_rank_files(final, k, tensors, pieces)
        files.append(f"rank{k:05d}.safetensors")
    config = Config(cfg, ParallelConfig(), TrainConfig(), DataConfig(mock_data=True))
    write_json_atomic(os.path.join(final, "metadata.json"), {
        "format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": 0,
        "config": config.to_dict(), "layout": {"tp": 1, "cp": 1, "dp": 1, "pp": 1}, "zero_stage": 0,
        "optimizer_step": 0, "loss_scaler": None, "files": files, "weights_only": True, "source": source or {}})
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(str(iteration))
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    return final
