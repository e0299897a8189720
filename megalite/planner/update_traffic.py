"""The update rule's own collectives, beside the gradient reduction every rule has: what Muon
(:mod:`megalite.data_parallel.muon`) sends per step, as the planner's wire bytes per rank (ring
collectives: (n-1)/n of the tensor, twice for an all-reduce). AdamW is elementwise on each
rank's shard and sends nothing of its own. Part of the planner (:mod:`megalite.planner`).

**ZeRO 1-2** (a bucket sharded over n ranks: the dense buckets over DP x CP, 'dp'; the expert
buckets over EDP, 'edp'). Newton-Schulz needs whole matrices while the shards cut across them,
so for each bucket that holds weight matrices (a layer's parameters) U's shards are all-gathered
and the owners' updates reduce-scattered, both of the whole bucket in fp32:

    2 x 4 bytes x (elements of the buckets holding matrices) x (n - 1) / n

(megalite's buckets from :func:`megalite.moe.parameter_buckets.gradient_buckets`, at pretrain_gpt.py's
bucket size; a tied embedding's bucket holds no matrix and moves nothing). Without ZeRO a
rank holds every matrix whole and sends nothing.

**Tensor parallelism** (``--muon-tp-mode``; TP-split linears of the layers' attention, dense
MLP and MoE shared expert and of the MTP depths, from the parts' :class:`~megalite.layers.part_shape.LinearShape`;
a rank orthogonalises every matrix it holds, or under ZeRO 1-2 the matrices it owns: the
optimizer's own assignment, :func:`megalite.data_parallel.muon.assign_owners`, over megalite's
buckets, which balances NS cost m n min(m, n), not Gram bytes, so the DP ranks' TP traffic
differs; the planner's is the busiest DP rank's, :func:`tp_bytes_by_dp_rank`):

- ``blockwise``: nothing (each rank orthogonalises its own block);
- ``duplicated``: an all-gather of each matrix's U, 4 bytes x its full elements x (t - 1)/t;
- ``distributed``: per logical matrix (q, k, v apart under split QKV; SwiGLU's gate and up: the
  one table of fused linears, :mod:`megalite.layers.logical_matrices`, that Muon cuts by) and
  Newton-Schulz step, an all-reduce of the Gram over the uncut dimension d (the input features of
  a column-parallel linear, the output features of a row-parallel one): 2 x 4 d^2 x (t - 1)/t per
  step, and one scalar for the Frobenius norm.

Not counted: the padding of a bucket to a multiple of n.
"""
from __future__ import annotations

import math

from megalite.config import ModelConfig
from megalite.data_parallel.muon import assign_owners, matrix_cost, tp_block_ns_flops
from megalite.layers.logical_matrices import row_block
from megalite.layers.part_shape import LinearShape
from megalite.model.parts import attention_part
from megalite.moe import parameter_buckets
from megalite.pipeline.schedule_kinds import schedule as describe_schedule
from megalite.planner.types import Layout, Precision, UpdatePlan

FP32 = 4


def ring(n: int) -> float:
    """The fraction of a tensor one rank sends in a ring collective over ``n`` ranks."""
    return (n - 1) / n if n > 1 else 0.0


_REMEMBERED: dict = {}  # answers per model object and layout (the entry holds the model: a reused id misses)


def _remember(key: tuple, m: ModelConfig, answer) -> tuple:
    """Keep ``answer`` for ``key`` (a search asks for each ZeRO stage and recomputation of one grid)."""
    if len(_REMEMBERED) > 4096:
        _REMEMBERED.clear()
    _REMEMBERED[key] = (m, answer)
    return _REMEMBERED[key]


def gram_wire_bytes(m: ModelConfig, linear: LinearShape, t: int, update: UpdatePlan) -> float:
    """Wire bytes per rank of one TP-split weight's update collectives over TP (module docstring):
    ``duplicated``'s all-gather of U, or ``distributed``'s Gram and norm all-reduces per logical
    matrix; nothing for ``blockwise`` or at t = 1."""
    if t == 1 or update.muon_tp_mode == "blockwise":
        return 0.0
    if update.muon_tp_mode == "duplicated":
        return FP32 * linear.weight * ring(t)
    d = linear.in_features if linear.column else linear.out_features  # the uncut dimension
    grams = len(linear.logical_shapes(m, t, update.muon_split_qkv))
    return grams * 2 * FP32 * (update.muon_num_ns_steps * d * d + 1) * ring(t)


