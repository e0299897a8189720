"""The planner with experts (megalite.moe.planning): parameters per stage against the real model
built on meta, the activation arithmetic against one MoE layer under the memory tracker, and
the meta dry run of 16-rank MoE layouts against the planner (memory per role, all-to-all and
expert-gradient traffic)."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

from megalite.config import Config, ModelConfig, ParallelConfig
from megalite.model.gpt import count_parameters
from megalite.moe import parameter_buckets, planning
from megalite.parallel.comm import OfflineGroup
from megalite.pipeline.partition import build_model_chunks
from megalite.planner.search import candidate_layouts, plan
from megalite.planner import (Hardware, Layout, check_layout, precision, stage_memory, stage_expert_parameters,
                              stage_parameters, total_parameters)

BF16 = precision("bf16")


def moe_model(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=500, seq_length=32, swiglu=True,
                normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48)
    return ModelConfig(**{**base, **kw})


# -- (a) parameters per stage equal the real model's ---------------------------------------------

MODELS = {
    "swiglu-every-layer": moe_model(),
    "gelu-bias-pattern-shared-untied": moe_model(swiglu=False, add_bias_linear=True, moe_layer_freq=[1, 0, 0, 1],
                                                 moe_shared_expert_intermediate_size=32,
                                                 position_embedding_type="learned_absolute",
                                                 normalization="LayerNorm", untie_embeddings_and_output_weights=True),
    "every-other-layer-shared": moe_model(moe_layer_freq=2, moe_shared_expert_intermediate_size=64, num_experts=16,
                                          moe_router_topk=1),
    # multi-token prediction: the depths (and an untied model's embedding copy) on the last stage
    "mtp-untied-moe-depths": moe_model(untie_embeddings_and_output_weights=True, mtp_num_layers=2,
                                       moe_shared_expert_intermediate_size=32),
    "mtp-tied-dense-depth": moe_model(moe_layer_freq=[1, 1, 1, 0], mtp_num_layers=1),
}


def rank_chunks(m: ModelConfig, tp: int, pp: int, ep: int, stage: int, tp_rank: int, ep_rank: int):
    """One rank's model chunks, built on meta without a world (as tools/reshard_checkpoint.py does)."""
    config = Config(model=m, parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                     sequence_parallel=tp > 1, expert_model_parallel_size=ep))
    grid = types.SimpleNamespace(layout=types.SimpleNamespace(pp=pp), pp_rank=stage,
                                 tp_group=OfflineGroup(tp_rank, tp) if tp > 1 else None,
                                 ep_group=OfflineGroup(ep_rank, ep) if ep > 1 else None)
    return build_model_chunks(config, grid, torch.device("meta"))


def rank_parameters(m: ModelConfig, tp: int, pp: int, ep: int, stage: int, tp_rank: int, ep_rank: int):
    """(all, expert) parameter elements of one rank's model chunk."""
    params = [p for chunk in rank_chunks(m, tp, pp, ep, stage, tp_rank, ep_rank) for p in chunk.parameters()]
    return sum(p.numel() for p in params), sum(p.numel() for p in params if getattr(p, "expert_parallel", False))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 2, 4), (4, 1, 8), (1, 4, 2)])
def test_stage_parameters_equal_the_model(name, tp, pp, ep):
    m = MODELS[name]
    assert total_parameters(m) == count_parameters(m)
    for stage in range(pp):
        for tp_rank, ep_rank in {(0, 0), (tp - 1, ep - 1)}:
            total, expert = rank_parameters(m, tp, pp, ep, stage, tp_rank, ep_rank)
            assert stage_parameters(m, tp, pp, stage, ep) == total, (name, tp, pp, ep, stage)
            assert stage_expert_parameters(m, tp, pp, stage, ep) == expert, (name, tp, pp, ep, stage)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("bucket", [10**9, 20_000, 3_000])
def test_largest_gradient_bucket_equals_megalite_buckets(name, bucket):
    """ZeRO-2's staging buffer: the planner's largest bucket against the buckets megalite's
    DistributedOptimizer builds (same grouping, cut between dense and expert parameters)."""
    from megalite.data_parallel.ddp import group_by_size, split_by_domain

    m = MODELS[name]
    for tp, pp, ep in [(1, 1, 1), (2, 2, 4), (1, 4, 2)]:
        for stage in range(pp):
            chunks = rank_chunks(m, tp, pp, ep, stage, 0, 0)
            params = [p for c in reversed(chunks) for p in reversed(list(c.parameters()))]
            groups = split_by_domain(group_by_size(params, bucket, isolate=lambda p: getattr(p, "tied_embedding",
                                                                                              False)))
            real = max(sum(p.numel() for p in g) for g in groups)
            planned = parameter_buckets.largest_gradient_bucket(m, tp, ep, pp, stage, bucket)
            assert planned == real, (name, tp, pp, ep, stage, bucket)


