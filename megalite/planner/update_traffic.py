"""The update rule's own collectives, beside the gradient reduction every rule has: what Muon
(:mod:`megalite.data_parallel.muon`) sends per step, as the planner's wire bytes per rank (ring
collectives: (n-1)/n of the tensor, twice for an all-reduce). AdamW is elementwise on each
rank's shard and sends nothing of its own. Part of the planner (:mod:`megalite.planner`).

**ZeRO 1-2** (a bucket sharded over n ranks: the dense buckets over DP x CP, 'dp'; the expert
buckets over EDP, 'edp'). Newton-Schulz needs whole matrices while the shards cut across them,
so for each bucket that holds weight matrices (a layer's parameters) U's shards are all-gathered
and the owners' updates reduce-scattered, both of the whole bucket in fp32:

    2 x 4 bytes x (elements of the buckets holding matrices) x (n - 1) / n

(megalite's buckets from :func:`megalite.moe.planning.gradient_buckets`, at pretrain_gpt.py's
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

from megalite.config import ModelConfig
from megalite.data_parallel.muon import assign_owners, matrix_cost
from megalite.layers.part_shape import LinearShape
from megalite.model.parts import attention_part, layer_spec
from megalite.moe import planning as moe_planning
from megalite.planner.types import Layout, Precision, UpdatePlan

FP32 = 4


def ring(n: int) -> float:
    """The fraction of a tensor one rank sends in a ring collective over ``n`` ranks."""
    return (n - 1) / n if n > 1 else 0.0


def tensor_parallel_linears(m: ModelConfig, pp: int, stage: int) -> list:
    """The TP-split linears of the stage's layers: every attention's, the MLP's of a dense layer
    and an MoE layer's shared expert's (its routed experts are not split over TP)."""
    out = []
    for layer in moe_planning.stage_layers(m, pp, stage):
        spec = layer_spec(m, layer)
        out += spec.attention.linears(m)
        out += spec.mlp.linears(m, m.moe_shared_expert_intermediate_size or 0) if spec.moe else spec.mlp.linears(m)
    return out


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


def tp_bytes_by_dp_rank(m: ModelConfig, layout: Layout, update: UpdatePlan, stage: int,
                        bucket_size: int) -> list[float]:
    """Muon's TP wire bytes per step (:func:`gram_wire_bytes` of each TP-split matrix a rank
    orthogonalises) of each rank of the stage's DP x CP group, by its rank in that group. Under
    ZeRO 1-2 a rank orthogonalises the matrices it owns: :func:`megalite.data_parallel.muon.
    assign_owners` over megalite's buckets (:func:`megalite.moe.planning.stage_buckets`), the
    matrices' NS costs at their shapes on the rank, the load carried over a group's buckets (the
    dense buckets' DP x CP group; the expert buckets' EDP group, the same communicator, so one load,
    when EP = TP); without ZeRO every rank orthogonalises every matrix."""
    key = ("by rank", id(m), layout.tp, layout.ep, layout.pp, stage, layout.dp * layout.cp, layout.edp,
           layout.zero >= 1, update, bucket_size)
    hit = _REMEMBERED.get(key)
    if hit is not None and hit[0] is m:
        return list(hit[1])
    n, t = layout.dp * layout.cp, layout.tp
    sizes = {False: n, True: layout.edp}  # the group of a dense / an expert bucket
    loads = {}  # per communicator: NS cost per rank, carried over its buckets
    out = [0.0] * n
    for bucket in moe_planning.stage_buckets(m, t, layout.ep, layout.pp, stage, bucket_size, attention_part(m)):
        matrices = [p for p in bucket if p.shape is not None]
        expert = bucket[0].expert
        size = sizes[expert]
        if layout.zero >= 1 and size > 1:
            load = loads.setdefault("dp" if not expert or layout.ep == t else "edp", [0] * size)
            owner = assign_owners([matrix_cost(p.shape) for p in matrices], load)
        else:
            owner = [None] * len(matrices)  # every rank its own copy
        for p, rank in zip(matrices, owner):
            if p.linear is None or expert:  # TP-split matrices only (the experts are not split)
                continue
            volume = gram_wire_bytes(m, p.linear, t, update)
            for r in range(n) if rank is None else [rank]:
                out[r] += volume
    _remember(key, m, out)
    return list(out)


def update_traffic(m: ModelConfig, layout: Layout, prec: Precision, stage: int, bucket_size: int) -> dict[str, float]:
    """Wire bytes per rank per step of the update rule's own collectives, by group kind ('dp',
    'edp', 'tp'), for a rank of pipeline stage ``stage`` (module docstring); {} for AdamW. Its
    'tp' is the busiest DP rank's (:func:`tp_bytes_by_dp_rank`): the owners' updates are
    reduce-scattered together, so the step waits for the rank with the most Gram traffic."""
    update = prec.update
    if not update.muon:
        return {}
    key = ("traffic", id(m), layout.tp, layout.ep, layout.pp, stage, layout.dp * layout.cp, layout.edp,
           layout.zero >= 1, update, bucket_size)
    hit = _REMEMBERED.get(key)
    if hit is None or hit[0] is not m:
        hit = _remember(key, m, _update_traffic(m, layout, update, stage, bucket_size))
    return dict(hit[1])


def _update_traffic(m: ModelConfig, layout: Layout, update: UpdatePlan, stage: int, bucket_size: int) -> dict[str, float]:
    """:func:`update_traffic`, computed."""
    n, t = layout.dp * layout.cp, layout.tp
    buckets = moe_planning.gradient_buckets(m, t, layout.ep, layout.pp, stage, bucket_size, attention_part(m))
    out = {"dp": 0.0, "edp": 0.0, "tp": 0.0}
    if layout.zero >= 1:
        dense = sum(size for size, expert, matrices in buckets if matrices and not expert)
        expert = sum(size for size, expert, matrices in buckets if matrices and expert)
        out["dp"] = 2 * FP32 * dense * ring(n)
        out["edp"] = 2 * FP32 * expert * ring(layout.edp)
    if t > 1 and update.muon_tp_mode != "blockwise":
        out["tp"] = max(tp_bytes_by_dp_rank(m, layout, update, stage, bucket_size))
    return {kind: volume for kind, volume in out.items() if volume > 0}