def rank_buckets(layout: Layout, stage: int) -> dict:
    """How pipeline rank ``stage`` buckets its gradients (the schedule's table row,
    :mod:`megalite.pipeline.schedule_kinds`): ``chunks`` (C, the global chunks it holds in its
    order) for a multi-chunk schedule, else None; ``split_backward`` for ZB-H1 and ZBV
    (:func:`megalite.moe.parameter_buckets.stage_buckets`; interleaving 1F1B's chunks never splits)."""
    kind = describe_schedule(layout.schedule)
    total = kind.pipeline_chunks(layout.pp, layout.virtual)
    chunks = None if total == layout.pp else (total, tuple(kind.local_chunks(layout.pp, stage, layout.virtual)))
    return {"chunks": chunks, "split_backward": layout.pp > 1 and kind.split_backward}


def owned_matrices(m: ModelConfig, layout: Layout, stage: int, bucket_size: int) -> list[tuple]:
    """(parameter, its group, its owner) for each update-rule matrix of the stage's buckets
    (:func:`megalite.moe.parameter_buckets.stage_buckets`, in bucket order): the group 'dp' (the dense
    buckets' DP x CP ranks; the expert buckets' too when EP = TP, the same communicator and one
    load) or 'edp'; the owner the rank of that group that orthogonalises it under ZeRO 1-2
    (:func:`megalite.data_parallel.muon.assign_owners`, the load carried over the group's
    buckets), None where every rank of the group does (no ZeRO, or a group of one)."""
    how = rank_buckets(layout, stage)
    key = ("owned", id(m), layout.tp, layout.ep, layout.pp, stage, layout.dp * layout.cp, layout.edp,
           layout.zero >= 1, bucket_size, tuple(how.values()))
    hit = _REMEMBERED.get(key)
    if hit is not None and hit[0] is m:
        return hit[1]
    t = layout.tp
    sizes = {"dp": layout.dp * layout.cp, "edp": layout.edp}
    loads: dict[str, list] = {}  # per communicator: NS cost per rank, carried over its buckets
    out = []
    for bucket in parameter_buckets.stage_buckets(m, t, layout.ep, layout.pp, stage, bucket_size, attention_part(m),
                                                  **how):
        matrices = [p for p in bucket if p.shape is not None]
        group = "dp" if not bucket[0].expert or layout.ep == t else "edp"
        if layout.zero >= 1 and sizes[group] > 1:
            load = loads.setdefault(group, [0] * sizes[group])
            owner = assign_owners([matrix_cost(p.shape) for p in matrices], load)
        else:
            owner = [None] * len(matrices)
        out += [(p, group, rank) for p, rank in zip(matrices, owner)]
    return _remember(key, m, out)[1]


def _by_rank(m: ModelConfig, layout: Layout, stage: int, bucket_size: int, amount, experts: bool) -> dict[str, list]:
    """``amount(p)`` summed per rank of each group over the stage's matrices (:func:`owned_matrices`):
    {group: [per rank]}; the experts' left out unless ``experts``."""
    out = {"dp": [0.0] * (layout.dp * layout.cp), "edp": [0.0] * layout.edp}
    for p, group, rank in owned_matrices(m, layout, stage, bucket_size):
        if p.expert and not experts:
            continue
        value = amount(p)
        for r in range(len(out[group])) if rank is None else [rank]:
            out[group][r] += value
    return out


def tp_bytes_by_dp_rank(m: ModelConfig, layout: Layout, update: UpdatePlan, stage: int,
                        bucket_size: int) -> list[float]:
    """Muon's TP wire bytes per step (:func:`gram_wire_bytes` of each TP-split matrix a rank
    orthogonalises) of each rank of the stage's DP x CP group, by its rank in that group: the
    matrices it owns under ZeRO 1-2, every matrix without (:func:`owned_matrices`, which balances
    NS cost, not Gram bytes). The experts are not split over TP."""
    volume = lambda p: gram_wire_bytes(m, p.linear, layout.tp, update) if p.linear is not None else 0.0  # noqa: E731
    return _by_rank(m, layout, stage, bucket_size, volume, experts=False)["dp"]


