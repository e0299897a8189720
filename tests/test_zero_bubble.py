"""Zero-bubble pipelines (--pipeline-schedule zb-h1 / zbv): the B/W split, the operation lists,
and the GPT against the serial computation.

- The split alone (no pipeline) gives bit-identical gradients to the fused backward: GPT-2 and
  Llama styles, tensor parallel with and without sequence parallelism, mixture of experts
  (loop and grouped GEMM), full recomputation.
- Every schedule's operation lists hold each (micro-batch, chunk) F, B and W once, and the
  simulation of them finishes (no rank waits forever) for P = 2..4 and M = 1..3P; its bubble
  is the closed form for ZB-H1 (M >= P) and below interleaved's for ZBV.
- Both schedules at P = 2 and 4, M from P - 1 to 3P, GPT-2 and Llama styles, with TP2 + SP:
  the loss and every gradient equal the serial model's (fp32, 1e-5 relative).
- Each rank's trace shows every F, B and W once, in an order that respects their dependencies
  across ranks.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline import MICRO, _check, _num_params, _pipeline_worker, cases, make_config, micro_batches  # noqa: E402

from megalite.config import ConfigError, ModelConfig, validate  # noqa: E402
from megalite.layers.weight_grad import WeightGradStore, split_weight_gradients  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.grid import build_grid  # noqa: E402
from megalite.pipeline.op_lists import (global_chunk, num_chunks, rank_ops, simulate,  # noqa: E402
                                        theory_bubble)
from megalite.pipeline.partition import build_model_chunks  # noqa: E402
from megalite.pipeline.trace import Trace  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.train.step import forward_backward  # noqa: E402


# -- the split alone -----------------------------------------------------------------------------
def _grads(model, batch, split: bool):
    model.zero_grad(set_to_none=True)
    store = WeightGradStore()
    with split_weight_gradients(store) if split else torch.enable_grad():
        losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        with store.collecting("b") if split else torch.enable_grad():
            losses.mean().backward()
        if split:
            assert len(store) > 0 and all(p.grad is None for n, p in model.named_parameters()
                                          if n.endswith(("fc1.weight", "qkv.weight", "word_embeddings.weight")))
            store.run("b")
    assert len(store) == 0
    return {n: p.grad.clone() for n, p in model.named_parameters()}


SPLIT_MODELS = {
    "gpt2": dict(),
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                  add_bias_linear=False),
    "gpt2-untied-full-recompute": dict(untie_embeddings_and_output_weights=True, recompute_granularity="full"),
    "moe-loop": dict(num_experts=4, moe_router_topk=2, swiglu=True, add_bias_linear=False),
    "moe-grouped-gemm": dict(num_experts=4, moe_router_topk=2, swiglu=True, add_bias_linear=False,
                             moe_grouped_gemm=True),
}
SLOW_SPLIT = {"moe-grouped-gemm", "gpt2-untied-full-recompute"}  # the Triton interpreter; a second GPT-2


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW_SPLIT else ())
                                  for n in SPLIT_MODELS])
def test_bw_split_alone_gives_bit_identical_gradients(name):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                      hidden_dropout=0.0, attention_dropout=0.0, **SPLIT_MODELS[name])
    model = GPTModel(cfg)
    model.init_weights(7)
    batch = micro_batches(cfg, 1, seed=4)[0]
    fused, split = _grads(model, batch, False), _grads(model, batch, True)
    assert fused.keys() == split.keys()
    for n in fused:
        assert torch.equal(fused[n], split[n]), n


def _tp_split_worker(rank, world, sp):
    from megalite.config import ParallelConfig
    cfg = make_config(2, tp=2, sp=sp).model
    grid = build_grid(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp), world, rank)
    model = GPTModel(cfg, tp_group=grid.tp_group, sequence_parallel=sp)
    model.init_weights(7)
    batch = micro_batches(cfg, 1, seed=4)[0]
    fused, split = _grads(model, batch, False), _grads(model, batch, True)
    return [n for n in fused if not torch.equal(fused[n], split[n])]


@pytest.mark.parametrize("sp", [False, True])
def test_bw_split_under_tensor_and_sequence_parallel_is_bit_identical(sp):
    assert run_world(_tp_split_worker, 2, sp) == [[], []]


# -- the operation lists ------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "1f1b"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_operation_appears_once_and_the_schedule_finishes(schedule, P):
    V = num_chunks(schedule)
    for M in range(1, 3 * P + 1):
        for rank in range(P):
            ops = rank_ops(schedule, P, M, rank)
            kinds = ("F", "B", "W") if schedule != "1f1b" else ("F", "BW")
            assert sorted((o.kind, o.micro, o.chunk) for o in ops) == sorted(
                (k, m, c) for k in kinds for m in range(M) for c in range(V))
        sim = simulate(schedule, P, M)  # raises if a rank waits forever
        for rank, timed in enumerate(sim.timed):
            done = {}
            for op, start, end in timed:  # F before B before W of the same chunk
                done[(op.kind, op.micro, op.chunk)] = end
                if op.kind in ("B", "BW"):
                    assert done[("F", op.micro, op.chunk)] <= start
                if op.kind == "W":
                    assert done[("B", op.micro, op.chunk)] <= start


def test_simulated_bubbles():
    for P in (2, 4):
        for M in range(P, 3 * P + 1):
            assert simulate("1f1b", P, M).bubble() == pytest.approx((P - 1) / (M + P - 1))
            assert simulate("zb-h1", P, M).bubble() == pytest.approx((P - 1) / (3 * M + P - 1))
            assert theory_bubble("zbv", P, M) < theory_bubble("1f1b", P, M, virtual=2)
    # ZB-H1 keeps 1F1B's in-flight activations and at most p micro-batches of W inputs on stage p.
    sim = simulate("zb-h1", 4, 8)
    assert [sim.peak_counts(p) for p in range(4)] == [(4 - p, p) for p in range(4)]
    # ZBV: at most 2P chunk activations (P stages' worth: 1F1B's stage-0 peak) on every rank.
    sim = simulate("zbv", 4, 8)
    assert all(sim.peak_counts(p)[0] <= 8 and sim.peak_counts(p)[1] <= 2 * 4 - 3 for p in range(4))


def test_zbv_places_chunks_in_a_v():
    assert [(global_chunk("zbv", 4, p, 0), global_chunk("zbv", 4, p, 1)) for p in range(4)] == \
        [(0, 7), (1, 6), (2, 5), (3, 4)]


# -- the GPT against the serial model -----------------------------------------------------------
P2_CASES = cases(2, [(4, {"schedule": s, "variant": v}, m) for s in ("zb-h1", "zbv")
                     for v, ms in (("gpt2", (1, 2, 3, 4, 6)), ("llama", (2, 5))) for m in ms])


def _check_variants(results, todo):
    for variant in ("gpt2", "llama"):
        idx = [i for i, c in enumerate(todo) if c["config"].get("variant", "gpt2") == variant]
        if idx:
            layers = todo[idx[0]]["config"]["layers"]
            _check([[r[i] for i in idx] for r in results], _num_params(layers, variant))


def test_zero_bubble_pp2_matches_serial():
    _check_variants(run_world(_pipeline_worker, 2, P2_CASES), P2_CASES)


P4_CASES = cases(4, [(8, {"schedule": s, "variant": v}, m) for s in ("zb-h1", "zbv")
                     for v, ms in (("gpt2", (3, 4, 5, 8, 12)), ("llama", (4, 7))) for m in ms])


@pytest.mark.slow
def test_zero_bubble_pp4_matches_serial():
    _check_variants(run_world(_pipeline_worker, 4, P4_CASES, timeout=300), P4_CASES)


TP_CASES = [{"config": dict(layers=4, pp=2, tp=2, sp=True, schedule="zb-h1"), "m": 3},
            {"config": dict(layers=4, pp=2, tp=2, sp=True, schedule="zbv"), "m": 4},
            {"config": dict(layers=4, pp=2, tp=2, schedule="zbv"), "m": 2}]


def test_zero_bubble_with_tensor_and_sequence_parallel_matches_serial():
    _check_variants(run_world(_pipeline_worker, 4, TP_CASES), TP_CASES)


# -- traces ---------------------------------------------------------------------------------------
def _trace_worker(rank, world, schedule, m):
    config = make_config(2 * world, pp=world, schedule=schedule)
    config.train.global_batch_size = MICRO * m
    validate(config, world)
    grid = build_grid(config.parallel, world, rank)
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(3)
    trace = Trace()
    forward_backward(chunks, micro_batches(config.model, m), config.train, grid=grid, trace=trace)
    return trace.events


@pytest.mark.parametrize("schedule,world,m", [pytest.param("zb-h1", 4, 6, marks=pytest.mark.slow),
                                              ("zbv", 4, 5), pytest.param("zbv", 2, 3, marks=pytest.mark.slow)])
def test_each_rank_runs_every_f_b_w_once_in_dependency_order(schedule, world, m):
    events = run_world(_trace_worker, world, schedule, m)
    V = num_chunks(schedule)
    S = world * V
    at = {}
    for rank, evs in enumerate(events):
        assert sorted((e[0], e[1], e[2]) for e in evs) == sorted(
            (k, mb, c) for k in "FBW" for mb in range(m) for c in range(V))
        for op, micro, c, start, end in evs:
            at[(op, micro, global_chunk(schedule, world, rank, c))] = (start, end)
    for (op, micro, g), (start, _) in at.items():
        if op == "F" and g > 0:
            assert at[("F", micro, g - 1)][1] <= start
        if op == "B":
            assert at[("F", micro, g)][1] <= start
            if g < S - 1:
                assert at[("B", micro, g + 1)][1] <= start
        if op == "W":
            assert at[("B", micro, g)][1] <= start


# -- rules ----------------------------------------------------------------------------------------
ZB_RULES = [
    (dict(layers=6, pp=2, schedule="zbv"), 2, ["zbv cuts the 6 layers into 2 x PP = 4", "multiple of 4"]),
    (dict(layers=4, pp=1, schedule="zb-h1"), 1, ["zb-h1 needs --pipeline-model-parallel-size > 1"]),
    (dict(layers=8, pp=2, vp_layers=2, schedule="zbv"), 2, ["--num-layers-per-virtual-pipeline-stage",
                                                            "zbv always holds 2 chunks"]),
]


@pytest.mark.parametrize("cfg,world,fragments", ZB_RULES)
def test_zero_bubble_rules(cfg, world, fragments):
    config = make_config(**cfg)
    config.train.global_batch_size = MICRO * 4
    with pytest.raises(ConfigError) as e:
        validate(config, world)
    for f in fragments:
        assert f in str(e.value)


def test_zero_bubble_refuses_transformer_engine():
    config = make_config(4, pp=2, schedule="zbv")
    config.model.transformer_impl = "transformer_engine"
    with pytest.raises(ConfigError, match="--transformer-impl transformer_engine"):
        from megalite.pipeline.checks import check_pipeline_schedule
        check_pipeline_schedule(config.model, config.parallel, config.train)


# -- memory ---------------------------------------------------------------------------------------
def _memory_worker(rank, world, m):
    """Peak bytes allocated during the step (memory tracker) under 1F1B and ZB-H1, and the
    W inputs one micro-batch keeps between its B and its W (counted by the store)."""
    from megalite.observe.memory_tracker import MemoryTracker
    from megalite.pipeline import executor
    config = make_config(4, pp=world)
    config.train.global_batch_size = MICRO * m
    grid = build_grid(config.parallel, world, rank)
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(3)
    batches = micro_batches(config.model, m)
    peaks, w_inputs = {}, []
    real = executor.ScheduleExecutor.run

    def run(self, *a):
        real(self, *a)
        w_inputs.append(self.w_input_bytes)

    executor.ScheduleExecutor.run = run
    for schedule in ("1f1b", "zb-h1", "1f1b"):  # 1F1B twice: the first run warms up lazy state
        config.train.pipeline_schedule = schedule
        for c in chunks:
            c.zero_grad(set_to_none=True)
        with MemoryTracker() as tracker:
            forward_backward(chunks, batches, config.train, grid=grid)
        peaks[schedule] = tracker.peak
    executor.ScheduleExecutor.run = real
    shape = (config.model.seq_length, MICRO, config.model.hidden_size)
    return peaks, max(w_inputs), torch.Size(shape).numel() * 4  # the zb-h1 run's (1F1B's BW keeps none)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zb_h1_memory_is_1f1b_plus_the_w_inputs_of_p_micro_batches(world):
    """Stage p under ZB-H1 holds at most 1F1B's P - p micro-batches of activations, and W
    inputs (the inputs of its linears and the gradients of their outputs) of at most p + 1
    micro-batches: right after B of micro-batch j, the W's of j - p .. j wait. So
    peak(ZB-H1) <= peak(1F1B) + (p + 1) * W_inputs, where W_inputs is what the store keeps
    for one micro-batch (counted by storage, so shared inputs count once)."""
    for p, (peaks, w_inputs, message) in enumerate(run_world(_memory_worker, world, 3 * world)):
        assert w_inputs > 2 * message  # a layer's linears keep several activation-sized tensors
        bound = peaks["1f1b"] + (p + 1) * w_inputs
        assert peaks["zb-h1"] <= bound, (p, peaks, w_inputs)
        print(f"P={world} stage {p}: 1F1B {peaks['1f1b']} B, ZB-H1 {peaks['zb-h1']} B "
              f"(+{(peaks['zb-h1'] - peaks['1f1b']) / w_inputs:.2f} W inputs), W inputs {w_inputs} "
              f"B/micro-batch, bound {bound}")