def test_expert_model_state_is_sharded_over_edp():
    """ZeRO-1 on 16 ranks of one stage, EP 4: dense state over DP 16, experts over EDP 4."""
    m, lay = moe_model(), Layout(dp=16, zero=1, ep=4)
    psi, mem = stage_memory(m, lay, 0, 1, 1, BF16)
    psi_e = stage_expert_parameters(m, ep=4)
    assert psi_e == 4 * 2 * 3 * 64 * 48  # 4 layers x 2 local experts x (2F + F) h
    dense = psi - psi_e
    assert mem["weights"] == 2 * psi and mem["gradients"] == 2 * psi
    assert mem["master_and_optimizer"] == pytest.approx(12 * dense / 16 + 12 * psi_e / 4)


# -- activations of one MoE layer, measured --------------------------------------------------------

def _kept_by_moe_mlp(m: ModelConfig, tokens: int, ep: int) -> float:
    """Bytes one MoE MLP keeps after its forward (its output included), on meta."""
    from megalite.observe.memory_tracker import MemoryTracker
    from megalite.model.gpt import TransformerBlock

    ep_group = None
    if ep > 1:
        from megalite.device import init_distributed
        from megalite.parallel.grid import build_grid

        init_distributed(torch.device("meta"), ep, 0, None, fake=True)
        ep_group = build_grid(ParallelConfig(expert_model_parallel_size=ep), ep, 0, ep, experts=True).ep_group
    try:
        with torch.device("meta"):
            block = TransformerBlock(m, moe=True, ep_group=ep_group).to(torch.bfloat16).train()
        x = torch.empty(tokens, 1, m.hidden_size, device="meta", dtype=torch.bfloat16, requires_grad=True)
        tracker = MemoryTracker()
        tracker.register([*block.parameters(), x], "parameters")
        with tracker:
            before = tracker.live
            out = block.mlp(x)
            kept = tracker.live - before
        del out
        return kept
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("kw,ep", [({}, 1), ({}, 4), (dict(swiglu=False, moe_router_topk=1), 2),
                                   (dict(moe_shared_expert_intermediate_size=96), 2)])
def test_routed_activations_match_the_layer(kw, ep):
    """What one MoE MLP keeps for backward (one sequence of T tokens, no TP) against the arithmetic:
    the routed part, the shared expert's intermediates (its input is the block's, not counted
    here) and the layer's output."""
    T = 512
    m = moe_model(hidden_size=256, moe_ffn_hidden_size=320, seq_length=T, **kw)
    measured = _kept_by_moe_mlp(m, T, ep)
    B, h = 2, m.hidden_size
    shared = planning.mlp_activation_bytes(m, m.moe_shared_expert_intermediate_size or 0, micro=1)
    shared -= B * T * h if m.moe_shared_expert_intermediate_size else 0
    planned = planning.routed_activation_bytes(m, 1, ep=ep) + shared + B * T * h
    assert measured == pytest.approx(planned, rel=0.005), (kw, ep)


# -- the layout search ------------------------------------------------------------------------------

def test_layouts_with_experts():
    m, hw = moe_model(num_layers=4, hidden_size=256, seq_length=256), Hardware(24, 8, 1)
    assert Layout(tp=2, dp=4, ep=4).describe() == "TP 2 (SP) x DP 4, EP 4, ZeRO-0, recompute none"
    assert Layout(tp=2, dp=4).describe() == "TP 2 (SP) x DP 4, ZeRO-0, recompute none"
    eps = {lay.ep for lay in candidate_layouts(m, hw) if lay.tp * lay.cp * lay.dp == 8}
    assert eps == {1, 2, 4, 8}
    assert {lay.ep for lay in candidate_layouts(dataclasses.replace(m, num_experts=None), hw)} == {1}
    assert "--zero-stage 3 with --num-experts" in check_layout(m, Layout(dp=8, zero=3, ep=2), 16, 1, hw)
    assert "must divide" in check_layout(m, Layout(tp=2, cp=2, dp=2, ep=16), 16, 1, hw)
    p = plan(m, hw, 16, 1)
    assert p.choice is not None and p.estimates and all(e.layout.zero != 3 for e in p.estimates)
    with_ep = next(e for e in p.estimates if e.layout.ep == 4 and e.layout.zero == 1)
    assert {"ep", "edp"} <= set(with_ep.comm) and with_ep.comm["ep"]["link"] == "NVLink"


def test_cli_plans_an_moe_model(capsys):
    from tools.plan_parallel import main

    assert main(["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
                 "--vocab-size", "32000", "--swiglu", "--num-experts", "16", "--moe-ffn-hidden-size", "1024",
                 "--moe-layer-freq", "[1,0,1,0,1,0,1,0]", "--global-batch-size", "32", "--gpu-memory-gb", "8",
                 "--gpus-per-node", "8", "--flash-attention"]) == 0
    text = capsys.readouterr().out
    assert "4 MoE layers x 16 experts" in text and " EP " in text and "Recommended:" in text


# -- (b), (c) the meta dry run of 16-rank MoE layouts against the planner ----------------------------

