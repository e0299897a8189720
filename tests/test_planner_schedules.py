"""The planner's pipeline schedules (megalite/planner/pipeline.py): each schedule's bubble is
megalite.pipeline.op_lists' theory, ZB-H1's memory per stage is (P-p) A + p Wi (or, when the W
inputs outweigh the activations, the state right after a B), ZBV's follows the simulation's
peak counts, the W inputs of a layer are the sum the docstring gives, and the planner picks a
zero-bubble schedule when it fits and is faster, falls back to 1F1B when the W inputs do not
fit, never proposes ZBV when the layers do not divide into 2P chunks, and prints flags that
pretrain_gpt.py parses and megalite validates."""
from __future__ import annotations

import dataclasses

import pytest

from megalite.arguments import build_parser as pretrain_parser
from megalite.arguments import config_from_args
from megalite.config import ModelConfig, validate
from megalite.planner.estimate import stage_memory
from megalite.planner.search import candidate_layouts, explain, plan
from megalite.pipeline.op_lists import simulate, theory_bubble
from megalite.planner import (
    GiB,
    Hardware,
    Layout,
    estimate,
    layer_activation_bytes,
    precision,
    stage_parameters,
)
from megalite.planner.flags import grads_in_fp32, pretrain_flags
from megalite.planner.pipeline import (
    bubble,
    held_bytes,
    held_states,
    p2p_factor,
    same_layout,
    schedules,
    simulated_micro_max,
    stage_activation_bytes,
    w_gradient_chunk_bytes,
    w_input_chunk_bytes,
    w_input_layer_bytes,
    virtual_stages,
)
from megalite.planner.step_time import exposed_calls
from tools import plan_parallel

PREC = precision("bf16", grads_in_fp32("bf16"))  # the planner's default: fp32 gradients under bf16

# A model whose first fitting layout on 4 single-GPU nodes is PP 4 (below), and one whose first
# on 2 nodes of 4 GPUs is TP 4 x PP 2 (tiny vocabulary: the layers dominate every stage).
PP4_ARGV = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--vocab-size", "512",
            "--seq-length", "256", "--global-batch-size", "8", "--micro-batch-size", "1", "--gpus-per-node", "1",
            "--nodes", "4"]


def pp4_model() -> ModelConfig:
    return plan_parallel.model_from_args(plan_parallel.build_parser().parse_args(PP4_ARGV + ["--gpu-memory-gb", "1"]))


def tp4_pp2_model() -> ModelConfig:
    return ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=8, vocab_size=512, seq_length=1024)


def _simulated_states(schedule: str, P: int, M: int, rank: int, virtual: int = 1) -> set:
    """(B pending, W pending, W running) per chunk right after each F and each B (or fused BW) and
    while each W runs, walked here from the simulation."""
    chunks = 2 if schedule == "zbv" else virtual
    n, w, out = [0] * chunks, [0] * chunks, set()
    for op, _, _ in simulate(schedule, P, M, virtual=virtual).timed[rank]:
        if op.kind == "W":
            out.add((tuple(n), tuple(w), tuple(int(c == op.chunk) for c in range(chunks))))
            w[op.chunk] -= 1
            continue
        n[op.chunk] += 1 if op.kind == "F" else -1
        w[op.chunk] += op.kind == "B"
        out.add((tuple(n), tuple(w), (0,) * chunks))
    return out


# -- bubble -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
@pytest.mark.parametrize("P", [2, 4])
def test_bubble_is_theory_bubble(schedule, P):
    for M in (1, 2, 3, 4, 8, 16, 24):
        assert bubble(schedule, P, M) == pytest.approx(theory_bubble(schedule, P, M), rel=1e-12), (schedule, P, M)
    if schedule == "zb-h1":  # the closed form, for M >= P, is the simulation's
        assert bubble(schedule, P, 8) == pytest.approx((P - 1) / (3 * 8 + P - 1), rel=1e-12)
    # beyond the simulated range: ZB-H1's closed form; ZBV's idle time per rank held constant,
    # within 0.1 point of the simulation (its greedy order idles 1 or 2 units by M's parity at P = 2)
    M = simulated_micro_max(P) + 3
    exact = 1e-9 if schedule != "zbv" else 1e-3
    assert bubble(schedule, P, M) == pytest.approx(theory_bubble(schedule, P, M), abs=exact), (schedule, P, M)


