"""Sharded, atomic, layout-agnostic checkpoints (format: megalite.checkpoint.format).

Two on-disk formats share one directory layout (``iter_N``, ``latest``, metadata.json):
megalite's own (safetensors pieces, :mod:`megalite.checkpoint.core`) and ``torch_dcp``
(torch.distributed.checkpoint, :mod:`megalite.checkpoint.dcp`). :func:`load_checkpoint` and
:func:`load_serial_model` read either, by what the directory's metadata.json says. The DCP
modules import torch.distributed.checkpoint (about 0.7 s) only when a DCP checkpoint is used.
"""
from megalite.checkpoint.core import check_config, save_checkpoint
from megalite.checkpoint.core import load_checkpoint as _load_megalite
from megalite.checkpoint.format import CheckpointError, PieceReader, read_latest, resolve_checkpoint
from megalite.checkpoint.serial import load_serial_model as _load_serial_megalite
from megalite.checkpoint.serial import save_weights_checkpoint

from megalite.run_settings import CKPT_FORMATS  # the flag's choices, defined with the setting


def is_dcp_checkpoint(directory: str) -> bool:
    from megalite.checkpoint.dcp_offline import is_dcp_checkpoint as check

    return check(directory)


def load_checkpoint(root: str, optimizer, scaler, config, grid, load_optimizer: bool = True,
                    load_rng: bool = True, iteration: int | None = None, finetune: bool = False) -> dict:
    """Fill the optimizer (and the model) from a checkpoint of either format, resharded for
    this rank's layout; return its metadata (see :func:`megalite.checkpoint.core.load_checkpoint`)."""
    directory = resolve_checkpoint(root, iteration)
    if is_dcp_checkpoint(directory):
        from megalite.checkpoint.dcp import load_dcp_checkpoint as load
    else:
        load = _load_megalite
    return load(directory, optimizer, scaler, config, grid, load_optimizer=load_optimizer, load_rng=load_rng,
                finetune=finetune)


def load_serial_model(path: str, dtype=None):
    """A single-process GPTModel with a checkpoint's weights (either format), in eval mode."""
    import torch

    directory = resolve_checkpoint(path)
    if is_dcp_checkpoint(directory):
        from megalite.checkpoint.dcp_offline import load_dcp_serial_model as load
    else:
        load = _load_serial_megalite
    return load(directory, dtype or torch.float32)


def save_dcp_checkpoint(*args, **kwargs) -> str:
    """:func:`megalite.checkpoint.dcp.save_dcp_checkpoint` (save_checkpoint's arguments)."""
    from megalite.checkpoint.dcp import save_dcp_checkpoint as save

    return save(*args, **kwargs)


def __getattr__(name):
    if name == "AsyncDcpSaver":
        from megalite.checkpoint.dcp_async import AsyncDcpSaver

        return AsyncDcpSaver
    raise AttributeError(f"module 'megalite.checkpoint' has no attribute {name!r}")


__all__ = ["CKPT_FORMATS", "AsyncDcpSaver", "CheckpointError", "PieceReader", "check_config", "is_dcp_checkpoint",
           "load_checkpoint", "load_serial_model", "read_latest", "save_checkpoint", "save_dcp_checkpoint",
           "save_weights_checkpoint"]
