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
MLP and MoE shared expert, from the parts' :class:`~megalite.layers.part_shape.LinearShape`; a rank orthogonalises
every matrix it holds, or under ZeRO about 1/n of them, the NS work balanced by ownership):

- ``blockwise``: nothing (each rank orthogonalises its own block);
- ``duplicated``: an all-gather of each matrix's U, 4 bytes x its full elements x (t - 1)/t;
- ``distributed``: per logical matrix (q, k, v apart under split QKV; SwiGLU's gate and up: the
  one table of fused linears, :mod:`megalite.layers.logical_matrices`, that Muon cuts by) and
  Newton-Schulz step, an all-reduce of the Gram over the uncut dimension d (the input features of
  a column-parallel linear, the output features of a row-parallel one): 2 x 4 d^2 x (t - 1)/t per
  step, and one scalar for the Frobenius norm.

Not counted: the MTP depths' matrices under TP, the padding of a bucket to a multiple of n.
"""
from __future__ import annotations

from megalite.config import ModelConfig
from megalite.model.parts import attention_part, layer_spec
from megalite.moe import planning as moe_planning
from megalite.planner.types import Layout, Precision

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


def update_traffic(m: ModelConfig, layout: Layout, prec: Precision, stage: int, bucket_size: int) -> dict[str, float]:
    """Wire bytes per rank per step of the update rule's own collectives, by group kind ('dp',
    'edp', 'tp'), for a rank of pipeline stage ``stage`` (module docstring); {} for AdamW."""
    update = prec.update
    if not update.muon:
        return {}
    n, t = layout.dp * layout.cp, layout.tp
    buckets = moe_planning.gradient_buckets(m, t, layout.ep, layout.pp, stage, bucket_size, attention_part(m))
    out = {"dp": 0.0, "edp": 0.0, "tp": 0.0}
    if layout.zero >= 1:
        dense = sum(size for size, expert, matrices in buckets if matrices and not expert)
        expert = sum(size for size, expert, matrices in buckets if matrices and expert)
        out["dp"] = 2 * FP32 * dense * ring(n)
        out["edp"] = 2 * FP32 * expert * ring(layout.edp)
    if t > 1 and update.muon_tp_mode != "blockwise":
        owned = 1 / n if layout.zero >= 1 and n > 1 else 1.0  # the share of matrices this rank orthogonalises
        for linear in tensor_parallel_linears(m, layout.pp, stage):
            if update.muon_tp_mode == "duplicated":
                out["tp"] += owned * FP32 * linear.weight * ring(t)
            else:
                d = linear.in_features if linear.column else linear.out_features  # the uncut dimension
                grams = len(linear.logical_shapes(m, t, update.muon_split_qkv))
                out["tp"] += owned * grams * 2 * FP32 * (update.muon_num_ns_steps * d * d + 1) * ring(t)
    return {kind: volume for kind, volume in out.items() if volume > 0}