def test_estimate_carries_its_schedules_bubble():
    m = pp4_model()
    for s in ("1f1b", "zb-h1", "zbv"):
        e = estimate(m, Layout(pp=4, schedule=s), 8, 1, PREC, Hardware(80, 1, 4))
        assert e.num_micro == 8 and e.bubble == pytest.approx(theory_bubble(s, 4, 8), rel=1e-12)
    assert estimate(m, Layout(dp=4), 8, 1, PREC, Hardware(80, 1, 4)).bubble == 0  # PP 1: as before


# -- memory -----------------------------------------------------------------------------------------

def test_w_inputs_of_a_layer_by_hand():
    """GPT (FFN 4h, no GQA), per token of one micro-batch, elements: t = 1: x 1 + 1 + 1 + 4 h,
    dy 3 + 1 + 4 + 1 h = 16 h; t = 8 under SP: x (1 + 1 + 1 + 4)/8 h, dy 3/8 + 1 + 4/8 + 1 h =
    3.75 h (the row-parallel outputs' gradients stay whole). 2 bytes each."""
    m = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=1000, seq_length=512)
    sbh = 512 * 2 * 1024
    assert w_input_layer_bytes(m, micro=2) == 2 * 16 * sbh
    assert w_input_layer_bytes(m, micro=2, tp=8, sp=True) == pytest.approx(2 * 3.75 * sbh)
    assert w_input_layer_bytes(m, micro=2, cp=2) == pytest.approx(w_input_layer_bytes(m, micro=2) / 2)
    # the first chunk adds the embedding's dy and ids, the last the output layer's x and dy (logits)
    layers = 2 * w_input_layer_bytes(m, micro=2)
    vocab = m.padded_vocab_size(1)
    assert w_input_chunk_bytes(m, 2, 0, 2, 1, False, 1, 2) == layers + 512 * 2 * (2 * 1024 + 8)
    assert w_input_chunk_bytes(m, 2, 1, 2, 1, False, 1, 2) == layers + 2 * 512 * 2 * (1024 + vocab)


def test_w_gradients_of_a_running_w_by_hand():
    """What a running W adds to its chunk's W inputs: twice (dW and AccumulateGrad's copy) the
    largest weight it takes with all inputs held (a layer's fc1 or QKV, the output layer on the
    last chunk), or the word embedding's, last on the first chunk, once the chunk's other W
    inputs are gone; with the loop of experts, every expert dW of the chunk at once at the end."""
    m = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=50000, seq_length=512)
    e, t, h = PREC.weight_bytes, 2, 1024
    vocab = m.padded_vocab_size(t) * h / t  # 25 M elements against a layer's 2 M
    layer_max = 4 * h * h / t  # fc1 (GeLU, f = 4h) and fc2 alike; QKV is 3 h h / t
    assert w_gradient_chunk_bytes(m, 4, 1, 1, t, 1, 1, PREC, 1e9) == 2 * e * layer_max  # a middle chunk
    assert w_gradient_chunk_bytes(m, 4, 3, 1, t, 1, 1, PREC, 1e9) == 2 * e * vocab  # the output layer
    emb_in = 512 * (PREC.act_bytes * h + 8)
    wi = emb_in + 2e5  # tiny W inputs besides the embedding's: the embedding's dW decides
    assert w_gradient_chunk_bytes(m, 4, 0, 1, t, 1, 1, PREC, wi) == pytest.approx(2 * e * vocab - 2e5)
    assert w_gradient_chunk_bytes(m, 4, 0, 1, t, 1, 1, PREC, 1e12) == 2 * e * layer_max
    # MoE, every layer, 8 experts over EP 2, SwiGLU: the loop's final backward holds the chunk's
    # expert dWs (one layer per chunk of 4: 4 experts x 3 f h) and the stack of w1 (4 x 2 f h),
    # its W inputs gone
    moe = dataclasses.replace(m, num_experts=8, moe_ffn_hidden_size=512, swiglu=True)
    expert_dw = 4 * 3 * 512 * h
    assert w_gradient_chunk_bytes(moe, 4, 1, 1, t, 1, 2, PREC, 1e6) == e * expert_dw + e * 4 * 2 * 512 * h - 1e6
    grouped = dataclasses.replace(moe, moe_grouped_gemm=True)  # the stacked w1 is one deferred weight
    assert w_gradient_chunk_bytes(grouped, 4, 1, 1, t, 1, 2, PREC, 0.0) == 2 * e * 4 * 2 * 512 * h


