"""Helpers shared by the kernels: interpreter detection, device and dtype checks, tuning.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` decorator runs (that is,
before the kernel modules are imported); it then runs every kernel in a numpy
interpreter on the CPU, program after program. ``INTERPRET`` records what was set at
import time, which is what decides how the kernels here were compiled.

``MEGALITE_KERNEL_TUNING`` (read at import, ``TUNING``): ``autotune`` (default) gives every
autotuned kernel its whole config list, pruned by the GPU's shared memory and timed by
``triton.autotune`` on the first launch of each key; ``fixed`` gives it ONE config per device
kind, the first of its list whose shared-memory estimate fits the GPU (``fixed_config``):
one compiled variant per kernel and constexpr set, no timing (a GPU test run; a benchmark
keeps ``autotune``).

Launch limits: CUDA caps grid axes 1 and 2 at 65,535 programs and axis 0 at 2^31 - 1. The
attention kernels take their (batch, head) index from axes 1 and 2 (``split_grid``: b * heads
past MAX_GRID_Y continues on axis 2); the others put what grows on axis 0; every launcher
checks its grid (``check_grid``). Offsets inside a kernel are int32 unless cast: a tile's relative
offsets ``rows * stride`` stay int32 only while ``MAX_TILE * stride`` fits (``seq_strided``).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Callable

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
TUNING = os.environ.get("MEGALITE_KERNEL_TUNING", "autotune")
if TUNING not in ("autotune", "fixed"):
    raise ValueError(f"MEGALITE_KERNEL_TUNING={TUNING!r}: expected 'autotune' (time every config, the "
                     f"default) or 'fixed' (one config per kernel). Fix: set one of them or unset it.")

GRID_LIMITS = (2**31 - 1, 65535, 65535)  # CUDA's grid size per axis (x, y, z)
MAX_GRID_Y = 65535  # programs per grid axis 1 before a count spills onto axis 2 (tests lower it)
INT32_MAX = 2**31 - 1
MAX_TILE = 128  # the most rows (BLOCK_M / BLOCK_N) of any attention tile (tests check the configs)

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
    """Shapes q (b, heads, s_q, d), k (b, groups, s_k, d), v (b, groups, s_k, d_v), heads % groups
    == 0, d and d_v <= MAX_HEAD_DIM (d_v, the value head size, may differ from d)."""
    check_tensors("flash_attention", q, k, v)
    check_float("flash_attention", q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"flash_attention: expected q (b, heads, s_q, d), k (b, groups, s_k, d) and "
                         f"v (b, groups, s_k, d_v), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"flash_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch "
                         f"and head dim, and query heads must be a multiple of key/value heads.")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if max(q.shape[3], v.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head dim {max(q.shape[3], v.shape[3])} is above {MAX_HEAD_DIM}, "
                         f"the largest this kernel supports. Fix: use the torch or flash attention backend.")


def check_backward_shapes(what: str, q, out, dout, lse, delta, v_dim: int | None = None) -> None:
    """An attention backward's inputs: dout (and out, unless delta is given) of shape (b, heads,
    s_q, d_v), q's first three sizes and the value head size ``v_dim`` (default q's d); lse of
    q's (b, heads, s_q)."""
    shape = tuple(q.shape[:3]) + (q.shape[3] if v_dim is None else v_dim,)
    if tuple(dout.shape) != shape or lse.shape != q.shape[:3] or (delta is None and tuple(out.shape) != shape):
        raise ValueError(f"{what}: out and dout must have the shape {shape} (q's b, heads, s_q and v's "
                         f"head size) and lse {tuple(q.shape[:3])}, got dout {tuple(dout.shape)}, "
                         f"lse {tuple(lse.shape)}.")


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


def seq_strided(t: torch.Tensor) -> torch.Tensor:
    """A (b, heads, s, d) attention input as the kernels read it: ``t`` itself when its last
    stride is 1 and a tile's relative offsets ``i * stride_s + j`` (i < MAX_TILE, j < d), which
    the kernels keep in int32 registers, cannot pass 2^31 - 1; else a contiguous copy (stride_s
    = d). A view of a huge fused tensor (stride_s of millions of elements) is the rare case."""
    t = unit_last_stride(t)
    if t.dim() == 4 and (MAX_TILE - 1) * abs(t.stride(2)) + t.shape[3] > INT32_MAX:
        return t.contiguous()
    return t


