"""Pipeline schedules in the planner: which schedules a layout may run, each one's bubble, the
activation memory it holds, its step time, and the words that say why one was picked. Part
of the planner (:mod:`megalite.planner`); the schedules themselves are
:mod:`megalite.pipeline.op_lists` (F = forward, B = input-gradient backward, W = weight-gradient
backward).

**Candidates** for PP = P > 1: ``1f1b``, and the zero-bubble ``zb-h1`` and ``zbv`` where
megalite's own rules accept them (:func:`megalite.pipeline.checks.check_pipeline_schedule`: the
local transformer implementation; zbv only when the L layers divide into 2P chunks), with
ZeRO-0 to 2 (``ZERO_BUBBLE_MAX_ZERO``): megalite's ZeRO-2 buckets each chunk's gradients apart,
those B makes apart from those W makes, and reduces them in the order the rank completes them,
so the dry run of a 13B at TP 2 x PP 2 x DP 8 with --overlap-grad-reduce holds under zb-h1 the
gradients 1F1B holds (1.73 and 2.01 GiB against 1.73 and 2.20) and under zbv 2.07 and 1.66
(rank 0 keeps both tied copies of the embedding, each a bucket of its own); the planner counts
one bucket being filled, as for 1F1B. ZeRO-3 (weights gathered per layer) is not planned with
them. The **interleaved 1F1B** (``1f1b`` with --num-layers-per-virtual-pipeline-stage: V chunks
per rank, rank p holding global chunks c P + p; :func:`virtual_stages`) is planned for every V > 1
whose chunks hold whole layers (L divisible by P V), at any ZeRO stage megalite accepts with
PP, and only where the micro-batches go round the ring in groups of P (M divisible by P:
megalite's validation refuses the rest). With PP = 1 there is one schedule, no bubble.

**Bubble** (idle fraction of a step with F = B = W, averaged over ranks:
:func:`megalite.pipeline.op_lists.theory_bubble`, cached per (schedule, P, M))::

    1F1B   (P-1) / (M+P-1)          each rank idles (P-1)(F+B+W)
    interleaved, V chunks per rank  (P-1) / (V M+P-1): the warm-up and cool-down are V times shorter
    ZB-H1  (P-1) / (3M+P-1), M >= P  each rank idles (P-1)(F+B-W): a third of 1F1B's
    ZBV    the simulation of its greedy order (P = 4: M = 4 0.111, 8 0.059, 16 0.030)

Beyond ``simulated_micro_max(P)`` micro-batches (P M > 2048: P = 16, M = 512 takes 0.7 s to
simulate) ZBV keeps the idle time per rank it has there, I = b 6 M0 / (1 - b) at M0 (each rank
runs 6 M unit ops, 3 per chunk), so b(M) = I / (6 M + I): the greedy order's idle time varies a
little with M (P = 2: 1 or 2 units by parity), below 0.1% of the step there.

**Memory** held by rank p, its local chunks c with A_c = one micro-batch's activations of the
chunk, W_c = its W inputs (:func:`w_input_layer_bytes`) and G_c = what a running W of the chunk
adds to them (:func:`w_gradient_chunk_bytes`: W accumulates each weight gradient as soon as it
is computed, so about twice the chunk's largest single weight in its dtype, the dW and
AccumulateGrad's copy): the most, over the moments right after an F or a B and while a W runs,
of ``sum_c n_c A_c + w_c W_c + r_c G_c``, where n_c counts the chunk's micro-batches whose B is
pending, w_c those whose W is pending (after B the activations are freed but for what W keeps:
the W inputs) and r_c = 1 while a W of the chunk runs. From the simulated order
(:func:`held_states`)::

    1F1B   n = min(P-p, M), w = 0                 stage 0: P A
    interleaved  the simulated order of megalite's interleaved 1F1B (F and fused BW per chunk):
           rank 0 holds (V-1) P + 2 (P-1) + 1 chunk activations of L / (P V) layers each, about
           P A (1 + (P-1) / (P V)) with A one micro-batch of a stage's L / P layers
    ZB-H1  after F (P-p) A + p W; during the W that follows each B (P-p-1) A + (p+1) W + G
           (M >= P): (P-p) A + p W when W + G <= A; with W > A (large TP: the row-parallel
           linears' output gradients are not split) the last stage's P W + G is the peak
    ZBV    two chunks of L/(2P) layers; at most 2P chunk activations (P A, 1F1B's stage 0)
           and 2P-2 pending chunk W's; rank 0 holds chunk 0 (embedding) and chunk 2P-1 (final
           norm, output layer, loss), so the embedding and the output layer are both on it
           (tied: megalite's two chunks keep a copy each and add their gradients on the rank)

The dry run (tools/dry_run.py, meta) of a 13B (40 layers, h 5120, s 2048) at TP 2 x PP 2 x
DP 8, M = 8, measures the zero-bubble schedules within 1% of this estimate (docs/layout.md).
Its "communication" at the peak is, beyond 1F1B's 0.03 GiB, the row-parallel linears' output
gradients that W keeps (all-gathered over TP under SP, so made inside a collective): part of
W_c. The p2p buffers themselves (one message held per link) are not modelled: 0.1% of the peak;
but the interleaved order posts its receives ahead of use (the global message order), so each
chunk-micro-batch it holds of a chunk fed by the previous rank keeps its received input too
(s b h / t under SP), counted.

**Step time** (:mod:`megalite.planner.step_time`, a floor above) orders the schedules of one
layout, as every layout: the bubble costs compute x b / (1 - b); ZBV's middle ranks send each
micro-batch's activation and gradient twice (down the V and back): 2x 1F1B's PP traffic for
P > 2; the interleaved 1F1B sends them at each of a rank's V chunks: V x 1F1B's, V times the
calls (:func:`p2p_factor`). Its smaller bubble against its sends and their latency is what
picks V.
"""
from __future__ import annotations

