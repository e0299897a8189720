"""Layout search: every candidate layout of a model on a machine, and the recommendation: the
layout that fits with the shortest estimated step (:mod:`megalite.planner.step_time`: compute,
bubble, the exposed part of each communication, the optimizer step, latency). The field's guides'
order (data parallel first, then tensor parallel inside a node, then pipeline, then ZeRO,
recomputation and context parallelism: :func:`ladder_key`) only breaks ties: among the layouts
within ``TIE`` (1%) of the fastest, the first in that order is recommended, and the explanation
names the runner-up and the margin. Each CP layout comes in every CP type
(:mod:`megalite.planner.cp`) and each PP layout with every pipeline schedule
(:mod:`megalite.planner.pipeline`: 1f1b, zb-h1, zbv).

The arithmetic of one layout (memory per GPU, bubble, communication, step time) is in
:mod:`megalite.planner`; ``tools/plan_parallel.py`` is the command line.
"""
from __future__ import annotations

import dataclasses

from megalite.config import ModelConfig
from megalite.model.counting import cache_bytes_per_token
from megalite.planner.checks import check_layout
from megalite.planner.cp import cp_variants, explain_cp_type
from megalite.planner.estimate import (estimate, format_communication, model_state_bytes, stage_matrix_parameters,
                                       stage_parameters, total_parameters)
from megalite.planner.flags import grads_in_fp32
from megalite.planner.pipeline import explain_schedule, held_words, same_layout, schedules, virtual_stages
from megalite.planner.step_time import days_to_train, mfu, pipeline_imbalance, tokens_per_second
from megalite.planner.types import RECOMPUTE, Estimate, GiB, Hardware, Layout, Plan, Precision, describe_cp, precision


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_parallel_sizes(m: ModelConfig, stage_ranks: int) -> list[int]:
    """EP choices of an MoE model: the divisors of E that divide a stage's TP*CP*DP ranks."""
    if not m.num_experts:
        return [1]
    return [e for e in _divisors(m.num_experts) if stage_ranks % e == 0]


def candidate_layouts(m: ModelConfig, hw: Hardware, max_cp: int = 8, cp_comm_type: str | None = None) -> list[Layout]:
    """TP in divisors of GPUs per node up to 8, CP powers of two up to ``max_cp``, PP dividing
    the layers, DP what remains; every ZeRO stage (only 0 when DP x CP = 1) and recomputation;
    with experts, every EP dividing E and TP*CP*DP; with CP, every CP type
    (:func:`megalite.planner.cp.cp_variants`: p2p, a2a, allgather, a2a+p2p for each inner size),
    or only ``cp_comm_type``; with PP, every schedule megalite accepts (:func:`schedules`: the
    zero-bubble ones with ZeRO-0 to 2), 1f1b also interleaved with every V of :func:`virtual_stages`."""
    world, out = hw.world_size, []
    for tp in (d for d in _divisors(hw.gpus_per_node) if d <= 8):
        for cp in (c for c in (1, 2, 4, 8, 16, 32) if c <= max_cp):
            for pp in _divisors(m.num_layers):
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                for zero in range(4 if dp * cp > 1 else 1):  # nothing to shard over one rank
                    for rc in RECOMPUTE:
                        for ep in expert_parallel_sizes(m, tp * cp * dp):
                            out += [Layout(tp, pp, dp, cp, zero, rc, ep, kind, inner, schedule, v)
                                    for kind, inner in cp_variants(cp, cp_comm_type)
                                    for schedule in schedules(m, pp, zero)
                                    for v in virtual_stages(m, pp, schedule)]
    return out


RUNGS = ("data parallel", "tensor parallel inside a node", "pipeline parallel",
         "ZeRO-3", "context parallel")


def rung(layout: Layout) -> int:
    if layout.cp > 1:
        return 4
    if layout.zero == 3:
        return 3
    if layout.pp > 1:
        return 2
    return 1 if layout.tp > 1 else 0


def ladder_key(layout: Layout) -> tuple:
    """Sort key of the practitioners' order (module docstring): full recomputation last;
    then CP (1 first; each larger CP climbs the other rungs again); then the rung; TP
    ascending inside the TP rung, but once PP is needed TP as large as the node allows
    (Narayanan et al. 2021); then recomputation none before selective; then the ZeRO stage
    (ZeRO-1 keeps DDP's traffic; megalite's ZeRO-2 reduce-scatters every micro-batch); with
    experts, last EP ascending (fewer experts per rank for an all-to-all per MoE layer). The CP
    type and the pipeline schedule are not in the key: :func:`plan` orders the variants of one
    layout by their step time."""
    inner = rung(dataclasses.replace(layout, cp=1))  # CP layouts climb the same ladder inside
    tp_order = -layout.tp if inner == 2 else layout.tp
    return (layout.recompute == "full", layout.cp, inner, layout.pp, tp_order,
            RECOMPUTE.index(layout.recompute), layout.zero, layout.ep)