@pytest.mark.parametrize("tp", [1, 4])
def test_zb_h1_memory_per_stage(tp):
    """Stage p holds (P-p) A + p Wi right after an F and (P-p-1) A + (p+1) Wi + G while the W
    that follows each B runs (G: :func:`w_gradient_chunk_bytes`). With Wi + G <= A
    the first is the peak, (P-p) A + p Wi; with Wi > A (TP 4 under SP: 11 against 8.5 s b h
    bytes per layer) the second."""
    m, P, M = tp4_pp2_model(), 4, 8
    for p in range(P):
        one = Layout(tp=tp, pp=P, schedule="1f1b")
        A = stage_activation_bytes(m, one, p, 1, 1, PREC, flash_attention=True)  # one micro-batch in flight
        Wi = w_input_chunk_bytes(m, P, p, 1, tp, tp > 1, 1, PREC.act_bytes)
        G = w_gradient_chunk_bytes(m, P, p, 1, tp, 1, 1, PREC, Wi)
        states = _simulated_states("zb-h1", P, M, p)
        after_f, during_w = ((P - p,), (p,), (0,)), ((P - p - 1,), (p + 1,), (1,))
        assert held_states("zb-h1", P, M, p) == (during_w, after_f)
        assert {after_f, during_w} <= states  # the two candidates occur ...
        assert all(any(all(x >= y for x, y in zip(sum(c, ()), sum(s, ()))) for c in (after_f, during_w))
                   for s in states)  # ... and dominate every other state
        detail: dict = {}
        zb = stage_activation_bytes(m, dataclasses.replace(one, schedule="zb-h1"), p, 1, M, PREC, True, detail)
        assert zb == pytest.approx(max((P - p) * A + p * Wi, (P - p - 1) * A + (p + 1) * Wi + G), rel=1e-12)
        if Wi + G <= A:
            assert zb == pytest.approx((P - p) * A + p * Wi, rel=1e-12)
        if tp == 4:
            assert Wi > A and detail["held"] == during_w
        assert detail["w_inputs"] == pytest.approx(detail["held"][1][0] * Wi)


def test_recomputation_adds_to_f_and_b_not_to_a_running_w():
    """Under full recomputation the layer recomputed in B adds to what is held right after an F
    or a B, not to the W state (no F or B runs during a W): ZB-H1's stage p holds
    max((P-p) A + p Wi + R, (P-p-1) A + (p+1) Wi + G), R the recomputed layer (TP 4: the W
    state wins on the later stages, as the dry run of a 13B at TP 2 x PP 2 measures)."""
    m, P, M, tp = tp4_pp2_model(), 4, 8, 4
    R = layer_activation_bytes(m, micro=1, tp=tp, sp=True, recompute="none", act_bytes=PREC.act_bytes,
                               flash_attention=True)
    for p in range(P):
        one = Layout(tp=tp, pp=P, schedule="1f1b", recompute="full")
        A = stage_activation_bytes(m, one, p, 1, 1, PREC, flash_attention=True) - R
        Wi = w_input_chunk_bytes(m, P, p, 1, tp, True, 1, PREC.act_bytes)
        G = w_gradient_chunk_bytes(m, P, p, 1, tp, 1, 1, PREC, Wi)
        zb = stage_activation_bytes(m, dataclasses.replace(one, schedule="zb-h1"), p, 1, M, PREC, True)
        assert zb == pytest.approx(max((P - p) * A + p * Wi + R, (P - p - 1) * A + (p + 1) * Wi + G), rel=1e-12)
        assert zb < (P - p - 1) * A + (p + 1) * Wi + G + R  # the recomputed layer is not added to W's