import dataclasses
import functools
from functools import lru_cache

from megalite.config import ModelConfig, ParallelConfig, TrainConfig
from megalite.errors import ConfigError
from megalite.model.counting import mtp_activation_bytes
from megalite.moe import planning as moe_planning
from megalite.pipeline.checks import check_pipeline_schedule
from megalite.pipeline.op_lists import Simulation, simulate, theory_bubble
from megalite.pipeline.schedule_kinds import DEFAULT_SCHEDULE, PLANNED_SCHEDULES, schedule as describe
from megalite.planner.layers import (chunk_moe_flags, layer_activation_bytes, w_gradient_chunk_bytes,  # noqa: F401
                                     w_input_chunk_bytes, w_input_layer_bytes)
from megalite.planner import cp as planner_cp
from megalite.planner.types import Estimate, Layout, Plan, Precision

GiB = 2**30
SCHEDULES = PLANNED_SCHEDULES  # 1f1b, zb-h1, zbv (megalite.pipeline.schedule_kinds)
ZERO_BUBBLE_MAX_ZERO = 2  # zb-h1/zbv planned with ZeRO-0 to 2 (module docstring)
SIMULATED_STAGE_MICRO = 2048  # simulate up to P x M = this (P = 16, M = 128: 0.1 s), and M >= 4P