def plan(m: ModelConfig, hw: Hardware, global_batch: int, micro: int, prec: Precision | None = None,
         flash_attention: bool = True, max_cp: int = 8, cp_comm_type: str | None = None,
         documents: bool = False, train_tokens: float | None = None) -> Plan:
    """Every valid layout, estimated, in ladder order, and the recommendation: the fastest estimated
    step that fits, ties (``TIE``) to the ladder (:func:`ranked`); ``train_tokens``: the
    explanation says the days to train on them. The defaults are
    training's: bf16 with gradients accumulated in fp32 (``pretrain_gpt.py``'s default under
    --bf16) and attention that never stores the s x s scores (what ``--attention-backend auto``
    runs on a GPU, and what the meta dry run measures). The CP types of one layout follow each
    other by estimated step time (communication, no overlap: their attention FLOPs are equal),
    so the first that fits is the fastest that fits; ``cp_comm_type`` fixes the type. ``documents``:
    the batch carries --reset-attention-mask's arrays (the "data" memory entry counts them).
    The pipeline schedules of one layout follow each other the same way (step time: compute over
    one minus the bubble, plus communication; :mod:`megalite.planner.pipeline`)."""
    prec = prec or precision("bf16", grads_in_fp32("bf16"))
    checked: dict[tuple, str | None] = {}
    estimates, invalid = [], {}
    for layout in sorted(candidate_layouts(m, hw, max_cp, cp_comm_type), key=ladder_key):
        key = (layout.tp, layout.pp, layout.cp, layout.zero, layout.ep, layout.cp_comm_type, layout.cp_inner,
               layout.virtual)
        if key not in checked:
            checked[key] = check_layout(m, layout, global_batch, micro, hw, prec.update)
        if checked[key]:
            invalid[layout] = checked[key]
            continue
        estimates.append(estimate(m, layout, global_batch, micro, prec, hw, flash_attention, documents))
    estimates.sort(key=lambda e: (ladder_key(e.layout), e.step_seconds))  # stable: only CP types, schedules move
    result = Plan(m, hw, prec, global_batch, micro, estimates, invalid, cp_comm_type=cp_comm_type,
                  train_tokens=train_tokens)
    ranking = ranked(result.fitting())
    result.choice = ranking[0] if ranking else None
    result.reasons = explain(result)
    return result


TIE = 0.01  # layouts whose estimated steps are within 1% of the fastest's tie: the ladder picks among them


def ranked(fitting: list[Estimate]) -> list[Estimate]:
    """The layouts that fit, the recommendation first (the first in the practitioners' order,
    which ``fitting`` is in, of those within ``TIE`` of the fastest step), then by estimated step."""
    if not fitting:
        return []
    fastest = min(e.step_seconds for e in fitting)
    choice = next(e for e in fitting if e.step_seconds <= fastest * (1 + TIE))
    return [choice] + sorted((e for e in fitting if e is not choice), key=lambda e: e.step_seconds)


def runner_up(p: Plan) -> Estimate | None:
    """The fastest layout that fits after the recommendation with another grid or ZeRO stage (its
    own recomputations, schedules and CP types are variants of it, not alternatives)."""
    chosen = p.choice
    if chosen is None:
        return None
    grid = lambda lay: (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.zero)  # noqa: E731
    others = [e for e in p.fitting() if grid(e.layout) != grid(chosen.layout)]
    return min(others, key=lambda e: e.step_seconds) if others else None


TERM_WORDS = {"overlap": "hidden collectives' cost", "compute": "compute", "bubble": "pipeline bubble", "dp": "DP/ZeRO gradients (exposed)",
              "edp": "expert gradients (exposed)", "tp": "TP collectives", "pp": "PP sends", "cp": "CP (exposed)",
              "ep": "EP all-to-alls", "optimizer": "optimizer step", "latency": "collective latency"}


def format_step(e: Estimate, m: ModelConfig | None = None) -> str:
    """The recommendation's step time term by term, in ms (nonzero terms); given the model, a
    pipeline's compute says its imbalance u (:func:`megalite.planner.step_time.pipeline_imbalance`)."""
    def term(k: str, v: float) -> str:
        text = f"{TERM_WORDS[k]} {v * 1e3:,.0f} ms" if v >= 1e-3 else f"{TERM_WORDS[k]} {v * 1e3:.2f} ms"
        u = pipeline_imbalance(m, e.layout) if m is not None and k == "compute" else 1.0
        if u > 1.0005:  # what the even share would be, times the busiest stage's excess
            text += f" (x {u:.3f}: the pipeline runs at the pace of the stage holding the output layer)"
        return text
    return " + ".join(term(k, v) for k, v in e.step.items() if v > 0)