def logical_matrices_on_rank(m: ModelConfig, p, tp: int, split_qkv: bool = True) -> list[tuple[int, int, int | None]]:
    """(rows, cols, cut dimension) of each logical matrix one TP rank holds of parameter ``p`` (a
    :class:`~megalite.moe.parameter_buckets.StageParameter` with a shape), as Muon cuts it
    (:func:`megalite.data_parallel.muon.logical_pieces`, by the one table of fused linears: q, k, v
    under --muon-split-qkv; SwiGLU's gate and up, a stacked expert's too, per expert). The cut
    dimension is 0 for a column-parallel linear's rows, 1 for a row-parallel one's columns, None for
    a matrix TP does not split (MLA's replicated down-projections, the experts)."""
    if p.linear is not None:
        cut = 0 if p.linear.column else 1
        return [(rows, cols, cut) for rows, cols in p.linear.logical_shapes(m, tp, split_qkv)]
    *stack, rows, cols = p.shape
    block = row_block(p.name, m, rows, split_qkv)
    return [(rows // sum(block) * width, cols, None) for width in block] * math.prod(stack)


def matrix_ns_flops_on_rank(m: ModelConfig, p, tp: int, update: UpdatePlan) -> float:
    """Newton-Schulz FLOPs per step one TP rank spends on parameter ``p``: of each logical matrix
    (:func:`logical_matrices_on_rank`), :func:`megalite.data_parallel.muon.tp_block_ns_flops` under
    the TP mode."""
    return float(sum(tp_block_ns_flops(rows, cols, cut, tp, update.muon_tp_mode, update.muon_num_ns_steps)
                     for rows, cols, cut in logical_matrices_on_rank(m, p, tp, update.muon_split_qkv)))


def newton_schulz_flops(m: ModelConfig, layout: Layout, update: UpdatePlan, stage: int, bucket_size: int) -> float:
    """Muon's Newton-Schulz FLOPs per step of the busiest rank of pipeline stage ``stage``
    (:func:`matrix_ns_flops_on_rank` of the matrices it orthogonalises: :func:`owned_matrices`):
    every matrix without ZeRO; under ZeRO 1-2 its own, which leaves the busiest rank more than
    1/n of the work where a stage has few matrices for its n ranks (whole matrices are owned). With
    the experts over EDP apart from the dense matrices, the busiest of each group is summed (an
    upper bound: the two may be different ranks)."""
    flops = _by_rank(m, layout, stage, bucket_size, lambda p: matrix_ns_flops_on_rank(m, p, layout.tp, update),
                     experts=True)
    return sum(max(per_rank) for per_rank in flops.values() if per_rank)


def update_traffic(m: ModelConfig, layout: Layout, prec: Precision, stage: int, bucket_size: int) -> dict[str, float]:
    """Wire bytes per rank per step of the update rule's own collectives, by group kind ('dp',
    'edp', 'tp'), for a rank of pipeline stage ``stage`` (module docstring); {} for AdamW. Its
    'tp' is the busiest DP rank's (:func:`tp_bytes_by_dp_rank`): the owners' updates are
    reduce-scattered together, so the step waits for the rank with the most Gram traffic."""
    update = prec.update
    if not update.muon:
        return {}
    key = ("traffic", id(m), layout.tp, layout.ep, layout.pp, stage, layout.dp * layout.cp, layout.edp,
           layout.zero >= 1, update, bucket_size, tuple(rank_buckets(layout, stage).values()))
    hit = _REMEMBERED.get(key)
    if hit is None or hit[0] is not m:
        hit = _remember(key, m, _update_traffic(m, layout, update, stage, bucket_size))
    return dict(hit[1])


def _update_traffic(m: ModelConfig, layout: Layout, update: UpdatePlan, stage: int, bucket_size: int) -> dict[str, float]:
    """:func:`update_traffic`, computed."""
    n, t = layout.dp * layout.cp, layout.tp
    buckets = parameter_buckets.gradient_buckets(m, t, layout.ep, layout.pp, stage, bucket_size, attention_part(m),
                                                 **rank_buckets(layout, stage))
    out = {"dp": 0.0, "edp": 0.0, "tp": 0.0}
    if layout.zero >= 1:
        dense = sum(size for size, expert, matrices in buckets if matrices and not expert)
        expert = sum(size for size, expert, matrices in buckets if matrices and expert)
        out["dp"] = 2 * FP32 * dense * ring(n)
        out["edp"] = 2 * FP32 * expert * ring(layout.edp)
    if t > 1 and update.muon_tp_mode != "blockwise":
        out["tp"] = max(tp_bytes_by_dp_rank(m, layout, update, stage, bucket_size))
    return {kind: volume for kind, volume in out.items() if volume > 0}
