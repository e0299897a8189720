"""Helpers shared by the kernels: interpreter detection, device and dtype checks.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` decorator runs (that is,
before the kernel modules are imported); it then runs every kernel in a numpy
interpreter on the CPU, program after program. ``INTERPRET`` records what was set at
import time, which is what decides how the kernels here were compiled.
"""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensors(what: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device the kernels can run on, in one supported dtype."""
    first = tensors[0]
    for t in tensors:
        if t.device != first.device:
            raise ValueError(f"{what}: all inputs must be on one device, got {first.device} and "
                             f"{t.device}. Fix: move them to the same device.")
    if first.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            f"{what}: the Triton kernels need a CUDA tensor, got one on {first.device}, and "
            f"TRITON_INTERPRET=1 was not set when megalite.kernels was imported. Fix: run on a "
            f"GPU, or set TRITON_INTERPRET=1 before importing (CPU interpreter, for tests).")


def check_float(what: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{what}: dtype {t.dtype} is not supported; the kernels take float32, "
                            f"float16 or bfloat16. Fix: cast the input.")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