def explain_speed(p: Plan) -> list[str]:
    """The recommendation's estimated step, term by term, its throughput, MFU, days to train
    (``Plan.train_tokens``) and the runner-up with the margin."""
    chosen, m, hw = p.choice, p.model, p.hardware
    if chosen is None or not chosen.step:
        return []
    step = chosen.step_seconds
    lines = [f"Estimated step {seconds(step)} ({hw.name}: {hw.achieved_tflops:g} TFLOP/s achieved, "
             f"{hw.peak_tflops:g} peak) = {format_step(chosen, m)}; {tokens_per_second(m, p.global_batch, step):,.0f} "
             f"tokens/s, MFU {mfu(m, p.global_batch, step, hw):.1%}"
             + (f", {days_to_train(m, p.global_batch, step, p.train_tokens):.1f} days for {p.train_tokens:.3g} tokens"
                if p.train_tokens else "") + "."]
    second = runner_up(p)
    if second is not None:
        margin = second.step_seconds / step - 1
        tie = (f" (faster, but within the {TIE:.0%} tie: the practitioners' order picks)" if margin < 0 else "")
        lines.append(f"Runner-up: {second.layout.describe()}, step {seconds(second.step_seconds)}, {margin:+.1%}"
                     f"{tie} = {format_step(second, m)}.")
    return lines


def seconds(x: float) -> str:
    """A step time in words: '53.949 s', '7.12 ms'."""
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _breakdown(e: Estimate) -> str:
    mem = e.memory
    return (f"weights {_gib(mem['weights'])} + gradients {_gib(mem['gradients'])} + master/Adam "
            f"{_gib(mem['master_and_optimizer'])} + activations {_gib(mem['activations'])}"
            + (f" + buffers (ZeRO-3 gathered layers, gradient staging) {_gib(mem['buffers'])}" if mem["buffers"] else "")
            + f" + data (the step's micro-batches) {mem.get('data', 0) / 2**20:.1f} MiB")


def _step(layout: Layout) -> tuple:
    """The step of the ladder a layout belongs to, as a user would name it: DDP, ZeRO-1 and
    ZeRO-2 apart; then TP t; PP p (any TP); ZeRO-3 with TP t; CP c."""
    r = rung(layout)
    return (r, [layout.zero, layout.tp, layout.pp, layout.tp, layout.cp][r])


def _step_name(step: tuple) -> str:
    r, n = step
    if r == 0:
        return ["DDP", "ZeRO-1", "ZeRO-2"][n]
    return ["", "TP {}", "PP {}", "ZeRO-3 with TP {}", "CP {}"][r].format(n)


def _simpler_layouts(p: Plan) -> list[str]:
    """One line per simpler step of the ladder, up to the chosen layout: its smallest memory
    (best ZeRO stage and recomputation up to selective) against the usable memory; then the
    variants of the chosen step tried before it."""
    usable, chosen = p.hardware.usable_bytes, p.choice
    order = [e for e in p.estimates if e.layout.recompute != "full"]
    if chosen is not None and chosen in order:
        order = order[:order.index(chosen)]
    steps: dict[tuple, list[Estimate]] = {}
    for e in order:
        steps.setdefault(_step(e.layout), []).append(e)
    before = steps.pop(_step(chosen.layout), []) if chosen is not None else []
    before = [e for e in before if not same_layout(e.layout, chosen.layout)  # its schedules: explain_schedule
              and not e.fits]  # those that fit are slower (the ranking)
    lines = []
    for step, tried in steps.items():
        best = min(tried, key=lambda e: e.memory["total"])
        if best.fits:  # a faster layout won over it (explain_speed names the runner-up)
            fastest = min((e for e in tried if e.fits), key=lambda e: e.step_seconds)
            lines.append(f"{_step_name(step)} fits but is slower: {fastest.layout.describe()}, step "
                         f"{seconds(fastest.step_seconds)} against {seconds(chosen.step_seconds)}.")
            continue
        lines.append(f"Not {_step_name(step)}: {best.layout.describe()} needs {_gib(best.memory['total'])} > "
                     f"{_gib(usable)} usable ({_breakdown(best)}).")
    if before:
        shown = ", ".join(f"{e.layout.describe()}: {_gib(e.memory['total'])}" for e in before[-4:])
        lines.append(f"Within {_step_name(_step(chosen.layout))}, the simpler variants do not fit "
                     f"({'last ' + str(min(4, len(before))) + ' of ' + str(len(before)) if len(before) > 4 else 'all'}"
                     f" tried: {shown}).")
    return lines


