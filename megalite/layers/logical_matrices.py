"""The matrices a fused weight holds: one table, by linear name, that the update rule which
works per matrix (Muon's Newton-Schulz, :func:`megalite.data_parallel.muon.logical_pieces`) cuts
tensors by and the planner (:meth:`megalite.layers.part_shape.LinearShape.logical_shapes`: Muon's
Gram all-reduces and Newton-Schulz FLOPs) counts by. A new fused linear is one entry of
:data:`FUSED_ROWS`.

A fused weight stacks its matrices along its rows, in a **block** that repeats: the block is a
tuple of row widths, width k belonging to matrix k; matrix k is its rows of every repeat, in order
(a view ``weight.view(repeats, sum(block), cols)[:, a:a + w_k]``). A weight not in the table, or a
fusion the config turns off, is one matrix: the block is ``(rows,)``. The entries take the rows
of the tensor at hand (the whole weight, a TP rank's rows, one stacked expert's), so one rule
serves every shape:

- ``qkv`` (:class:`megalite.model.attention.SelfAttention`): per KV group, its r = heads / groups
  query heads, its key head and its value head, d rows each: block (r d, d, d), repeated per
  group (g times whole, g / t on a TP rank, which holds whole groups); q, k and v are each
  gathered over the groups (Megatron's split QKV). ``split_qkv=False`` (``--muon-no-split-qkv``):
  one matrix.
- ``fc1`` (:class:`megalite.model.mlp.MLP`, an MoE layer's shared expert too) and ``w1`` (a stacked
  expert's, :mod:`megalite.moe.experts`) under SwiGLU: [gate; up], block (rows / 2, rows / 2),
  once (a TP rank holds its part of each half, ``TPSplit(0, 2)``).

MLA's up-projections (per head [q_n; q_r] and [k_n; v]) are one matrix each, as Megatron's Muon.
"""
from __future__ import annotations


def _qkv_block(m, rows: int, split_qkv: bool) -> tuple[int, ...]:
    """(r d, d, d) per KV group; one matrix unless split."""
    if not split_qkv:
        return (rows,)
    d = m.head_dim
    return (m.num_attention_heads // m.num_query_groups * d, d, d)


def _gate_up_block(m, rows: int, split_qkv: bool) -> tuple[int, ...]:
    """SwiGLU's [gate; up] halves; one matrix without SwiGLU."""
    return (rows // 2, rows // 2) if m.swiglu else (rows,)


FUSED_ROWS = {"qkv": _qkv_block, "fc1": _gate_up_block, "w1": _gate_up_block}


def linear_name(parameter_name: str) -> str:
    """The linear a parameter belongs to: ``layers.0.self_attention.qkv.weight`` -> ``qkv``;
    a stacked expert weight, ``...experts.w1`` -> ``w1``."""
    parts = parameter_name.split(".")
    return parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]


def row_block(linear: str, m, rows: int, split_qkv: bool = True) -> tuple[int, ...]:
    """The block of the ``rows`` rows of linear ``linear``'s weight (module docstring); ``(rows,)``
    for one matrix, or without a model config (``m`` None)."""
    rule = FUSED_ROWS.get(linear)
    if rule is None or m is None:
        return (rows,)
    block = rule(m, rows, split_qkv)
    if rows % sum(block):
        raise ValueError(f"{linear}: {rows} rows are not a whole number of its blocks {block}. Fix: "
                         f"megalite.layers.logical_matrices.FUSED_ROWS[{linear!r}] must match the weight's row layout")
    return block

