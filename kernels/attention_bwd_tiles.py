"""The flash-attention backward's tile configurations and shared-memory estimates (the
kernels and launchers are in ``flash_attention_bwd.py``, which re-exports these names).

Each autotuned kernel (dk/dv, dq, delta) has a few (BLOCK_M, BLOCK_N, num_warps, num_stages)
configs per dtype class and tile width; the estimates prune them by a GPU's shared memory
(tools/compile_kernels.py checks they are never below the compiled figures). With a value head
size d_v of its own, the list is the wider head size's and the estimates count the q/k tiles at
``width`` and the v/do tiles at ``v_width``.
"""
from __future__ import annotations

import torch
import triton

from megalite.kernels._utils import INTERPRET, INTERPRET_TILES, block_d, config_width, tile_config


# -- configurations ------------------------------------------------------------------------------
#
# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) per tile width (64: d <= 64; 128: d = 96,
# 128; 256: d up to 256) and dtype class, as for the forward. dk/dv programs hold a (BLOCK_N,
# width) pair of fp32 accumulators and stream query tiles: few queries, many keys; dq programs
# the mirror image. Chosen (tools/compile_kernels.py) to compile on sm_80 and sm_90 without
# register spills; 8 warps for the wide accumulators; fp32 (FMA, every operand in registers)
# small tiles. Each 16-bit list has a config of <= 99 KB (sm_86/sm_89) by the estimate.

_DKDV_16BIT = {
    64: ((32, 128, 8, 3), (64, 128, 8, 3), (16, 128, 8, 3), (32, 64, 4, 3), (64, 64, 8, 2)),
    128: ((32, 64, 8, 3), (16, 128, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2), (64, 32, 8, 3)),
    256: ((16, 32, 8, 2), (16, 32, 8, 3), (32, 32, 8, 2), (32, 32, 8, 3), (64, 32, 8, 2)),
}
_DKDV_FP32 = {
    64: ((32, 32, 8, 2), (16, 64, 8, 2), (32, 16, 8, 2)),
    128: ((16, 32, 8, 2), (32, 16, 8, 2), (16, 64, 8, 2)),
    256: ((16, 16, 8, 1), (16, 32, 8, 1), (16, 32, 8, 2)),
}
_DQ_16BIT = {
    64: ((128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3)),
    128: ((128, 32, 8, 3), (128, 64, 8, 2), (128, 16, 8, 3), (64, 64, 8, 3), (64, 32, 4, 3)),
    256: ((64, 32, 8, 2), (64, 16, 8, 3), (32, 64, 8, 2), (32, 16, 4, 2)),
}
_DQ_FP32 = {
    64: ((64, 32, 8, 2), (32, 64, 8, 2), (64, 16, 8, 2)),
    128: ((32, 32, 8, 1), (64, 16, 8, 2), (32, 16, 8, 2), (16, 64, 8, 1)),
    256: ((32, 16, 8, 2), (16, 32, 8, 1), (32, 32, 8, 1), (16, 16, 8, 1)),
}
# delta: BLOCK_M rows of BLOCK_D (memory bound; ~4K-16K elements per program)
_DELTA_ROWS = ((4096, 4), (8192, 4), (16384, 8))


def _configs(tables, head_dim: int, dtype: torch.dtype, interpret: bool) -> list[triton.Config]:
    if interpret:
        return [tile_config(*INTERPRET_TILES)]
    return [tile_config(*t) for t in tables[dtype == torch.float32][config_width(head_dim)]]


def dkdv_configs(head_dim: int, dtype: torch.dtype, interpret: bool = INTERPRET) -> list[triton.Config]:
    """The dk/dv kernel's autotuning configs (one small one under the interpreter). With a value
    head size of its own, callers pass the wider of the two (its tile width picks the list)."""
    return _configs((_DKDV_16BIT, _DKDV_FP32), head_dim, dtype, interpret)


def dq_configs(head_dim: int, dtype: torch.dtype, interpret: bool = INTERPRET) -> list[triton.Config]:
    """The dq kernel's autotuning configs (one small one under the interpreter; head size as
    for ``dkdv_configs``)."""
    return _configs((_DQ_16BIT, _DQ_FP32), head_dim, dtype, interpret)


def delta_configs(head_dim: int, dtype: torch.dtype = torch.float32,
                  interpret: bool = INTERPRET) -> list[triton.Config]:
    """The delta kernel's configs: BLOCK_M rows of 4K-16K elements (one config under the
    interpreter); the same for every dtype (loads are upcast)."""
    if interpret:
        return [triton.Config(dict(BLOCK_M=INTERPRET_TILES[0]), num_warps=1, num_stages=1)]
    width = block_d(head_dim)
    return [triton.Config(dict(BLOCK_M=max(16, n // width)), num_warps=w, num_stages=1)
            for n, w in _DELTA_ROWS]


def dkdv_shared_bytes(config: triton.Config, width: int, element_size: int, v_width: int | None = None) -> int:
    """Estimated shared memory of a dk/dv config: the k tile (``width``, q/k's tile width) and v
    tile (``v_width``, v's, default ``width``), ``max(2, num_stages)`` buffers of the streamed q
    and do tiles, and the p and ds tiles staged for their products (never below the compiled
    figure: tools/compile_kernels.py checks)."""
    bm, bn, v_width = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], v_width or width
    return (bn * (width + v_width) + max(2, config.num_stages) * bm * (width + v_width)
            + 2 * bm * bn) * element_size


def dq_shared_bytes(config: triton.Config, width: int, element_size: int, v_width: int | None = None) -> int:
    """Estimated shared memory of a dq config: the q tile (``width``) and do tile (``v_width``,
    default ``width``), ``max(2, num_stages)`` buffers of the streamed k and v tiles, and the p
    and ds tiles staged for their products."""
    bm, bn, v_width = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], v_width or width
    return (bm * (width + v_width) + max(2, config.num_stages) * bn * (width + v_width)
            + 2 * bm * bn) * element_size


def delta_shared_bytes(config: triton.Config, width: int, element_size: int) -> int:
    """Estimated shared memory of a delta config: a cross-warp row reduction, one fp32 per row
    and warp (and nothing when a warp holds whole rows)."""
    return 4 * config.kwargs["BLOCK_M"] * config.num_warps