def explain(p: Plan) -> list[str]:
    """Plain-words reasons: the model-state arithmetic, why each simpler rung fails, the choice."""
    m, hw, prec = p.model, p.hardware, p.precision
    psi_all = total_parameters(m)
    usable = hw.usable_bytes
    matrices = stage_matrix_parameters(m) if prec.matrix_optimizer_bytes is not None else 0
    ddp = model_state_bytes(stage_parameters(m), 1, 0, prec, matrices)["total"]
    if matrices:  # the rule keeps less for its matrix class (Muon: fp32 master and momentum)
        per_param = (f"{psi_all / 1e9:.2f}B parameters x ({prec.weight_bytes} weights + {prec.grad_bytes} gradients "
                     f"+ fp32 master and {prec.optimizer_state}: {prec.matrix_bytes} bytes for the "
                     f"{matrices / 1e9:.2f}B weight matrices, {prec.optimizer_bytes} for the rest)")
    else:
        per_param = (f"{psi_all / 1e9:.2f}B parameters x {prec.bytes_per_param} bytes ({prec.weight_bytes} weights + "
                     f"{prec.grad_bytes} gradients + {prec.optimizer_bytes} fp32 master and {prec.optimizer_state})")
    lines = [f"{per_param} = "
             f"{ddp / 1e9:.1f} GB ({_gib(ddp)}) of weights+grads+optimizer state per model copy, before "
             f"activations; a GPU has {hw.gpu_memory_gb:g} GiB, {_gib(usable)} usable after "
             f"{hw.headroom:.0%} headroom."]
    cache = cache_bytes_per_token(m, prec.weight_bytes)  # the attention parts' own cache shapes
    lines.append(f"Generation (not training): the KV cache holds {cache:,} bytes per token over the "
                 f"{m.num_layers} layers at {prec.weight_bytes}-byte elements, {cache * m.seq_length / GiB:.2f} GiB "
                 f"per sequence of {m.seq_length}.")
    if ddp > usable:
        lines.append(f"So plain data parallelism (DDP, a full copy per GPU) is impossible: the model state "
                     f"alone is {ddp / usable:.1f}x the usable memory.")
    chosen = p.choice
    lines += _simpler_layouts(p)
    if chosen is None:
        lines.append("Nothing fits, even with full recomputation and ZeRO-3: use more or larger GPUs, "
                     "a smaller micro batch or sequence, or CPU offload of the optimizer (--offload-optimizer).")
        return lines
    lay = chosen.layout
    lines.append(f"Recommended: {lay.describe()}: {_gib(chosen.memory['total'])} per GPU "
                 f"({_breakdown(chosen)}), {held_words(chosen)}.")
    why = []
    if lay.zero == 1:
        why.append(f"ZeRO-1 shards the fp32 master weights and Adam moments over the {lay.dp * lay.cp} "
                   f"data-parallel ranks for DDP's traffic (reduce-scatter + all-gather = one all-reduce)")
    if lay.zero == 2:
        why.append(f"ZeRO-2 also shards the gradients over the {lay.dp * lay.cp} data-parallel ranks, "
                   f"but megalite reduce-scatters them every micro-batch ({chosen.num_micro} per step)")
    if lay.tp > 1:
        why.append(f"TP {lay.tp} splits every layer inside a node, its per-layer all-reduces on "
                   f"{chosen.comm['tp']['link']}")
    if lay.pp > 1:
        why.append(f"PP {lay.pp} cuts the layers into stages (p2p on {chosen.comm['pp']['link']}); {lay.schedule_label} "
                   f"bubble {chosen.bubble:.1%} with M = {chosen.num_micro}")
    if lay.zero == 3:
        why.append("ZeRO-3 shards the weights too, gathering each layer before use (1.5x DDP traffic)")
    if lay.ep > 1:
        shard = (f" (ZeRO-{lay.zero} shards their state over the {lay.edp} GPUs holding the same experts)"
                 if lay.zero and lay.edp > 1 else "")
        why.append(f"EP {lay.ep} holds {m.num_experts // lay.ep} of the {m.num_experts} experts of each MoE layer "
                   f"per GPU{shard}; tokens travel to them by all-to-all on {chosen.comm['ep']['link']}")
    if lay.cp > 1:
        why.append(f"{describe_cp(lay)} splits the long sequence, dividing activations by {lay.cp}")
    if lay.recompute == "selective":
        why.append("selective recomputation recomputes the attention scores instead of storing them (a few % compute)")
    if lay.recompute == "full":
        why.append("full recomputation stores only each layer's input (~33% more compute)")
    if why:
        lines.append("Why: " + "; ".join(why) + ".")
    comm = format_communication(chosen.comm)  # GiB of wire bytes: the dry run's 'wire' column
    lines.append(f"Communication per step per GPU (no overlap): {comm or 'none'}.")
    lines += explain_speed(p)
    lines += explain_cp_type(p)
    lines += explain_schedule(p)
    return lines
