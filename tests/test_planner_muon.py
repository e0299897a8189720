"""The planner with Muon (megalite.planner.update_traffic, UpdatePlan): its extra collectives
equal what a meta dry run of the same command line hands to them, byte for byte.

Each layout is dry-run twice, with AdamW and with Muon (tools/dry_run.py: one fake-process-group
rank on meta tensors, the collectives counted by group); the difference is Muon's own traffic,
converted to wire bytes by the collective that carries it (ZeRO's all-gather of U and
reduce-scatter of the updates, TP's all-gather under ``duplicated``: (n-1)/n of the handed
tensor; ``distributed``'s Gram all-reduces: twice that). The planner's figure for the same
layout, with Muon less with AdamW, must be the same number. And ``tools/plan_parallel.py
--optimizer muon`` plans Muon: 8 bytes per weight-matrix parameter, ZeRO-3 refused, the flags
printed. The TP cases cover GQA, MLA and an MoE layer's shared expert (TP-split like a dense MLP,
which the planner once left out); the planner's TP-split matrices are the pieces Muon cuts the
built model into (one table of fused linears, megalite.layers.logical_matrices), shape for shape,
and its Newton-Schulz FLOPs give each of q, k and v its own rows (GQA: k and v are smaller).
Under ZeRO 1-2 a DP rank sends the Grams of the matrices it owns: the planner runs the
optimizer's own assignment (muon.assign_owners) on its buckets, which equal megalite's member by
member, and each DP rank's bytes equal the dry run of that rank; the plan counts the busiest.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import dry_run, plan_parallel  # noqa: E402

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--swiglu", "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "256",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--bf16", "--mock-data"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ZERO1 = ["--zero-stage", "1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]


@functools.lru_cache(maxsize=None)  # a layout's AdamW run serves each Muon mode's comparison
def _dry_run(world: int, flags: tuple[str, ...], model: tuple[str, ...] = tuple(MODEL)) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "dry_run.json")
        assert dry_run.main(["--world-size", str(world), "--gpus-per-node", "8", "--json", out] + list(model)
                            + list(flags)) == 0
        (role,) = json.load(open(out))["roles"]
    return role


def _muon_traffic(world: int, layout: list[str], mode: str, model: tuple[str, ...] = tuple(MODEL)) -> tuple[dict, dict]:
    """Per group: (bytes Muon hands beyond AdamW, the planner's wire bytes beyond AdamW's)."""
    adam = _dry_run(world, tuple(layout), model)
    muon = _dry_run(world, tuple(layout + ["--optimizer", "muon", "--muon-tp-mode", mode]), model)
    handed = {k: muon["comm_bytes"][k] - adam["comm_bytes"].get(k, 0) for k in muon["comm_bytes"]}
    planned = {k: muon["planned_comm_wire_bytes"][k] - adam["planned_comm_wire_bytes"].get(k, 0)
               for k in muon["planned_comm_wire_bytes"]}
    return handed, planned


def _check(world, layout, mode, ring, tp_wire_per_handed, model=tuple(MODEL)):
    handed, planned = _muon_traffic(world, layout, mode, model)
    for kind, n in ring.items():  # ZeRO: all-gather of U, reduce-scatter of the updates over n ranks
        assert handed[kind] > 0 and planned[kind] == handed[kind] * (n - 1) / n, (kind, handed, planned)
    if tp_wire_per_handed:
        assert handed["tp"] > 0 and planned["tp"] == handed["tp"] * tp_wire_per_handed, (handed, planned)
    else:
        assert handed.get("tp", 0) == planned.get("tp", 0) == 0, (handed, planned)


def test_muon_zero1_gathers_and_scatters_its_buckets_as_planned():
    """DP 2 ZeRO-1: U all-gathered and the updates reduce-scattered over the buckets holding matrices."""
    _check(2, ZERO1, "duplicated", {"dp": 2}, 0)


@pytest.mark.parametrize("mode, wire_per_handed", [("distributed", 1.0),
                                                   pytest.param("duplicated", 0.5, marks=pytest.mark.slow),
                                                   pytest.param("blockwise", 0, marks=pytest.mark.slow)])
def test_muon_tensor_parallel_modes_move_what_the_planner_says(mode, wire_per_handed):
    """TP 2: duplicated all-gathers each matrix (wire (t-1)/t of the gathered tensor); distributed
    all-reduces k Grams per logical matrix (twice (t-1)/t); blockwise sends nothing."""
    _check(2, TP2, mode, {}, wire_per_handed)


@pytest.mark.slow
@pytest.mark.parametrize("layout, world, ring, tp", [(ZERO1 + MOE, 4, {"dp": 4, "edp": 2}, 0),
                                                     (ZERO1 + TP2, 4, {"dp": 2}, 1.0)])
def test_muon_with_experts_and_tp_x_zero_as_planned(layout, world, ring, tp):
    """DP 4 ZeRO-1 with EP 2 (dense buckets over 4 ranks, expert buckets over EDP 2), and TP 2 x DP 2
    ZeRO-1 with distributed Newton-Schulz (each rank's Grams for the matrices it owns)."""
    _check(world, layout, "distributed", ring, tp)


MLA_MODEL = tuple(MODEL[:MODEL.index("--num-query-groups")] + MODEL[MODEL.index("--num-query-groups") + 2:] + [
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--normalization", "RMSNorm", "--position-embedding-type", "rope"])
SHARED_EXPERT = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "64"]


MTP_MODEL = tuple(MODEL + ["--mtp-num-layers", "1", "--position-embedding-type", "rope"])


@pytest.mark.slow
@pytest.mark.parametrize("model, layout", [(MLA_MODEL, TP2), (tuple(MODEL), TP2 + SHARED_EXPERT), (MTP_MODEL, TP2)],
                         ids=["mla", "moe_shared_expert", "mtp"])
def test_muon_distributed_grams_of_mla_and_a_shared_expert_as_planned(model, layout):
    """TP 2, distributed Newton-Schulz: MLA's split up-projections (one matrix each), an MoE
    layer's shared expert (TP-split as a dense MLP: SwiGLU's gate and up, then fc2; its routed
    experts are not split) and an MTP depth (its column-parallel eh_proj and its layer's linears,
    which the planner once left out) all-reduce the Grams the planner counts."""
    _check(2, layout, "distributed", {}, 1.0, model)


def _dp_rank_tp_bytes(world: int, layout: list[str]) -> tuple[list[float], list[float]]:
    """Per DP position (the rank at TP 0, stage 0 of each): (the wire bytes of the Gram
    all-reduces Muon's distributed Newton-Schulz hands beyond AdamW's, measured by a meta dry
    run of that rank; the planner's :func:`~megalite.planner.update_traffic.tp_bytes_by_dp_rank`)."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.parallel.grid_layout import GridLayout
    from megalite.planner.estimate import DEFAULT_BUCKET
    from megalite.planner.types import Layout, UpdatePlan
    from megalite.planner.update_traffic import tp_bytes_by_dp_rank

    muon = MODEL + layout + ["--optimizer", "muon", "--muon-tp-mode", "distributed"]
    config = config_from_args(build_parser().parse_args(muon), world)
    grid = GridLayout.from_config(config.parallel, world, experts=bool(config.model.num_experts))
    measured = []
    for dp in range(grid.dp):
        handed = [dry_run.run_role(flags, world, grid.rank_of(dp=dp), 8, "meta",
                                   dry_run.flagless_settings(config))["comm_bytes_by_group"].get("tp", 0)
                  for flags in (MODEL + layout, muon)]
        measured.append((handed[1] - handed[0]) * 2 * (grid.tp - 1) / grid.tp)  # all-reduces: twice (t-1)/t
    plan_layout = Layout(**grid.grid_sizes(), zero=config.train.zero_stage)
    return measured, tp_bytes_by_dp_rank(config.model, plan_layout, UpdatePlan.of_run(config.train), 0, DEFAULT_BUCKET)


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [(4, TP2 + ZERO1 + SHARED_EXPERT), (8, TP2 + ZERO1),
                                           (8, TP2 + ZERO1 + SHARED_EXPERT + ["--expert-model-parallel-size", "2"])],
                         ids=["tp2_dp2_moe_shared_expert", "tp2_dp4_gqa", "tp2_dp4_ep2_one_load"])
def test_each_dp_rank_all_reduces_the_grams_of_the_matrices_it_owns(world, layout):
    """ZeRO-1 with distributed Newton-Schulz: a DP rank runs NS, and so all-reduces Grams over
    TP, for the matrices the optimizer assigns it (muon.assign_owners, balancing NS cost
    m n min(m, n), not Gram bytes), not for 1/n of them. Measured at every DP position of TP 2 x
    DP 2 with an MoE shared expert, of TP 2 x DP 4 (GQA) and of TP 2 x DP 4 with EP 2 (EP = TP:
    the expert buckets' EDP group is the DP group's communicator, so the experts' NS cost loads
    the same ranks): the planner's bytes per DP rank are the dry run's, byte for byte; the ranks
    differ, and the plan counts the busiest."""
    measured, planned = _dp_rank_tp_bytes(world, layout)
    assert planned == measured and len(set(measured)) > 1, (planned, measured)
    _, plan = _muon_traffic(world, layout, "distributed")
    assert plan["tp"] == max(measured), (plan, measured)


def _megalite_buckets(chunks, size: int, split_backward: bool = False) -> list[list[tuple]]:
    """The ZeRO optimizer's buckets of a rank's built ``chunks`` (data_parallel/zero.py's rule,
    restated: the chunks' parameters from the last chunk back, in reverse registration order,
    ddp.group_by_size then split_by_domain; under a split backward per chunk, B's parameters before
    W's), each parameter as (elements, expert, its Muon matrix shape on the rank, TP-split)."""
    from megalite.data_parallel.ddp import group_by_size, split_by_domain
    from megalite.data_parallel.muon import takes_muon

    names = {p: n for c in chunks for n, p in c.named_parameters()}
    tied = lambda p: getattr(p, "tied_embedding", False)  # noqa: E731
    if split_backward:
        groups = [g for c in reversed(chunks) for in_w in (False, True)
                  for g in group_by_size([p for p in reversed(list(c.parameters()))
                                          if getattr(p, "deferred_wgrad", False) == in_w], size, tied)]
    else:
        groups = group_by_size([p for c in reversed(chunks) for p in reversed(list(c.parameters()))], size, tied)
    return [[(p.numel(), bool(getattr(p, "expert_parallel", False)), tuple(p.shape) if takes_muon(names[p], p) else None,
              takes_muon(names[p], p) and getattr(p, "tp_split", None) is not None) for p in group]
            for group in split_by_domain(groups)]


def _planned_buckets(buckets) -> list[list[tuple]]:
    """The planner's buckets (moe.parameter_buckets.stage_buckets) as :func:`_megalite_buckets` writes them."""
    return [[(p.elements, p.expert, p.shape, p.linear is not None) for p in group] for group in buckets]


def test_the_planner_buckets_hold_the_matrices_megalite_buckets_hold():
    """The planner's buckets (moe.parameter_buckets.stage_buckets), member by member, against those megalite
    builds from the model (ddp.group_by_size, split_by_domain): elements, expert or dense, the Muon
    matrices' shapes on the rank (what assign_owners weighs) and which are TP-split (what sends
    Grams): MLA (replicated down-projections), a shared expert, the MTP depths, TP 2 x PP 2 x EP 4."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.moe import parameter_buckets
    from megalite.model.parts import attention_part
    from tests.test_moe_planning import MODELS, rank_chunks

    mla = config_from_args(build_parser().parse_args(list(MLA_MODEL)), 256).model
    for m in (mla, MODELS["mtp-untied-moe-depths"], MODELS["every-other-layer-shared"]):
        for tp, pp, ep, bucket in ((2, 2, 4, 3_000), (2, 1, 2, 10**9)):
            for stage in range(pp):
                real = _megalite_buckets(rank_chunks(m, tp, pp, ep, stage, 0, 0), bucket)
                planned = _planned_buckets(parameter_buckets.stage_buckets(m, tp, ep, pp, stage, bucket,
                                                                           attention_part(m)))
                assert planned == real, (m.num_layers, tp, pp, ep, stage)


@pytest.mark.parametrize("schedule,k", [("zbv", None), ("1f1b", 1), ("zb-h1", None)], ids=["zbv", "interleaved", "zb-h1"])
def test_a_pipeline_ranks_buckets_are_megalites(schedule, k):
    """ZBV, the interleaved 1F1B and ZB-H1 with MTP depths and experts: a rank's buckets
    (stage_buckets as update_traffic.rank_buckets says: the rank's chunks, the MTP depths with the
    last, on ZBV's rank 0; under a split backward each chunk apart, B's parameters before W's) are
    the ZeRO optimizer's for the chunks megalite builds, member by member. So the owners'
    Newton-Schulz FLOPs and Gram traffic are the right rank's."""
    import types

    import torch

    from megalite.config import Config, ParallelConfig, TrainConfig
    from megalite.model.parts import attention_part
    from megalite.moe import parameter_buckets
    from megalite.parallel.comm import OfflineGroup
    from megalite.pipeline.partition import build_model_chunks
    from megalite.planner.types import Layout
    from megalite.planner.update_traffic import rank_buckets
    from tests.test_moe_planning import MODELS

    m, tp, pp, ep, size = MODELS["mtp-untied-moe-depths"], 1, 2, 2, 3_000
    layout = Layout(pp=pp, dp=2, ep=ep, schedule=schedule, virtual=2 if k else 1, experts=True)
    config = Config(model=m, parallel=ParallelConfig(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                                     num_layers_per_virtual_pipeline_stage=k),
                    train=TrainConfig(pipeline_schedule=schedule))
    for stage in range(pp):
        grid = types.SimpleNamespace(layout=types.SimpleNamespace(pp=pp), pp_rank=stage, tp_group=None,
                                     ep_group=OfflineGroup(0, ep))
        real = _megalite_buckets(build_model_chunks(config, grid, torch.device("meta")), size,
                                 split_backward=schedule != "1f1b")
        planned = _planned_buckets(parameter_buckets.stage_buckets(m, tp, ep, pp, stage, size, attention_part(m),
                                                                   **rank_buckets(layout, stage)))
        assert planned == real, (schedule, stage)


@pytest.mark.parametrize("flags", [MODEL, list(MLA_MODEL), MODEL + SHARED_EXPERT, list(MTP_MODEL) + MOE[:4]],
                         ids=["gqa", "mla", "moe_shared_expert", "mtp_moe"])
def test_the_planner_counts_the_matrices_muon_cuts(flags):
    """The planner's logical matrices of a stage (update_traffic.logical_matrices_on_rank of every
    matrix in its buckets) are the pieces Muon cuts the built model's matrices into
    (muon.logical_pieces), shape for shape: q, k, v and SwiGLU's gate and up of the TP-split
    linears, MLA's replicated projections, the stacked experts' per expert (w1's gate and up), the
    MTP depth's."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.data_parallel.muon import logical_pieces, takes_muon
    from megalite.model.gpt import GPTModel
    from megalite.model.parts import attention_part
    from megalite.moe import parameter_buckets
    from megalite.planner.update_traffic import logical_matrices_on_rank

    m = config_from_args(build_parser().parse_args(flags), 256).model
    params = parameter_buckets.stage_parameter_list(m, 1, 1, 1, 0, attention_part(m))
    planned = sorted((rows, cols) for p in params if p.shape is not None
                     for rows, cols, _ in logical_matrices_on_rank(m, p, 1))
    cut = sorted(tuple(select(p).reshape(-1, p.shape[-1]).shape) for name, p in GPTModel(m).named_parameters()
                 if takes_muon(name, p) for select in logical_pieces(name, p, tuple(p.shape), m, True))
    assert planned == cut


def test_newton_schulz_flops_take_each_logical_matrix_its_own_rows():
    """GQA (4 heads of d 16 in 2 KV groups, h 64) on TP 2: a rank's qkv block holds one group, so
    its q is 32 x 64, its k and v 16 x 64 each (not a third of its 64 rows each); proj 64 x 32;
    SwiGLU's gate and up (ffn 192: 96 x 64 each on a rank), fc2 64 x 96. Per step, five steps, two
    layers: blockwise NS on each block (a x b, a <= b: 4 a^2 b + 2 a^3); duplicated on each whole
    matrix (q 64 x 64, k and v 32 x 64, proj 64 x 64, gate and up 192 x 64, fc2 64 x 192);
    distributed per block 4 c d^2 + 2 d^3, d = 64 the uncut dimension, c the block's cut extent."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.planner.step_time import BUCKET
    from megalite.planner.types import Layout, UpdatePlan
    from megalite.planner.update_traffic import newton_schulz_flops

    m = config_from_args(build_parser().parse_args(MODEL), 256).model
    assert (m.head_dim, m.ffn_hidden_size) == (16, 192)
    ns = lambda a, b: 4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3  # noqa: E731
    blockwise = sum(ns(a, b) for a, b in [(32, 64), (16, 64), (16, 64), (64, 32), (96, 64), (96, 64), (64, 96)])
    duplicated = sum(ns(a, b) for a, b in [(64, 64), (32, 64), (32, 64), (64, 64), (192, 64), (192, 64), (64, 192)])
    distributed = sum(4 * c * 64 ** 2 + 2 * 64 ** 3 for c in (32, 16, 16, 32, 96, 96, 96))
    for mode, per_layer in (("blockwise", blockwise), ("duplicated", duplicated), ("distributed", distributed)):
        update = UpdatePlan("muon", muon_tp_mode=mode)
        assert newton_schulz_flops(m, Layout(tp=2, pp=1), update, 0, BUCKET) == 5 * 2 * per_layer, mode


def test_newton_schulz_flops_count_the_experts_per_expert():
    """Four SwiGLU experts of ffn 192 (h 64) a layer on one rank: per expert w1's gate and up
    (192 x 64 each) and w2 (64 x 192), beside the attention and the dense parts; EP 2 halves them."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.planner.step_time import BUCKET
    from megalite.planner.types import Layout, UpdatePlan
    from megalite.planner.update_traffic import newton_schulz_flops

    update = UpdatePlan("muon")
    dense = config_from_args(build_parser().parse_args(MODEL), 256).model
    moe = config_from_args(build_parser().parse_args(MODEL + MOE[:4]), 256).model
    ns = lambda a, b: 5 * (4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3)  # noqa: E731
    mlp = 2 * ns(192, 64) + ns(64, 192)  # a dense SwiGLU MLP of ffn 192, or one expert
    attention = newton_schulz_flops(dense, Layout(), update, 0, BUCKET) - 2 * mlp
    assert newton_schulz_flops(moe, Layout(), update, 0, BUCKET) == attention + 2 * 4 * mlp
    assert newton_schulz_flops(moe, Layout(dp=2, ep=2, experts=True), update, 0, BUCKET) == attention + 2 * 2 * mlp


PLAN = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
        "--vocab-size", "32000", "--swiglu", "--global-batch-size", "16", "--gpu-memory-gb", "8", "--gpus-per-node", "4"]


def test_plan_parallel_plans_muon(capsys):
    """--optimizer muon: the explanation counts 8 bytes per weight-matrix parameter, ZeRO-3 is
    refused by megalite's validation, and the recommended flags train with Muon as planned."""
    assert plan_parallel.main(PLAN + ["--optimizer", "muon", "--muon-tp-mode", "distributed"]) == 0
    text = capsys.readouterr().out
    assert "8 bytes for the 0.05B weight matrices, 12 for the rest" in text
    assert "--optimizer muon with --zero-stage 3" in text
    flags = next(line for line in text.splitlines() if line.startswith("  --num-layers"))
    assert "--optimizer=muon --muon-tp-mode=distributed" in flags
    assert plan_parallel.main(PLAN) == 0
    text = capsys.readouterr().out
    assert "--optimizer" not in text and "x 18 bytes (2 weights + 4 gradients + 12 fp32 master" in text


def test_update_flags_read_back_as_the_same_update_plan():
    """Every UpdatePlan setting the planner prints is read back by pretrain_gpt.py's parser as that
    setting (--muon-no-split-qkv turns the split off; defaults are left out)."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.planner.flags import update_flags
    from megalite.planner.types import UpdatePlan

    for update in (UpdatePlan(), UpdatePlan("muon", "distributed", 3, False), UpdatePlan("muon", "duplicated")):
        args = build_parser().parse_args(MODEL + update_flags(update))
        assert UpdatePlan.of_run(config_from_args(args, 256).train) == update, update
    assert update_flags(UpdatePlan()) == []