@pytest.mark.parametrize("P,M", [(2, 8), (4, 4), (4, 8), (4, 16)])
def test_zbv_memory_follows_the_simulation(P, M):
    """ZBV's held activations are the simulation's: with W inputs negligible against the
    activations, rank r's peak is Simulation.peak_counts(r)'s activations; in general the most
    over the states after each F and each B, weighted per chunk."""
    sim = simulate("zbv", P, M)
    for r in range(P):
        n_act, n_w = sim.peak_counts(r)
        peak, state = held_bytes("zbv", P, M, r, [1.0, 1.0], [1e-6, 1e-6])
        assert peak == pytest.approx(n_act + 1e-6 * n_w) and sum(state[0]) == n_act
        assert n_act <= 2 * P  # at most P stages' worth: 1F1B's stage-0 peak
        a, w, g = [1.0, 0.7], [0.9, 1.3], [0.5, 2.0]
        expected = max(sum(x * y for x, y in zip(ns + ws + rs, a + w + g))
                       for ns, ws, rs in _simulated_states("zbv", P, M, r))
        assert held_bytes("zbv", P, M, r, a, w, g)[0] == pytest.approx(expected)


@pytest.mark.parametrize("untie", [False, True])
def test_zbv_parameters_put_embedding_and_output_on_rank_0(untie):
    """ZBV: rank p holds chunks p and 2P-1-p, so rank 0 the embedding and the output layer
    (tied: megalite's loss chunk keeps its copy of the embedding there, as 1F1B's last stage
    does), the other ranks only layers; the pipeline holds what 1F1B's stages hold."""
    m = dataclasses.replace(tp4_pp2_model(), untie_embeddings_and_output_weights=untie)
    for P in (2, 4):
        one = [stage_parameters(m, 1, P, p) for p in range(P)]
        v = [stage_parameters(m, 1, P, p, schedule="zbv") for p in range(P)]
        assert sum(v) == sum(one)
        middle = stage_parameters(m, 1, 2 * P, 1)  # a chunk of L/(2P) layers, nothing else
        assert v[1:] == [2 * middle] * (P - 1) and v[0] == sum(one) - 2 * middle * (P - 1)
        embedding = m.padded_vocab_size(1) * m.hidden_size
        assert v[0] == 2 * middle + 2 * embedding + m.max_position_embeddings * m.hidden_size + 2 * m.hidden_size


# -- which schedules ------------------------------------------------------------------------------

def test_zbv_only_where_layers_divide_into_2p_and_zb_only_local():
    m = ModelConfig(num_layers=12, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64)
    assert schedules(m, 1) == ("1f1b",)
    assert schedules(m, 2) == ("1f1b", "zb-h1", "zbv")  # 12 layers = 4 chunks of 3
    assert schedules(m, 4) == ("1f1b", "zb-h1")  # 12 layers in 8 chunks: no
    assert schedules(m, 3) == ("1f1b", "zb-h1", "zbv")
    assert schedules(dataclasses.replace(m, transformer_impl="transformer_engine"), 2) == ("1f1b",)
    assert schedules(m, 2, zero=1) == schedules(m, 2, zero=2) == schedules(m, 2)  # ZeRO-2: buckets per chunk
    assert schedules(m, 2, zero=3) == ("1f1b",)
    layouts = candidate_layouts(m, Hardware(80, 4, 4), max_cp=1)
    for lay in layouts:
        assert lay.schedule in schedules(m, lay.pp, lay.zero)
        assert lay.schedule != "zbv" or m.num_layers % (2 * lay.pp) == 0
        assert lay.schedule == "1f1b" or lay.zero <= 2  # ZeRO-3 under the B/W split: not planned
    assert {lay.schedule for lay in layouts if lay.pp == 4} == {"1f1b", "zb-h1"}
    assert {lay.schedule for lay in layouts if lay.pp == 1} == {"1f1b"}
    p = plan(m, Hardware(0.05, 4, 4), 64, 1, max_cp=1)
    assert not [e for e in p.estimates if e.layout.schedule == "zbv" and m.num_layers % (2 * e.layout.pp)]


