"""Which compute backends can run here, found without importing the optional ones.

- ``triton``: our kernels (``megalite.kernels``); need the ``triton`` package and either a
  CUDA GPU or ``TRITON_INTERPRET=1`` (the CPU interpreter, for tests: slow, exact).
- ``flash``: Tri Dao's flash-attn (``flash_attn_func``); needs the package and a CUDA GPU.
- ``te``: NVIDIA transformer-engine layers; need the package and a CUDA GPU.

Each ``*_missing()`` returns None when the backend can run, else a sentence naming what is
missing and how to get it. ``importlib.util.find_spec`` looks for a package without
importing it, so asking whether flash-attn or transformer-engine exist imports neither.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch


@functools.lru_cache(maxsize=None)  # asked on every attention call: look the package up once
def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    return torch.cuda.is_available()


def triton_missing(device_type: str | None = None) -> str | None:
    """Why the Triton kernels cannot run on ``device_type`` ('cuda', 'cpu'; None: this machine)."""
    if not _installed("triton"):
        return "the triton package is not installed (pip install triton; it comes with megalite)"
    on_gpu = cuda_available() if device_type is None else device_type == "cuda"
    if on_gpu:
        return None
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return ("there is no CUDA GPU, and Triton runs on a CPU only in its interpreter: set "
                "TRITON_INTERPRET=1 in the environment before starting (slow; meant for tests)")
    kernels = sys.modules.get("megalite.kernels._utils")
    if kernels is not None and not kernels.INTERPRET:
        return ("megalite.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels "
                "were compiled for a GPU; set the variable before anything imports them")
    return None


def flash_missing(device_type: str | None = None) -> str | None:
    """Why flash-attn cannot run (None when it can)."""
    if not _installed("flash_attn"):
        return ("flash-attn is not installed; it needs a CUDA GPU and builds from source: "
                "pip install megalite[flash]")
    on_gpu = cuda_available() if device_type is None else device_type == "cuda"
    if not on_gpu:
        return "flash-attn runs only on a CUDA GPU and there is none here"
    return None


def te_missing() -> str | None:
    """Why transformer-engine layers cannot run (None when they can)."""
    if not _installed("transformer_engine"):
        return ("transformer-engine is not installed; it needs a CUDA GPU with cuDNN: "
                "pip install megalite[te]")
    if not cuda_available():
        return "transformer-engine runs only on a CUDA GPU and there is none here"
    return None
