"""Helpers shared by the kernels: interpreter detection, device and dtype checks.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` decorator runs (that is,
before the kernel modules are imported); it then runs every kernel in a numpy
interpreter on the CPU, program after program. ``INTERPRET`` records what was set at
import time, which is what decides how the kernels here were compiled.
"""
from __future__ import annotations

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128


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


def check_blocks(*blocks: int) -> tuple[int, ...]:
    for b in blocks:
        if b < 16 or b & (b - 1):
            raise ValueError(f"tile size {b} must be a power of two >= 16 (tl.dot needs 16 "
                             f"rows and columns at least). Fix: pass 16, 32, 64 or 128.")
    return blocks


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shapes q (b, heads, s_q, d), k = v (b, groups, s_k, d), heads % groups == 0, d <= 128."""
    check_tensors("flash_attention", q, k, v)
    check_float("flash_attention", q, k, v)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"flash_attention: expected q (b, heads, s_q, d) and k, v (b, groups, s_k, d), "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"flash_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch "
                         f"and head dim, and query heads must be a multiple of key/value heads.")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head dim {q.shape[3]} is above {MAX_HEAD_DIM}, the largest "
                         f"this kernel supports. Fix: use the torch or flash attention backend.")


def check_backward_shapes(what: str, q, out, dout, lse, delta) -> None:
    """An attention backward's inputs: dout (and out, unless delta is given) of q's shape, lse of
    q's (b, heads, s_q)."""
    if dout.shape != q.shape or lse.shape != q.shape[:3] or (delta is None and out.shape != q.shape):
        raise ValueError(f"{what}: out and dout must have q's shape {tuple(q.shape)} and lse "
                         f"{tuple(q.shape[:3])}, got dout {tuple(dout.shape)}, lse {tuple(lse.shape)}.")


def on_input_device(fn):
    """Run a kernel launcher with the GPU of its first tensor argument as the current device:
    Triton launches on the current device, which need not be the tensor's (one process that
    touches two GPUs, or a caller that never called ``torch.cuda.set_device``)."""
    @functools.wraps(fn)
    def launch(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.is_cuda and first.device.index != torch.cuda.current_device():
            with torch.cuda.device(first.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return launch
