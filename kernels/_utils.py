"""Helpers shared by the kernels: interpreter detection, device and dtype checks.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` decorator runs (that is,
before the kernel modules are imported); it then runs every kernel in a numpy
interpreter on the CPU, program after program. ``INTERPRET`` records what was set at
import time, which is what decides how the kernels here were compiled.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


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
    """Shapes q (b, heads, s_q, d), k = v (b, groups, s_k, d), heads % groups == 0, d <= MAX_HEAD_DIM."""
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


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has stride 1 (any other strides: the kernels take them),
    else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def seq_key(n: int) -> int:
    """A sequence length rounded up to a power of two (at least 16): an autotuning key, so
    lengths of one octave share a tuned config (>= 16 keeps one integer specialization)."""
    return max(16, next_power_of_2(n))


@functools.lru_cache(maxsize=None)
def shared_memory_limit(index: int) -> int:
    """Bytes of shared memory one block may use on CUDA device ``index`` (the opt-in maximum:
    227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86/sm_89)."""
    props = torch.cuda.get_device_properties(index)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if limit is None:
        import triton

        limit = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(limit)


def fit_shared(configs: list, limit: int, nbytes: Callable) -> list:
    """The configs whose estimated shared memory ``nbytes(config)`` is at most ``limit``; if
    none fits, the smallest one (the autotuner needs one, and its launch then says why)."""
    fit = [c for c in configs if nbytes(c) <= limit]
    return fit or [min(configs, key=nbytes)]


def shared_memory_pruner(tensor_arg: str, shared_bytes: Callable) -> Callable:
    """An ``early_config_prune`` for ``triton.autotune``: keep the configs that fit the shared
    memory of the GPU holding argument ``tensor_arg``, by the estimate
    ``shared_bytes(config, BLOCK_D, element_size)`` (BLOCK_D a constexpr of the launch)."""
    def prune(configs, nargs, **kwargs):
        args = {**nargs, **kwargs}
        t = args[tensor_arg]
        if not t.is_cuda:
            return configs
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return fit_shared(configs, shared_memory_limit(index),
                          lambda c: shared_bytes(c, args["BLOCK_D"], t.element_size()))

    return prune


INTERPRET_TILES = (32, 32, 1, 1)  # (BLOCK_M, BLOCK_N, warps, stages): the interpreter's one config


def block_d(head_dim: int) -> int:
    """An attention tile's width: the head dim rounded up to a power of two, at least 16."""
    return max(16, next_power_of_2(head_dim))


def config_width(head_dim: int) -> int:
    """The tile width whose config list serves this head dim: 64 (d <= 64), 128 or 256."""
    return max(64, block_d(head_dim))


def tile_config(block_m: int, block_n: int, num_warps: int, num_stages: int):
    """A ``triton.Config`` of an attention kernel's tiles."""
    import triton

    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n), num_warps=num_warps, num_stages=num_stages)


def explicit_config(configs: list, block_m=None, block_n=None, num_warps=None, num_stages=None):
    """The config of explicit tile arguments; the first of ``configs`` fills what is not given."""
    first = configs[0]
    bm, bn = check_blocks(block_m or first.kwargs["BLOCK_M"], block_n or first.kwargs["BLOCK_N"])
    return tile_config(bm, bn, num_warps or first.num_warps, num_stages or first.num_stages)


def launch_tiles(kernel, tuned, config, grid, *args, **consts):
    """Launch the autotuned ``tuned`` or, given an explicit ``config``, ``kernel`` with its tiles."""
    if config is None:
        return tuned[grid](*args, **consts)
    return kernel[grid](*args, **consts, **config.kwargs, num_warps=config.num_warps,
                        num_stages=config.num_stages)


def autotune(configs, key, prune):
    """``triton.autotune`` with the choice kept on disk where this Triton can (``cache_results``,
    Triton >= 3.2): the timing picks the fastest config, and a config changes the order of the
    sums, so without it a restarted process (a resumed run) could pick another and not repeat the
    uninterrupted run bit for bit. The cache is keyed by the kernel, the key values and the
    configs (Triton's cache directory, ``TRITON_CACHE_DIR``)."""
    import inspect

    import triton

    extra = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune}, **extra)
