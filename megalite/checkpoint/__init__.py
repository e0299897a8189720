"""Sharded, atomic, layout-agnostic checkpoints (format: megalite.checkpoint.format)."""
from megalite.checkpoint.core import check_config, load_checkpoint, save_checkpoint
from megalite.checkpoint.format import CheckpointError, PieceReader, read_latest
from megalite.checkpoint.serial import load_serial_model, save_weights_checkpoint

__all__ = ["CheckpointError", "PieceReader", "check_config", "load_checkpoint", "load_serial_model",
           "read_latest", "save_checkpoint", "save_weights_checkpoint"]