# -- the choice ------------------------------------------------------------------------------------

def _pp4_plan(tflops: float = Hardware.achieved_tflops, max_cp: int = 8):
    """The PP 4 model on 4 single-GPU nodes with memory for every PP 4 schedule (checked: no
    earlier layout of the ladder fits: the first test asserts it); ``max_cp``: the largest CP
    searched (at 1 TFLOP/s, compute-bound, CP 2 x DP 2 without a bubble is faster: issue 40)."""
    m = pp4_model()
    hw = Hardware(80, 1, 4)
    totals = {s: estimate(m, Layout(pp=4, schedule=s), 8, 1, PREC, hw, True).memory["total"]
              for s in schedules(m, 4)}
    usable = max(totals.values()) * 1.001
    return m, totals, plan(m, Hardware(usable / GiB / 0.9, 1, 4, achieved_tflops=tflops), 8, 1, max_cp=max_cp)


def test_planner_picks_a_zero_bubble_schedule_when_it_fits():
    """P = 4, M = 8: the bubble is 27% under 1F1B, 11% under ZB-H1 and 6% under ZBV; ZBV's
    middle ranks send twice 1F1B's PP traffic. The fastest that fits wins, by the step time."""
    _, totals, p = _pp4_plan()
    assert set(totals) == {"1f1b", "zb-h1", "zbv"}
    chosen = p.choice
    assert chosen.layout.pp == 4 and chosen.layout.dp == 1 and chosen.fits
    first = next(e for e in p.estimates if e.fits)
    assert first is chosen and not any(e.fits for e in p.estimates[:p.estimates.index(chosen)])
    group = [e for e in p.estimates if same_layout(e.layout, chosen.layout)]
    assert {e.layout.schedule for e in group} == {"1f1b", "zb-h1", "zbv"} and all(e.fits for e in group)
    assert chosen.step_seconds == min(e.step_seconds for e in group)
    assert chosen.layout.schedule != "1f1b" and chosen.bubble < theory_bubble("1f1b", 4, 8)
    for e in group:  # the step-time model's terms (issue 40): the bubble is compute x b / (1 - b)
        assert e.step_seconds == pytest.approx(sum(e.step.values()))
        assert e.step["bubble"] == pytest.approx(e.compute_seconds * e.bubble / (1 - e.bubble))
    zbv = next(e for e in group if e.layout.schedule == "zbv")
    zb1 = next(e for e in group if e.layout.schedule == "zb-h1")
    assert zbv.comm["pp"]["bytes"] == 2 * zb1.comm["pp"]["bytes"]
    text = "\n".join(p.reasons)
    assert f"Pipeline schedule {chosen.layout.schedule} (--pipeline-schedule {chosen.layout.schedule})" in text
    assert f"bubble {theory_bubble('1f1b', 4, 8):.1%}" in text and f"bubble {chosen.bubble:.1%}" in text
    # slower GPUs: compute outweighs ZBV's extra traffic, and ZBV, the smallest bubble, wins
    _, _, slow = _pp4_plan(tflops=1.0, max_cp=1)
    assert slow.choice.layout.schedule == "zbv"
    assert slow.choice.bubble == pytest.approx(theory_bubble("zbv", 4, 8))