def simulated_micro_max(P: int) -> int:
    """Micro-batches simulated at most: P M <= 2048 and at least 4P, where the simulation's
    in-flight counts have reached their steady state."""
    return max(SIMULATED_STAGE_MICRO // P, 4 * P)


@lru_cache(maxsize=4096)
def _allowed(num_layers: int, transformer_impl: str, pp: int, schedule: str) -> bool:
    model = type("Model", (), {"num_layers": num_layers, "transformer_impl": transformer_impl})
    try:
        check_pipeline_schedule(model, ParallelConfig(pipeline_model_parallel_size=pp),
                                TrainConfig(pipeline_schedule=schedule))
    except ConfigError:
        return False
    return True


def runs_as(schedule: str, virtual: int = 1):
    """The table row (:mod:`megalite.pipeline.schedule_kinds`) of the schedule that runs: 1f1b
    with ``virtual`` > 1 chunks per rank runs the interleaved order."""
    return describe(describe(schedule).run_name(virtual))


def virtual_stages(m: ModelConfig, pp: int, schedule: str = DEFAULT_SCHEDULE) -> tuple[int, ...]:
    """The V (model chunks per rank) the planner considers for ``schedule`` at PP = ``pp``: 1, and
    for a schedule that interleaves (1f1b) every V > 1 whose P V chunks hold whole layers."""
    if pp == 1 or not describe(schedule).interleaves:
        return (1,)
    per_rank = m.num_layers // pp
    return (1,) + tuple(v for v in range(2, per_rank + 1) if per_rank % v == 0)


def schedules(m: ModelConfig, pp: int, zero: int = 0) -> tuple[str, ...]:
    """The schedules the planner considers for PP = ``pp`` and ZeRO stage ``zero``: 1f1b alone
    for pp = 1 or zero > ``ZERO_BUBBLE_MAX_ZERO``, else those of ``SCHEDULES`` megalite's
    validation accepts for this model."""
    if pp == 1 or zero > ZERO_BUBBLE_MAX_ZERO:
        return (DEFAULT_SCHEDULE,)
    return tuple(s for s in SCHEDULES if _allowed(m.num_layers, m.transformer_impl, pp, s))


def in_flight(pp: int, stage: int, num_micro: int) -> int:
    """Micro-batches whose activations a stage holds at once under 1F1B: min(P - p, M)."""
    return min(pp - stage, num_micro)


def pipeline_bubble(pp: int, num_micro: int, virtual: int = 1) -> float:
    """Idle fraction of a 1F1B or GPipe step: (P - 1) / (V M + P - 1), V = 1 unless interleaved."""
    return (pp - 1) / (virtual * num_micro + pp - 1)


@lru_cache(maxsize=256)
def simulation(schedule: str, P: int, M: int, virtual: int = 1) -> Simulation:
    """:func:`megalite.pipeline.op_lists.simulate` with F = B = W, once per (schedule, P, M, V)."""
    return simulate(schedule, P, M, virtual=virtual)


def _simulated_micro(schedule: str, P: int, M: int, virtual: int = 1) -> int:
    """M, or the most micro-batches simulated for the micro-batches held: :func:`simulated_micro_max`;
    2P for the interleaved 1F1B (micro-batches in groups of P), whose warm-up, (V-1) P + 2 (P-1)
    chunk-micro-batches on rank 0, ends within 2P V: from there on its counts repeat
    (tests/test_planner_schedules.py holds 2P equal to 5P)."""
    if runs_as(schedule, virtual).micro_groups:
        return min(M, 2 * P)
    return min(M, simulated_micro_max(P))


def _idle_fraction(sim: Simulation) -> float:
    """:meth:`Simulation.bubble` with the span computed once: mean over ranks of 1 - busy / span."""
    span = sim.span
    return sum(1 - sum(e - s for _, s, e in ops) / span for ops in sim.timed) / sim.P


@lru_cache(maxsize=4096)
def bubble(schedule: str, P: int, M: int, virtual: int = 1) -> float:
    """The schedule's bubble with F = B = W (module docstring): theory_bubble up to
    ``simulated_micro_max(P)`` micro-batches, the steady-state forms beyond."""
    if P == 1:
        return 0.0
    cap = simulated_micro_max(P)
    kind = runs_as(schedule, virtual)
    if kind.closed_bubble:  # 1F1B, the interleaved 1F1B: (P-1)/(V M+P-1)
        return theory_bubble(schedule, P, M, virtual)
    if kind.one_chunk_split and M >= P:  # the simulation's, exactly (tests/test_planner_schedules.py)
        return (P - 1) / (3 * M + P - 1)
    if M <= cap:
        return _idle_fraction(simulation(schedule, P, M))  # = theory_bubble's, one simulation for both
    b0 = _idle_fraction(simulation(schedule, P, cap))
    idle = b0 * 6 * cap / (1 - b0)
    return idle / (6 * M + idle)


def num_chunks(schedule: str, P: int, virtual: int = 1) -> int:
    """Model chunks of the whole pipeline: 2P under ZBV, P V interleaved, else P (one per stage)."""
    return describe(schedule).pipeline_chunks(P, virtual)


def local_chunks(schedule: str, P: int, rank: int, virtual: int = 1) -> tuple[int, ...]:
    """The global chunks (0 = embedding ... last = loss) a rank holds, in local order."""
    return describe(schedule).local_chunks(P, rank, virtual)


def moe_layers_on_rank(m: ModelConfig, schedule: str, P: int, rank: int, virtual: int = 1) -> int:
    """MoE layers among the rank's chunks (0 for a dense model)."""
    if not m.num_experts:
        return 0
    chunks = num_chunks(schedule, P, virtual)
    return sum(sum(chunk_moe_flags(m, chunks, g)) for g in local_chunks(schedule, P, rank, virtual))


@lru_cache(maxsize=4096)
def held_states(schedule: str, P: int, M: int, rank: int, virtual: int = 1) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The (n_c, w_c, r_c) per local chunk right after each F and each B and while each W runs
    (r_c = 1 for the chunk whose W runs: :func:`w_gradient_chunk_bytes` held besides) in the rank's
    simulated order (module docstring), dominated ones left out: the candidates for its peak."""
    kind = runs_as(schedule, virtual)
    if kind.fused_1f1b or P == 1:
        return (((in_flight(P, rank, M),), (0,), (0,)),)
    if kind.one_chunk_split and M >= P:  # after F; W(m-p) right after B(m) (the simulation's, tested)
        return (((P - rank - 1,), (rank + 1,), (1,)), ((P - rank,), (rank,), (0,)))
    sim = simulation(schedule, P, _simulated_micro(schedule, P, M, virtual), virtual)
    chunks = len(local_chunks(schedule, P, rank, virtual))
    n, w, states = [0] * chunks, [0] * chunks, set()
    for op, _, _ in sim.timed[rank]:
        running = [0] * chunks
        if op.kind == "F":
            n[op.chunk] += 1
        elif op.kind == "BW":  # a fused backward frees the micro-batch's activations of the chunk
            n[op.chunk] -= 1
        elif op.kind == "B":
            n[op.chunk], w[op.chunk] = n[op.chunk] - 1, w[op.chunk] + 1
        elif op.kind == "W":  # its inputs still held, its weight gradients made
            running[op.chunk] = 1
            states.add((tuple(n), tuple(w), tuple(running)))
            w[op.chunk] -= 1
            continue
        states.add((tuple(n), tuple(w), tuple(running)))
    keep: list[tuple] = []  # largest totals first: a state is dominated only by one kept before it,
    for state in sorted(states, key=lambda s: -sum(s[0] + s[1] + s[2])):  # of its kind (W running or not)
        if not any(all(a >= b for a, b in zip(sum(k, ()), sum(state, ()))) and any(k[2]) == any(state[2])
                   for k in keep):
            keep.append(state)
    return tuple(sorted(keep))


def held_bytes(schedule: str, P: int, M: int, rank: int, activations: list[float], w_inputs: list[float],
               w_gradients: list[float] | None = None, during_w: bool = True, virtual: int = 1) -> tuple[float, tuple]:
    """(bytes, the state (n_c, w_c, r_c) at the peak) of a rank's activations, W inputs and what
    a running W adds, given one micro-batch's activations and W inputs of each of its local
    chunks and what a W of each adds (``w_gradients``: :func:`w_gradient_chunk_bytes`; none by
    default); ``during_w=False``: the peak over the moments after an F or a B only."""
    weights = list(activations) + list(w_inputs) + list(w_gradients or [0.0] * len(activations))
    return max(((sum(x * y for x, y in zip(sum(state, ()), weights)), state)
                for state in held_states(schedule, P, M, rank, virtual) if during_w or not any(state[2])),
               key=lambda x: x[0])


# -- activations and W inputs ---------------------------------------------------------------------

def stage_activation_bytes(m: ModelConfig, layout: Layout, stage: int, micro: int, num_micro: int,
                           prec: Precision, flash_attention: bool = False, detail: dict | None = None) -> float:
    """Activations (and W inputs) a rank of ``stage`` holds at its peak: one micro-batch's of each
    of its chunks (ZBV: two), held as its schedule says (:func:`held_bytes`;
    ``detail`` gets the state at the peak, "held", and its W inputs, "w_inputs"), plus transients."""
    key = (id(m), dataclasses.replace(layout, zero=0), stage, micro, num_micro, prec, flash_attention)
    hit = _ACTIVATIONS.get(key)  # the ZeRO stage changes nothing here: its 4 variants share one
    if hit is None or hit[0] is not m:
        if len(_ACTIVATIONS) > 20000:
            _ACTIVATIONS.clear()
        hit = _ACTIVATIONS[key] = (m, *_stage_activations(m, layout, stage, micro, num_micro, prec, flash_attention))
    if detail is not None:
        detail.update(held=hit[2], w_inputs=hit[3])
    return hit[1]


_ACTIVATIONS: dict[tuple, tuple] = {}  # (id(m), layout at ZeRO-0, ...) -> (m, bytes, held, W inputs)


def _stage_activations(m: ModelConfig, layout: Layout, stage: int, micro: int, num_micro: int, prec: Precision,
                       flash_attention: bool) -> tuple[float, tuple, float]:
    # the planner imports this module: its per-layer formula is imported when called

    t, sp, cp = layout.tp, layout.sp, layout.cp
    args = dict(micro=micro, tp=t, sp=sp, cp=cp, act_bytes=prec.act_bytes, flash_attention=flash_attention)
    per_layer = layer_activation_bytes(m, recompute=layout.recompute, **args)
    chunks = num_chunks(layout.schedule, layout.pp, layout.virtual)
    mine = local_chunks(layout.schedule, layout.pp, stage, layout.virtual)
    flags = [chunk_moe_flags(m, chunks, g) for g in mine]  # which of each chunk's layers are MoE
    moe_flags = [f for chunk in flags for f in chunk]
    moe = dict(micro=micro, tp=t, sp=sp, cp=cp, ep=layout.ep, act_bytes=prec.act_bytes)
    delta = moe_planning.moe_layer_delta(m, **moe) if any(moe_flags) and layout.recompute != "full" else 0.0
    sbh = m.seq_length / cp * micro * m.hidden_size / (t if sp else 1)
    first = sbh if 0 in mine and m.hidden_dropout > 0 else 0.0  # embedding dropout mask
    last = prec.act_bytes * sbh + 4 * m.seq_length / cp * micro * m.padded_vocab_size(t) / t  # norm, fp32 logits
    last += mtp_activation_bytes(m, recompute=layout.recompute, **args)  # the MTP depths (0 without)
    acts = [len(f) * per_layer + sum(f) * delta + first * (g == 0) + last * (g == chunks - 1)  # routed tokens
            for g, f in zip(mine, flags)]                                                  # for the dense MLP
    running = runs_as(layout.schedule, layout.virtual)
    receives_ahead = running.micro_groups
    received = prec.act_bytes * sbh  # a chunk's received input, held beside it where receives_ahead
    if receives_ahead:  # the interleaved order posts its receives
        # in the global message order, ahead of use: each held chunk-micro-batch of a chunk fed by the
        # previous rank keeps its received input besides (the dry run's "communication" at the peak:
        # 2.6 GiB on stage 0 of a 70B at TP 4 x PP 16, V = 5)
        acts = [a + (received if g > 0 else 0.0) for g, a in zip(mine, acts)]
    wis, dws = [0.0] * len(mine), [0.0] * len(mine)
    split = running.split_backward
    if split:  # W inputs; what a running W adds to them
        wis = [w_input_chunk_bytes(m, chunks, g, micro, t, sp, cp, prec.act_bytes) for g in mine]
        dws = [w_gradient_chunk_bytes(m, chunks, g, micro, t, cp, layout.ep, prec, wi) for g, wi in zip(mine, wis)]
    # F's and B's transients (recomputation, CP, MoE, below) add to the most held right after an F
    # or a B, not to what a running W holds (no F or B runs then)
    peak = functools.partial(held_bytes, layout.schedule, layout.pp, num_micro, stage, virtual=layout.virtual)
    in_w, w_state = peak(acts, wis, dws)
    total, state = peak(acts, wis, during_w=False)
    held_after_f_or_b = total
    recomputed = 0.0
    if layout.recompute == "full":  # the layer being recomputed during backward (the larger kind)
        recomputed = layer_activation_bytes(m, recompute="none", **args)
        if any(moe_flags):
            full_delta = moe_planning.moe_layer_delta(m, **moe)
            recomputed += full_delta if all(moe_flags) else max(full_delta, 0.0)
        total += recomputed
    # allgather CP: one layer's full-sequence K/V and fp32 dK/dV during backward (planner_cp)
    total += planner_cp.transient_bytes(m, layout, micro, prec.act_bytes)
    if any(moe_flags):  # an MoE layer's dispatch buffers (forward) or expert weight gradients (backward;
        # under the B/W split they are W's: w_gradient_chunk_bytes) while one micro-batch of a chunk
        # holds its layers up to the chunk's last MoE layer, beside what the rank holds besides that
        # micro-batch of that chunk (the other chunks' micro-batches in flight among it: ZBV, interleaved)
        forward, backward = moe_planning.transient_bytes(m, **moe, weight_bytes=prec.weight_bytes)
        for c, (g, chunk_flags) in enumerate(zip(mine, flags)):
            if not any(chunk_flags):
                continue
            upto = max(i for i, f in enumerate(chunk_flags) if f) + 1
            held = (held_after_f_or_b - acts[c] + (received if g > 0 and receives_ahead else 0.0)  # still held
                    + first * (g == 0) + upto * per_layer + sum(chunk_flags[:upto]) * delta + recomputed)
            total = max(total, held + (forward if split else max(forward, backward)))
    if in_w > total:
        total, state = in_w, w_state
    return total, state, sum(w * b for w, b in zip(state[1], wis))


# -- time -----------------------------------------------------------------------------------------

def p2p_factor(schedule: str, P: int, virtual: int = 1) -> int:
    """PP traffic (and sends) of the busiest rank relative to 1F1B's: 2 for ZBV with P > 2, V for
    the interleaved 1F1B (each of a middle rank's V chunks sends every micro-batch's activation
    and gradient on: module docstring)."""
    if describe(schedule).v_shape:
        return 2 if P > 2 else 1
    return virtual


# -- words ----------------------------------------------------------------------------------------

def held_words(e: Estimate) -> str:
    """What the fullest stage holds at its peak, in micro-batches, per its schedule."""
    lay = e.layout
    where = f"pipeline stage {e.stage}" if lay.pp > 1 else "each GPU"
    ns, ws = e.held[:2] if e.held else ((in_flight(lay.pp, e.stage, e.num_micro),), (0,))
    n, w = sum(ns), sum(ws)
    unit = "chunk-micro-batch" if len(ns) > 1 else "micro-batch"
    words = f"{n} {unit}{'es' if n != 1 else ''} of activations"
    if w:
        words += f" and {w} of W inputs ({e.w_inputs / GiB:.1f} GiB)"
    return f"{words} in flight on {where}"


def explain_schedule(p: Plan) -> list[str]:
    """Why the chosen layout runs its pipeline schedule: each schedule of that layout with its
    bubble, its estimated step time and its memory against the usable memory."""
    chosen = p.choice
    if chosen is None or chosen.layout.pp == 1:
        return []
    lay = chosen.layout
    same = [e for e in p.estimates if same_layout(e.layout, lay)]
    usable = p.hardware.usable_bytes
    parts = []
    for e in same:
        fit = "fits" if e.fits else f"does not fit ({e.memory['total'] / GiB:.1f} > {usable / GiB:.1f} GiB usable)"
        mem = f"{e.memory['total'] / GiB:.1f} GiB" if e.fits else ""
        held = f", W inputs {e.w_inputs / GiB:.1f} GiB" if e.w_inputs else ""
        parts.append(f"{e.layout.schedule_label} bubble {e.bubble:.1%}, step ~{e.step_seconds:.2f} s"
                     + (f", {mem} on stage {e.stage}{held}, {fit}" if e.fits else f"{held}, {fit}"))
    missing = [describe(s) for s in SCHEDULES if s not in {e.layout.schedule for e in same}]
    # the one-chunk split (zb-h1) needs what every zero-bubble schedule needs; the V adds its chunks
    if any(s.one_chunk_split for s in missing):
        parts.append("zero-bubble schedules not considered: " + (
            f"--transformer-impl {p.model.transformer_impl} cannot defer weight gradients"
            if p.model.transformer_impl != "local" else
            f"ZeRO-{lay.zero} is not planned with them (ZeRO-0 to {ZERO_BUBBLE_MAX_ZERO} are)"))
    else:
        for s in (s for s in missing if s.v_shape):
            parts.append(f"{s.name} not considered: {p.model.num_layers} layers do not divide into "
                         f"2 x PP = {s.pipeline_chunks(lay.pp)} chunks")
    fastest = ", the fastest of this layout's schedules that fits" if len(same) > 1 else ""
    k = lay.layers_per_virtual_stage(p.model.num_layers)
    name = f"{lay.schedule} (--pipeline-schedule {lay.schedule})"
    if k:
        name = (f"interleaved {lay.schedule} with V = {lay.virtual} chunks of {k} layer{'s' if k > 1 else ''} per "
                f"rank (--num-layers-per-virtual-pipeline-stage {k})")
    if not any(e.layout.virtual > 1 for e in same):  # why the interleaved 1F1B is missing
        if len(virtual_stages(p.model, lay.pp)) == 1:
            parts.append(f"interleaved 1f1b not considered: a rank's {p.model.num_layers // lay.pp} layers do not "
                         f"split into V > 1 equal chunks")
        elif chosen.num_micro % lay.pp:
            parts.append(f"interleaved 1f1b not considered: M = {chosen.num_micro} micro-batches do not go round "
                         f"the ring in groups of P = {lay.pp}")
    return [f"Pipeline schedule {name}{fastest} with M = {chosen.num_micro}, P = {lay.pp}: " + "; ".join(parts) + "."]


def same_layout(a: Layout, b: Layout) -> bool:
    """Whether two layouts differ at most in their pipeline schedule."""
    return (a.tp, a.pp, a.dp, a.cp, a.zero, a.recompute, a.ep, a.cp_comm_type, a.cp_inner) == \
        (b.tp, b.pp, b.dp, b.cp, b.zero, b.recompute, b.ep, b.cp_comm_type, b.cp_inner)