# Global batch 8: at DP 4, 2 micro-batches per step, the pipeline's depth (1F1B's peak; the
# traffic formulas below scale with the count); a meta step's time grows with the count.
MODEL = ["--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024", "--vocab-size", "1000",
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--moe-aux-loss-coeff", "1e-2", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
         "--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "2", "--mock-data"]
DRY_RUNS = {
    # EP groups of 4 ranks across TP 2 x DP 2 (SP), two pipeline stages, ZeRO-1 (experts over EDP 2)
    "tp2-pp2-dp4-ep4-zero1": ["--moe-ffn-hidden-size", "1024", "--tensor-model-parallel-size", "2",
                              "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                              "--expert-model-parallel-size", "4", "--zero-stage", "1"],
    # every rank of a stage in one EP group (EDP 1), ZeRO-2 with overlapped per-micro-batch reduce-scatter
    "tp2-pp2-dp4-ep8-zero2": ["--moe-ffn-hidden-size", "2048", "--tensor-model-parallel-size", "2",
                              "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                              "--expert-model-parallel-size", "8", "--zero-stage", "2", "--overlap-grad-reduce"],
    # a dense first layer, then MoE layers with a shared expert (TP-split), EP 4 (EDP 2). (With EP
    # equal to TP the two kinds share one communicator and the dry run reports the bytes under 'tp'.)
    "tp2-pp2-dp4-ep4-zero1-pattern-shared": ["--moe-ffn-hidden-size", "2048", "--moe-layer-freq", "[0,1,1,1]",
                                             "--moe-shared-expert-intermediate-size", "1024",
                                             "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                             "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size",
                                             "4", "--zero-stage", "1"],
    # ZBV: two chunks a rank, the micro-batches of the other chunk held beside the one whose MoE layer
    # runs (planned once, not twice: the Mixtral recipe's TP 2 x PP 2 zbv x EP 8 read 8.8% over)
    "tp2-pp2-dp4-ep4-zero1-zbv": ["--moe-ffn-hidden-size", "2048", "--tensor-model-parallel-size", "2",
                                  "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                                  "--pipeline-schedule", "zbv", "--expert-model-parallel-size", "4",
                                  "--zero-stage", "1"],
    # the interleaved 1F1B, two chunks a rank (V = 2): the same count, and each chunk's received input
    "tp2-pp2-dp4-ep4-zero1-interleaved": ["--moe-ffn-hidden-size", "2048", "--tensor-model-parallel-size", "2",
                                          "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                                          "--num-layers-per-virtual-pipeline-stage", "1",
                                          "--expert-model-parallel-size", "4", "--zero-stage", "1"],
}


@pytest.fixture(scope="module")
def dry_runs():
    from megalite.arguments import build_parser, config_from_args
    from megalite.config import validate
    from megalite.parallel.grid import GridLayout
    from tools.dry_run import measure_layout

    out = {}
    for name, flags in DRY_RUNS.items():
        flags = MODEL + flags
        config = config_from_args(build_parser().parse_args(flags), 1000)
        validate(config, 16, 8)
        layout = GridLayout.from_config(config.parallel, 16, experts=True)
        out[name] = (layout, config, list(measure_layout(flags, config, layout, 8)))
    return out


@pytest.mark.parametrize("name", sorted(DRY_RUNS))
def test_dry_run_memory_within_5_percent_of_the_planner(dry_runs, name):
    layout, _, roles = dry_runs[name]
    assert [r["stage"] for r in roles] == list(range(layout.pp))
    for role in roles:
        planned = role["planned_categories"]
        measured = role["categories"]
        assert measured["parameters"] == planned["weights"], (name, role["role"])  # model state: exact
        assert abs(role["difference"]) < 0.05, (name, role["role"], role["measured_bytes"], role["planned_bytes"])


@pytest.mark.parametrize("name", sorted(DRY_RUNS))
def test_dry_run_expert_traffic_equals_the_planner(dry_runs, name):
    """Bytes handed to the EP group's all-to-alls (input = output size: T k h B per call, 4 per MoE
    layer and micro-batch, plus the E counts) and to the EDP group's expert-gradient reductions,
    as ring wire bytes, equal the planner's formulas (up to the 4-byte gradient-norm all-reduce)."""
    layout, config, roles = dry_runs[name]
    m, t = config.model, config.train
    num_micro = t.global_batch_size // (t.micro_batch_size * layout.dp)
    for role in roles:
        stage = role["stage"]
        n_moe = planning.stage_moe_layers(m, layout.pp, stage)
        rows = m.seq_length * t.micro_batch_size // layout.tp * m.moe_router_topk  # T k, SP under TP
        handed = num_micro * n_moe * (4 * rows * m.hidden_size * 2 + 8 * m.num_experts)
        assert role["comm_bytes"]["ep"] == pytest.approx(handed, abs=8), (name, stage)
        wire, planned = role["expert_comm_wire_bytes"], role["planned_comm_wire_bytes"]
        assert wire["ep"] == pytest.approx(planned["ep"], rel=1e-6), (name, stage)
        if layout.edp > 1:
            assert wire["edp"] == pytest.approx(planned["edp"], rel=1e-6), (name, stage)
        else:
            assert "edp" not in planned