def test_planner_falls_back_to_1f1b_when_the_w_inputs_do_not_fit():
    """TP 4 x PP 2: each layer's W inputs (11 s b h bytes under SP) exceed its activations
    (8.5 s b h), so ZB-H1's last stage needs more than 1F1B's first; with memory between the
    two, 1F1B is chosen and the explanation says why."""
    m, hw = tp4_pp2_model(), Hardware(80, 4, 2)
    totals = {s: estimate(m, Layout(tp=4, pp=2, schedule=s), 8, 1, PREC, hw, True).memory["total"]
              for s in schedules(m, 2)}
    assert totals["1f1b"] < totals["zb-h1"] < totals["zbv"]
    usable = (totals["1f1b"] + totals["zb-h1"]) / 2
    p = plan(m, Hardware(usable / GiB / 0.9, 4, 2), 8, 1, max_cp=1)
    # issue 40: ranked by step time, PP 8 with full recomputation (no TP all-reduces) wins this small
    # model; the schedules of TP 4 x PP 2, this test's subject, as the explanation of that layout
    p.choice = min((e for e in p.fitting() if (e.layout.tp, e.layout.pp, e.layout.recompute) == (4, 2, "none")),
                   key=lambda e: e.step_seconds)
    p.reasons = explain(p)
    lay = p.choice.layout
    assert (lay.tp, lay.pp, lay.dp, lay.schedule) == (4, 2, 1, "1f1b")
    zb = [e for e in p.estimates if same_layout(e.layout, lay) and e.layout.schedule != "1f1b"]
    assert zb and not any(e.fits for e in zb) and all(e.step_seconds < p.choice.step_seconds for e in zb)
    assert all(e.w_inputs > 0 for e in zb) and p.choice.w_inputs == 0
    text = "\n".join(p.reasons)
    assert "Pipeline schedule 1f1b" in text and text.count("does not fit") >= 2
    # with memory for ZB-H1 too, it wins
    p = plan(m, Hardware((totals["zb-h1"] + totals["zbv"]) / 2 / GiB / 0.9, 4, 2), 8, 1, max_cp=1)
    best = min((e for e in p.fitting() if same_layout(e.layout, lay)), key=lambda e: e.step_seconds)
    assert best.layout.schedule == "zb-h1"


def test_cli_prints_the_schedule_and_the_flags_validate(tmp_path, capsys):
    """The recommendation's flags carry --pipeline-schedule, parse with pretrain_gpt.py's parser
    and pass megalite's validation for the planned world."""
    _, totals, _ = _pp4_plan()
    gb = max(totals.values()) * 1.001 / GiB / 0.9
    for tflops, expected in (("400", None), ("1", "zbv")):
        assert plan_parallel.main(PP4_ARGV + ["--gpu-memory-gb", f"{gb:.9f}", "--achieved-tflops", tflops,
                                              "--max-context-parallel", "1"]) == 0
        text = capsys.readouterr().out
        flags = text.split("The recommendation as pretrain_gpt.py flags", 1)[1].splitlines()[1].split()
        schedule = next(f.split("=", 1)[1] for f in flags if f.startswith("--pipeline-schedule="))
        assert schedule in ("zb-h1", "zbv") and (expected is None or schedule == expected)
        assert f"Pipeline schedule {schedule}" in text and "schedule" in text.split("valid layouts fit")[1]
        args = pretrain_parser().parse_args(flags + ["--mock-data"])
        assert args.pipeline_schedule == schedule and args.pipeline_model_parallel_size == 4
        config = config_from_args(args, 512)
        validate(config, 4, 1)
        assert config.train.pipeline_schedule == schedule


# -- the interleaved 1F1B (virtual pipeline stages) --------------------------------------------------

def _dominates(candidates, states) -> bool:
    return all(any(all(x >= y for x, y in zip(sum(c, ()), sum(st, ()))) for c in candidates) for st in states)