def split_grid(what: str, tiles: int, n: int) -> tuple:
    """The grid (tiles, y, z) of ``tiles`` programs for each of ``n`` (batch, head) pairs, the pair
    ``p = program_id(1) + program_id(2) * MAX_GRID_Y`` (kernels return at once for p >= n): the
    old (tiles, n) grid while n <= MAX_GRID_Y (z = 1), and within CUDA's limits past it. Program
    ids, unlike values computed from them, cost the kernel no register (a one-axis grid with
    p = pid // tiles added register spills to compiled configs at the 255-register limit)."""
    y = max(1, min(n, MAX_GRID_Y))
    return check_grid(what, (tiles, y, -(-n // y)))


def check_grid(what: str, grid: tuple) -> tuple:
    """``grid`` itself when every axis is within CUDA's limits (GRID_LIMITS), else a ValueError
    naming the sizes: a launch past them fails on the GPU with an opaque 'invalid argument'."""
    for axis, (n, limit) in enumerate(zip(grid, GRID_LIMITS)):
        if n > limit:
            raise ValueError(f"{what}: grid {tuple(grid)} has {n} programs on axis {axis}, above CUDA's "
                             f"{limit}. Fix: split the call (fewer rows or batch * heads per launch).")
    return grid


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


def device_shared_limit(t) -> int | None:
    """The shared-memory limit of the GPU holding tensor ``t``; None when it is not on a GPU."""
    if not getattr(t, "is_cuda", False):
        return None
    return shared_memory_limit(t.device.index if t.device.index is not None else torch.cuda.current_device())


def shared_memory_pruner(tensor_arg: str, shared_bytes: Callable, width_arg: str | None = "BLOCK_D") -> Callable:
    """An ``early_config_prune`` for ``triton.autotune``: keep the configs that fit the shared
    memory of the GPU holding argument ``tensor_arg``, by the estimate
    ``shared_bytes(config, args[width_arg], element_size)`` (``width_arg`` a constexpr of the
    launch), or ``shared_bytes(config, element_size)`` when ``width_arg`` is None.

    Triton calls it as ``prune(configs, nargs, **kwargs)``: ``configs`` a list, ``nargs`` a
    dict of the positional arguments by name, ``kwargs`` the keyword arguments (constexprs,
    and ``grid``, ``warmup``). Both are unhashable, so nothing here may be ``lru_cache``d
    (the limit is cached per device by ``shared_memory_limit``)."""
    def prune(configs, nargs, **kwargs):
        args = {**nargs, **kwargs}
        t = args[tensor_arg]
        limit = device_shared_limit(t)
        if limit is None:
            return list(configs)
        if width_arg is None:
            return fit_shared(list(configs), limit, lambda c: shared_bytes(c, t.element_size()))
        return fit_shared(list(configs), limit, lambda c: shared_bytes(c, args[width_arg], t.element_size()))

    return prune


def fixed_limit() -> int | None:
    """What ``MEGALITE_KERNEL_TUNING=fixed`` selects by: the shared-memory limit of the current
    GPU (a launcher runs with its tensors' GPU current, ``on_input_device``); None when tuning
    is ``autotune``, under the interpreter or without a GPU (then the first config)."""
    if TUNING != "fixed" or INTERPRET or not torch.cuda.is_available():
        return None
    return shared_memory_limit(torch.cuda.current_device())


def fixed_config(configs: list, limit: int | None, nbytes: Callable):
    """The one config of the fixed setting: the first of ``configs`` whose estimate
    ``nbytes(config)`` fits ``limit`` (the smallest if none does; the first when limit is None)."""
    return configs[0] if limit is None else fit_shared(configs, limit, nbytes)[0]


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


def interpreter_bench(kernel_call: Callable, quantiles=None, **kwargs):
    """The autotuner's timing under the interpreter: the wall time of one call, in ms (per
    quantile asked). Triton's default benchmarker asks the active GPU driver, and the
    interpreter has none ('0 active drivers'): without this, autotuning over two or more
    configs fails on the CPU."""
    start = time.perf_counter()
    kernel_call()
    ms = (time.perf_counter() - start) * 1e3
    return [ms] * len(quantiles) if quantiles else ms


def autotune(configs, key, prune, nbytes: Callable | None = None, limit: int | None = None):
    """``triton.autotune`` over ``configs`` keyed on ``key`` and pruned by ``prune``, or, under
    ``MEGALITE_KERNEL_TUNING=fixed``, over the single ``fixed_config(configs, limit, nbytes)``
    (the autotuner then neither prunes nor times: it launches it).

    The choice is kept on disk where this Triton can (``cache_results``, Triton >= 3.2): the
    timing picks the fastest config, and a config changes the order of the sums, so without it
    a restarted process (a resumed run) could pick another and not repeat the uninterrupted
    run bit for bit. The cache is keyed by the kernel, the key values and the configs (Triton's
    cache directory, ``TRITON_CACHE_DIR``; Triton itself turns it off under the interpreter).
    Under the interpreter the timing is ``interpreter_bench``."""
    import inspect

    import triton

    if TUNING == "fixed":
        configs = [fixed_config(list(configs), limit, nbytes or (lambda c: 0))]
    params = inspect.signature(triton.autotune).parameters
    extra = {"cache_results": True} if "cache_results" in params else {}
    if INTERPRET and "do_bench" in params:
        extra["do_bench"] = interpreter_bench
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune}, **extra)


def document_starts(doc_start: torch.Tensor | None, offset: int, like: torch.Tensor) -> torch.Tensor:
    """Packed documents as the attention kernels read them: absolute positions moved into this
    call's numbering (``doc_start - k_offset``: each query's first key index; ``doc_end -
    q_offset``: each key's first query index that no longer sees it), int32, contiguous.
    Without documents a 1-element stand-in (the kernels never read it then; empty: no launch)."""
    if doc_start is None:
        return torch.empty(1, dtype=torch.int32, device=like.device)
    return (doc_start.to(device=like.device, dtype=torch.int32) - int(offset)).contiguous()


def tile_counter(like: torch.Tensor, count: torch.Tensor | None) -> torch.Tensor:
    """The int32 counter a COUNT kernel adds one to per key (or query) tile it computes; without
    counting an untouched 1-element stand-in."""
    return count if count is not None else torch.empty(1, dtype=torch.int32, device=like.device)
