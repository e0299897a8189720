"""A rank's checkpoint pieces as rectangular boxes of the global tensors (for torch DCP).

megalite's own format stores a piece as a flat range ``[a, z)`` of a rank's tensor-parallel
shard, flattened (see :mod:`megalite.checkpoint.format`). torch.distributed.checkpoint
(DCP) stores chunks: boxes ``offsets + [0, sizes)`` of the *global* tensor. The map:

1. A row-major flat range of a tensor of shape ``(n_0, ..., n_{k-1})`` is a union of at
   most ``2k - 1`` boxes, each "some leading indices fixed, a range on one dim, the trailing
   dims whole" (:func:`flat_boxes`). Such a box is contiguous in flat order, so its values
   are a slice of the piece, viewed with the box's sizes.
2. The TP shard of a tensor split on dim ``d`` into ``S`` sections (``[q; k; v]``:
   ``S = 3``) over ``T`` ranks holds, on rank ``r``, ``S`` blocks of ``c = L / S`` rows
   (``L``: the shard's size on ``d``): local index ``j = s c + w`` is global index
   ``s T c + r c + w``. A local box is cut at multiples of ``c`` along ``d``; each part is one
   global box (a strided view of the piece when ``d`` is a trailing dim).
3. The embedding and output layer are padded to a multiple of the TP size in the model;
   the global tensor has ``vocab_size`` rows, so boxes are clipped there: the stored
   shapes do not depend on the layout, and any layout reads any other.

Every value a rank owns lands in exactly one global box, and the owners cover each global
tensor exactly once (``core._owns``): DCP's own plan validation checks that at save.
"""
from __future__ import annotations

import math

import torch

from megalite.checkpoint.format import VOCAB_PARAMS


def flat_boxes(shape, a: int, z: int) -> list[tuple[int, list[int], list[int]]]:
    """``(flat start, offsets, sizes)`` of the boxes whose union is elements ``[a, z)`` of a
    row-major tensor of ``shape``, in flat order; each box is contiguous in flat order."""
    shape = list(shape)
    if not shape:
        return [(0, [], [])] if z > a else []
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    out: list[tuple[int, list[int], list[int]]] = []

    def rec(lo: int, hi: int, k: int, prefix: list[int], base: int) -> None:
        if lo >= hi:
            return
        s = strides[k]
        first, last = -(-lo // s), hi // s  # the whole rows [first, last)
        if first > last:  # inside one row: descend
            i = lo // s
            rec(lo - i * s, hi - i * s, k + 1, prefix + [i], base + i * s)
            return
        if lo < first * s:
            i = first - 1
            rec(lo - i * s, s, k + 1, prefix + [i], base + i * s)
        if first < last:
            tail = shape[k + 1:]
            out.append((base + first * s, prefix + [first] + [0] * len(tail),
                        [1] * len(prefix) + [last - first] + tail))
        if last * s < hi:
            rec(0, hi - last * s, k + 1, prefix + [last], base + last * s)

    rec(a, z, 0, [], 0)
    return out


def global_shape(name: str, local_shape, split, tp_size: int, vocab_size: int) -> list[int]:
    """The global tensor's shape (vocabulary rows unpadded) from one TP shard's shape."""
    shape = list(local_shape)
    if split is not None:
        shape[split[0]] *= tp_size
    if name in VOCAB_PARAMS:
        shape[0] = vocab_size
    return shape


def piece_boxes(name: str, local_shape, split, tp_rank: int, tp_size: int, a: int, z: int,
                vocab_size: int, values: torch.Tensor) -> list[tuple[list[int], torch.Tensor]]:
    """``(global offsets, view)`` of each global box of the piece ``values`` (elements
    ``[a, z)`` of this rank's TP shard of ``name``, flattened). The views alias ``values``:
    read them to save, copy into them to load."""
    out = []
    for start, offsets, sizes in flat_boxes(local_shape, a, z):
        box = values[start - a: start - a + math.prod(sizes)].view(sizes)
        parts = [(list(offsets), box)]
        if split is not None:
            dim, sections = split
            c = local_shape[dim] // sections
            parts = []
            u, end = offsets[dim], offsets[dim] + sizes[dim]
            while u < end:
                s = u // c
                v = min(end, (s + 1) * c)
                g = list(offsets)
                g[dim] = s * tp_size * c + tp_rank * c + (u - s * c)
                parts.append((g, box.narrow(dim, u - offsets[dim], v - u)))
                u = v
        for g, view in parts:
            if name in VOCAB_PARAMS:  # drop the padding rows
                keep = min(view.shape[0], vocab_size - g[0])
                if keep <= 0:
                    continue
                view = view.narrow(0, 0, keep)
            out.append((g, view))
    return out