@pytest.mark.parametrize("P,V", [(2, 2), (4, 2), (4, 4), (3, 2)])
def test_interleaved_bubble_and_memory_follow_the_simulation(P, V):
    """The interleaved 1F1B (1f1b with V chunks per rank): its bubble is the closed form
    (P-1)/(V M+P-1), which the simulation of megalite's order measures; the micro-batches it holds
    are the simulated states (each a state of the walk, together dominating every state), the
    same at M = 2P as at 5P (the planner simulates 2P at most), and rank 0 holds Megatron's
    warm-up plus one: (V-1) P + 2 (P-1) + 1 chunk-micro-batches."""
    for M in (2 * P, 5 * P):
        assert bubble("1f1b", P, M, V) == pytest.approx((P - 1) / (V * M + P - 1), rel=1e-12)
        assert simulate("1f1b", P, M, virtual=V).bubble() == pytest.approx(bubble("1f1b", P, M, V), rel=1e-9)
    for r in range(P):
        walked = _simulated_states("1f1b", P, 5 * P, r, V)
        held = held_states("1f1b", P, 5 * P, r, V)
        assert set(held) <= walked and _dominates(held, walked)
        assert held == held_states("1f1b", P, 2 * P, r, V)
    assert max(sum(st[0]) for st in held_states("1f1b", P, 4 * P, 0, V)) == (V - 1) * P + 2 * (P - 1) + 1


def test_interleaved_layouts_parameters_traffic_and_calls():
    """An interleaved rank holds chunks c P + p of P V (their parameters sum to its stage's), sends
    V times 1F1B's PP bytes in V times the calls, and is a candidate for every V whose chunks hold
    whole layers."""
    m, hw = pp4_model(), Hardware(80, 1, 4)
    assert virtual_stages(m, 4) == (1, 2) and virtual_stages(m, 2) == (1, 2, 4) and virtual_stages(m, 1) == (1,)
    assert virtual_stages(m, 2, "zb-h1") == (1,) and p2p_factor("1f1b", 4, 2) == 2 and p2p_factor("zbv", 4) == 2
    assert sum(stage_parameters(m, 1, 4, p, 1, "1f1b", 2) for p in range(4)) == \
        sum(stage_parameters(m, 1, 4, p) for p in range(4))
    assert stage_parameters(m, 1, 4, 0, 1, "1f1b", 2) == stage_parameters(m, 1, 8, 0) + stage_parameters(m, 1, 8, 4)
    one, two = (estimate(m, Layout(pp=4, virtual=v), 8, 1, PREC, hw, True) for v in (1, 2))
    assert two.comm["pp"]["bytes"] == 2 * one.comm["pp"]["bytes"]
    calls = [exposed_calls(m, e.layout, 8, e.comm)["pp"] for e in (one, two)]
    assert calls == [2 * 8, 2 * 2 * 8]
    assert two.bubble == pytest.approx(3 / (2 * 8 + 3)) and two.step["bubble"] < one.step["bubble"]
    layouts = {(lay.schedule, lay.virtual) for lay in candidate_layouts(m, hw, max_cp=1) if lay.pp == 4}
    assert layouts == {("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zbv", 1)}


def test_planner_picks_the_interleaved_1f1b_where_it_is_the_fastest_that_fits():
    """TP 4 x PP 2 on slow GPUs, with memory for 1F1B and its interleaved variant at V = 4 but not
    for the zero-bubble schedules (their W inputs outweigh the activations) nor V = 2: the
    interleaved 1F1B at V = 4, the smallest bubble that fits, is recommended; the explanation names V and the flag, and the
    printed flags parse and pass megalite's validation with the layers per virtual stage."""
    m, hw = tp4_pp2_model(), Hardware(80, 4, 2)
    totals = {(s, v): estimate(m, Layout(tp=4, pp=2, schedule=s, virtual=v), 8, 1, PREC, hw, True).memory["total"]
              for s in schedules(m, 2) for v in virtual_stages(m, 2, s)}
    # rank 0 holds 1F1B's 2 micro-batches of 4 layers, (3, 2) or (4, 1) of 2 layers at V = 2 and
    # (4, 2, 2, 1) of 1 layer at V = 4 (the chunk with the embedding held longest); ZB-H1 its W inputs
    assert totals[("1f1b", 1)] < totals[("1f1b", 4)] < totals[("zb-h1", 1)] < totals[("1f1b", 2)]
    usable = totals[("1f1b", 4)] * 1.001
    p = plan(m, Hardware(usable / GiB / 0.9, 4, 2, achieved_tflops=1.0), 8, 1, max_cp=1)
    p.choice = min((e for e in p.fitting() if (e.layout.tp, e.layout.pp, e.layout.recompute) == (4, 2, "none")),
                   key=lambda e: e.step_seconds)
    p.reasons = explain(p)
    lay = p.choice.layout
    assert (lay.schedule, lay.virtual) == ("1f1b", 4) and p.choice.bubble == pytest.approx(1 / (4 * 8 + 1))
    text = "\n".join(p.reasons)
    assert "Pipeline schedule interleaved 1f1b with V = 4 chunks of 1 layer per rank " \
           "(--num-layers-per-virtual-pipeline-stage 1)" in text and "i1f1b/2 bubble" in text
    flags = pretrain_flags(m, lay, 8, 1, "bf16")
    assert "--num-layers-per-virtual-pipeline-stage=1" in flags
    config = config_from_args(pretrain_parser().parse_args(flags + ["--mock-data"]), 512)
    validate(config, 8, 4)
    assert config.parallel.num_layers_per_virtual_pipeline_stage == 1


def test_interleaved_needs_micro_batches_in_groups_of_p():
    """M not a multiple of P: megalite refuses the interleaved layouts, the planner lists them as
    refused, and the explanation of the chosen pipeline says why none was considered."""
    m = pp4_model()
    p = plan(m, Hardware(80, 1, 4), 6, 1, max_cp=1)  # M = 6 on PP 4
    refused = [lay for lay in p.invalid if lay.virtual > 1]
    assert refused and all("multiple of --pipeline-model-parallel-size" in p.invalid[lay] for lay in refused)
    assert not any(e.layout.virtual > 1 for e in p.estimates)
    p.choice = next(e for e in p.fitting() if e.layout.pp == 4)
    assert "interleaved 1f1b not considered: M = 6 micro-batches do not go round the ring in groups of P = 4" \
        in "\n".join(explain(p))


@pytest.mark.slow
def test_interleaved_printed_flags_dry_run_within_5_percent(tmp_path, capsys):
    """The printed flags of TP 2 x PP 2 x DP 2, ZeRO-1, interleaved at V = 2
    (--num-layers-per-virtual-pipeline-stage 2, --overlap-grad-reduce), dry-run (one rank per
    stage on meta) within 5% of the planner's memory on each stage (seen: +2.5% and +2.3%; 1F1B
    on this model +1.6% and +0.6%). ZeRO-2 under the interleaved order, where each bucket is
    reduce-scattered when the rank's operation list completes it, is held to the planner at
    scale by tests/test_recipes.py's Llama-3 8B SFT recipe at 8 GPUs (+19% when the buckets were
    reduced in micro-batch order)."""
    import json

    from tools import dry_run
    m = ModelConfig(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=512, vocab_size=1000)
    layout, hw = Layout(tp=2, pp=2, dp=2, zero=1, virtual=2), Hardware(80, 8, 1)
    flags = pretrain_flags(m, layout, 8, 1, "bf16")
    assert {"--num-layers-per-virtual-pipeline-stage=2", "--overlap-grad-reduce"} <= set(flags)
    out = tmp_path / "dry.json"
    assert dry_run.main(["--world-size", "8", "--gpus-per-node", "8", "--json", str(out)] + flags) == 0
    capsys.readouterr()
    roles = json.loads(out.read_text())["roles"]
    e = estimate(m, layout, 8, 1, PREC, hw, True)
    for stage, role in enumerate(roles):
        _, planned = stage_memory(m, layout, stage, 1, 4, PREC, flash_attention=True)
        assert abs(role["measured_bytes"] / planned["total"] - 1) < 0.05, (role["role"], role["measured_bytes"], planned)
    assert abs(max(r["measured_bytes"] for r in roles) / e.memory["total"] - 1) < 0.05
