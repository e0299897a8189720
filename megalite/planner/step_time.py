"""The step-time model: one training step of a layout, in seconds, as a sum of named terms a user
can read (issue 40). Part of the planner (:mod:`megalite.planner`), on the floor between
:mod:`.pipeline` (the bubble) and :mod:`.estimate` (whose wire bytes per kind it times:
:func:`megalite.planner.estimate.communication`). Every term is the time a rank *waits* for that
thing; what hides behind compute is not counted. Notation: T tokens per step (global batch x s),
G GPUs, F the model FLOPs per token (:func:`megalite.model.counting.flops_per_token`), R the
achieved FLOP/s per GPU (``Hardware.achieved_tflops``), M micro-batches per step, N = DP x CP the
ranks reducing one shard's gradients, r(n) = (n-1)/n, B the link's bandwidth (NVLink inside a
node, InfiniBand across: the link :mod:`.estimate` names), lambda its latency per call::

    compute    C = F T k u / (G R)     k = 4/3 with full recomputation (the forward twice); selective
                                      recomputation adds the attention's score forward, 4 L h s per token;
                                      u >= 1 the pipeline's imbalance (:func:`pipeline_imbalance`): a
                                      pipeline runs at its slowest rank's pace, and the rank holding the
                                      output layer (6 V h FLOPs a token, and the MTP depths) does more
    bubble     C b / (1 - b)           b: the schedule's idle fraction (:func:`.pipeline.bubble`)
    dp         the gradient reduction over N (and the update rule's own DP collectives, exposed):
               ZeRO-0    all-reduce 2 Psi g r(N) / B of the buckets, each started as the last
                         micro-batch's backward fills it (--overlap-grad-reduce, which the planner
                         prints with DP x CP > 1): exposed the last bucket plus what outlasts that
                         backward (2/3 of a micro-batch's compute; 3/4 with full recomputation)
               ZeRO-1    the same with a reduce-scatter, Psi g r(N) / B; then the all-gather of the
                         updated weights Psi w r(N) / B, exposed
               ZeRO-2    per micro-batch a reduce-scatter of Psi g r(N) / B, bucket by bucket during
                         that micro-batch's backward: exposed its last bucket plus what outlasts the
                         backward; then the all-gather of the weights, exposed
               ZeRO-3    per micro-batch the weights gathered per layer before the forward and the
                         backward and the gradients reduce-scattered per layer, prefetched one layer
                         ahead: exposed the first layer of each pass plus what outlasts the compute
    edp        the expert parameters' reduction over EDP, by the same rules
    tp         TP's (SP's) collectives: on the critical path, all exposed
    pp         each micro-batch's activation and gradient sends: exposed at the stage boundaries
               (ZBV's middle ranks send twice, the interleaved 1F1B at each of its V chunks)
    cp         p2p (the ring, and a2a+p2p's outer ring): hidden behind each block's attention when
               that is longer: max(0, ring time - attention compute); a2a, allgather and the inner
               level of a2a+p2p: exposed. The types that attend block by block (p2p, allgather,
               a2a+p2p) run the rank's attention at the blocks' rate R_b, not R: + A (R / R_b - 1),
               A the rank's attention at R (:func:`attention_seconds`), R_b = ``Hardware.cp_block_tflops``
               (at most R; R where no profile measured it: the Triton blocks on a GPU, torch's reference blocks
               on a CPU, 0.014-0.019 TFLOP/s against R = 0.064 here); the ring hides behind A R / R_b
    ep         the MoE all-to-alls (dispatch, combine; forward and backward): exposed
    optimizer  the step on the rank's shard S (Psi, / N under ZeRO >= 1): master + state bytes read
               and written, the gradient read and the weight written, at the HBM bandwidth:
               S (2 o + g + w) / HBM; with Muon also Newton-Schulz's FLOPs at R, the busiest rank's
               (per a x b matrix, a <= b, and step 4 a^2 b + 2 a^3; the whole matrix under TP's
               duplicated mode, the block under blockwise, 4 c d^2 + 2 d^3 under distributed, c the
               block's cut extent and d the uncut one; under ZeRO 1-2 the matrices the rank owns)
    overlap    o x the link time hidden behind compute (the gradient reductions, ZeRO-3's gathers,
               CP's ring), o = ``Hardware.overlap_cost``: a hidden collective still holds SMs and HBM
               bandwidth on a GPU (o = 0.10 assumed, :data:`OVERLAP_COST`); on a CPU its transport
               threads take the cores the compute runs on (o ~ 1 measured). A calibrated profile
               measures o (tools/calibrate_hardware.py: GEMMs with a collective in flight against
               each alone)
    latency    lambda per exposed collective call (:func:`exposed_calls`, the counts a step makes,
               checked by counting a run's calls): TP with SP 10 per layer and micro-batch (13 with
               full recomputation), the embedding's 2 and the output layer's 5 as the slowest
               stage holds them (:func:`tp_calls`); PP 2 per micro-batch and send (ZBV 2, interleaved V:
               :func:`.pipeline.p2p_factor`); ZeRO-0/1 one (the last
               bucket; ZeRO-1 also one per bucket for the weights' gather); ZeRO-2 one (the last
               bucket) per micro-batch and one per bucket for the weights' gather; ZeRO-3 two per
               micro-batch; EP 5 per MoE layer and micro-batch; CP a2a 8 and allgather 3 per layer
               and micro-batch (:func:`cp_calls_per_layer`). A calibrated profile's lambda: its fits'
               intercept, or a call issued after compute as a step issues them (calibrate_hardware.py
               --latency after-compute)

Step time = the sum. Offload (--offload-optimizer) is not planned, so no host traffic term.
Not modelled: two collectives sharing one link, and GEMM efficiency changing with the shapes a
layout produces (``achieved_tflops`` is one figure): on this project's CPU a layer's linears at
TP 2's and CP 2's shard shapes ran at the full shapes' rate within the noise (75-97 against 78-95
GFLOP/s, one thread, docs/BENCHMARKS.md), so a per-shape rate table is not worth its terms here.
"""
from __future__ import annotations

import math

from megalite.config import ModelConfig
from megalite.context_parallel.comm_types import cp_comm_type
from megalite.model.counting import attended_flops, flops_per_token, mtp_depths
from megalite.planner import pipeline as planner_pipeline
from megalite.planner.flags import training_defaults
from megalite.planner.types import Hardware, Layout, Precision
from megalite.planner.update_traffic import newton_schulz_flops, ring, update_traffic

BUCKET = training_defaults()["ddp_bucket_size"]  # elements per gradient bucket, pretrain_gpt.py's default
TERMS = ("compute", "bubble", "dp", "edp", "tp", "pp", "cp", "ep", "optimizer", "latency", "overlap")
# What a collective hidden behind compute still costs, per second of its link time, where no profile
# measured it: its kernels hold SMs (NCCL's channels) and HBM bandwidth the matmuls would use. An
# assumption for a GPU (10%), Hardware's default; a calibrated profile replaces it (hw.overlap_cost).
OVERLAP_COST = Hardware.__dataclass_fields__["overlap_cost"].default
# Collective calls a step makes, counted in runs of the sweep's GPT (comm.count_collectives and the
# waits of comm.blocked; 8 micro-batches, 4 layers): per layer and micro-batch, TP with SP forward
# 2 all-gathers + 2 reduce-scatters, backward their 4 conjugates + the 2 re-gathers of QKV's and
# FC1's inputs = 10; full recomputation's forward again 3 more (its last reduce-scatter not needed)
TP_CALLS_PER_LAYER = {"none": 10, "selective": 10, "full": 13}
# per micro-batch outside the layers: the embedding's reduce-scatter into the sequence split and its
# backward all-gather; the output layer's all-gather, its backward reduce-scatter and re-gather, and
# the vocabulary-parallel loss's 2 all-reduces (the logits' max and the sum of exponentials)
TP_CALLS_EMBEDDING, TP_CALLS_OUTPUT = 2, 5


def link_rate(hw: Hardware, link: str) -> tuple[float, float]:
    """(bytes per second, seconds per call) of a link named as :mod:`.estimate` names it."""
    if link == "InfiniBand":
        return hw.ib_gbps * 1e9, hw.ib_latency_us * 1e-6
    return hw.nvlink_gbps * 1e9, hw.nvlink_latency_us * 1e-6


def backward_share(recompute: str) -> float:
    """The backward's share of a micro-batch's compute (B = 2F; full recomputation adds F to it)."""
    return 3 / 4 if recompute == "full" else 2 / 3


def compute(m: ModelConfig, layout: Layout, global_batch: int, hw: Hardware) -> float:
    """C = F T k u / (G R), plus selective recomputation's score forward (module docstring)."""
    tokens = global_batch * m.seq_length
    flops = flops_per_token(m) * (4 / 3 if layout.recompute == "full" else 1)
    if layout.recompute == "selective":
        flops += attended_flops(m) * m.seq_length
    return flops * tokens * pipeline_imbalance(m, layout) / (layout.world_size * hw.achieved_tflops * 1e12)


def pipeline_imbalance(m: ModelConfig, layout: Layout) -> float:
    """u = max_p W_p / (W / P): the work per token of the pipeline rank doing the most over the mean
    (1 without PP). W is F less the lookups ``flops_per_token`` counts by convention (an untied
    embedding's 6 V h, learned positions' 6 S h: no matmul runs them); it splits into the output
    layer's 6 V h (with D MTP depths also their 6 D V h logits and D layers) on the last chunk and
    L + D equal layer shares; rank p does its chunks' layers (:func:`.pipeline.local_chunks`) and
    the output layer if it holds the last chunk. Recomputation runs the layers' forward again (x 4/3
    full, + the scores' forward selective), not the output layer's, so it scales the layer shares
    only. megalite splits the layers evenly (as Megatron without
    --decoder-last-pipeline-num-layers), so the last stage waits on nothing and the others wait on
    it. (MTP's eh_proj and the norms are spread with the layer shares: a few h^2 a token.)"""
    P = layout.pp
    if P == 1:
        return 1.0
    depths, h = mtp_depths(m), m.hidden_size
    lookups = 6.0 * m.vocab_size * h if m.untie_embeddings_and_output_weights else 0.0
    if m.position_embedding_type == "learned_absolute":
        lookups += 6.0 * m.max_position_embeddings * h
    out = 6.0 * m.vocab_size * h * (1 + depths)
    layer = (flops_per_token(m) - lookups - out) / (m.num_layers + depths)
    layer *= 4 / 3 if layout.recompute == "full" else 1
    if layout.recompute == "selective":
        layer += attended_flops(m) * m.seq_length / (m.num_layers + depths)
    work = (m.num_layers + depths) * layer + out
    chunks = planner_pipeline.num_chunks(layout.schedule, P, layout.virtual)
    last = chunks - 1
    busiest = max(sum(m.num_layers / chunks * layer + (out + depths * layer if g == last else 0.0)
                      for g in planner_pipeline.local_chunks(layout.schedule, P, rank, layout.virtual))
                  for rank in range(P))
    return busiest / (work / P)


def bubble(compute_s: float, idle: float) -> float:
    """The pipeline's idle time: C b / (1 - b), b the schedule's bubble fraction."""
    return compute_s * idle / (1 - idle)


def buckets(psi: int) -> int:
    """Gradient buckets of ``psi`` parameters at pretrain_gpt.py's --ddp-bucket-size."""
    return max(1, math.ceil(psi / BUCKET))


def gradient_reduction(psi: int, n: int, zero: int, num_micro: int, prec: Precision, compute_s: float,
                       recompute: str, rate: float, layers: int = 1) -> tuple[float, int, float]:
    """(exposed seconds, exposed calls, hidden seconds) of reducing ``psi`` parameters' gradients over ``n`` ranks
    (module docstring, 'dp'); ``rate`` bytes/s of the link, ``compute_s`` the step's compute,
    ``layers`` the rank's layers (ZeRO-3 gathers one at a time)."""
    if n <= 1 or not psi:
        return 0.0, 0, 0.0
    w, g, M, r = prec.weight_bytes, prec.grad_bytes, num_micro, ring(n)
    k = buckets(psi)
    window = compute_s / M * backward_share(recompute)  # one micro-batch's backward
    if zero <= 1:  # the buckets' all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1) in the last backward
        reduce = (2 if zero == 0 else 1) * psi * g * r / rate
        shown = reduce / k + max(0.0, reduce - reduce / k - window)
        gather = psi * w * r / rate if zero == 1 else 0.0  # the updated weights, after the step
        return shown + gather, 1 + (k if zero == 1 else 0), reduce - shown
    if zero == 2:
        scatter = psi * g * r / rate
        last = scatter / k
        shown = last + max(0.0, scatter - last - window)
        return M * shown + psi * w * r / rate, M + k, M * (scatter - shown)
    per_micro = psi * (g + 2 * w) * r / rate
    first = psi * 2 * w * r / rate / max(1, layers)  # ZeRO-3: the first layer's gathers, forward and backward
    shown = first + max(0.0, per_micro - first - compute_s / M)
    return M * shown, 2 * M, M * (per_micro - shown)


def exposed(comm: dict, kind: str) -> float:
    """The link time of a kind of traffic that nothing hides."""
    return comm[kind]["seconds"] if kind in comm else 0.0


def attention_seconds(m: ModelConfig, layout: Layout, global_batch: int, hw: Hardware) -> float:
    """The step's attention-score compute per rank (forward and backward, 3 x 4 L h s per token)."""
    return 3 * attended_flops(m) * m.seq_length * global_batch * m.seq_length / (layout.world_size
                                                                                  * hw.achieved_tflops * 1e12)


def context_parallel(m: ModelConfig, layout: Layout, comm: dict, global_batch: int,
                     hw: Hardware) -> tuple[float, float]:
    """CP's (exposed, hidden) time: a ring (p2p, a2a+p2p's outer level) behind the attention it feeds when
    that is longer; all-to-alls and allgather's gathers exposed; the blocks' slower rate,
    A (R / R_b - 1), for the types attending block by block (all but a2a; module docstring)."""
    if layout.cp == 1:
        return 0.0, 0.0
    ring_kinds = ("cp",) if layout.cp_comm_type == "p2p" else ("cp_outer",)
    hidden = sum(exposed(comm, k) for k in ring_kinds)
    shown = sum(exposed(comm, k) for k in ("cp", "cp_inner", "cp_outer") if k not in ring_kinds)
    attention = attention_seconds(m, layout, global_batch, hw)
    blocked = hw.cp_block_tflops and layout.cp_comm_type != "a2a"  # never faster than R: a term is a wait
    rate = min(hw.cp_block_tflops, hw.achieved_tflops) if blocked else hw.achieved_tflops
    blocks = attention * hw.achieved_tflops / rate
    behind = min(hidden, blocks)
    return shown + hidden - behind + blocks - attention, behind


def optimizer(m: ModelConfig, layout: Layout, psi: int, matrices: int, prec: Precision, hw: Hardware,
              stage: int = 0) -> float:
    """The optimizer step on the rank's shard: S (2 o + g + w) / HBM; Muon's Newton-Schulz FLOPs of
    the busiest rank (:func:`megalite.planner.update_traffic.newton_schulz_flops`) at R."""
    n = layout.dp * layout.cp
    share = 1 / n if layout.zero >= 1 else 1.0
    o, g, w = prec.optimizer_bytes, prec.grad_bytes, prec.weight_bytes
    state = (psi - matrices) * o + matrices * prec.matrix_bytes
    seconds = share * (2 * state + psi * (g + w)) / (hw.hbm_gbps * 1e9)
    if prec.update.muon:
        seconds += newton_schulz_flops(m, layout, prec.update, stage, BUCKET) / (hw.achieved_tflops * 1e12)
    return seconds


def tp_calls(m: ModelConfig, layout: Layout, layers: int, stage: int = 0) -> int:
    """TP's (SP's) collective calls per micro-batch on a rank of pipeline stage ``stage`` holding
    ``layers`` layers: ``layers x`` :data:`TP_CALLS_PER_LAYER` (an MoE layer without a shared expert
    half of it: its MLP has no TP collective, as :func:`.estimate.communication` counts the bytes)
    plus the embedding's and the output layer's (:data:`TP_CALLS_EMBEDDING`, :data:`TP_CALLS_OUTPUT`)
    of the stage holding the most of them (:func:`.pipeline.local_chunks`): a pipeline runs at its
    slowest stage's pace, so 5 for 1F1B's last stage, 7 for ZBV's first (both ends on one rank).
    The planner pairs TP with SP."""
    per_layer = TP_CALLS_PER_LAYER[layout.recompute]
    calls = layers * per_layer
    if not m.moe_shared_expert_intermediate_size:
        calls -= planner_pipeline.moe_layers_on_rank(m, layout.schedule, layout.pp, stage,
                                                     layout.virtual) * (per_layer // 2)
    last = planner_pipeline.num_chunks(layout.schedule, layout.pp, layout.virtual) - 1
    ends = (planner_pipeline.local_chunks(layout.schedule, layout.pp, rank, layout.virtual)
            for rank in range(layout.pp))
    return calls + max((TP_CALLS_EMBEDDING if 0 in chunks else 0) + (TP_CALLS_OUTPUT if last in chunks else 0)
                       for chunks in ends)


def cp_calls_per_layer(cp_type: str) -> int:
    """CP's exposed calls per layer and micro-batch: a2a (and a2a+p2p's inner level) 8 all-to-alls
    (Q, K, V in and the output back, forward and backward); allgather 3 (K and V gathered forward,
    their gradients reduce-scattered as one backward); the p2p ring's exchanges hide behind its
    blocks (the 'cp' term), so 0."""
    if cp_type == "allgather":
        return 3
    return 8 if cp_type == "a2a" or cp_comm_type(cp_type).hierarchical else 0


def exposed_calls(m: ModelConfig, layout: Layout, num_micro: int, comm: dict, stage: int = 0) -> dict[str, int]:
    """Exposed collective calls per kind of traffic but the gradients' (module docstring, 'latency'):
    EP 5 per MoE layer and micro-batch (dispatch and combine, forward and backward, and the
    forward's exchange of token counts)."""
    M, layers = num_micro, m.num_layers // layout.pp
    calls = {}
    if "tp" in comm:
        calls["tp"] = M * tp_calls(m, layout, layers, stage)
    if "pp" in comm:
        calls["pp"] = 2 * M * planner_pipeline.p2p_factor(layout.schedule, layout.pp, layout.virtual)
    if "ep" in comm:
        calls["ep"] = 5 * M * planner_pipeline.moe_layers_on_rank(m, layout.schedule, layout.pp, stage,
                                                                  layout.virtual)
    if layout.cp > 1:
        kind = cp_comm_type(layout.cp_comm_type)
        calls["cp_inner" if kind.hierarchical else "cp"] = M * layers * cp_calls_per_layer(layout.cp_comm_type)
    return calls


def step_terms(m: ModelConfig, layout: Layout, global_batch: int, num_micro: int, comm: dict, prec: Precision,
               hw: Hardware, psi: int, psi_expert: int = 0, matrices: int = 0, stage: int = 0) -> dict[str, float]:
    """The named terms (seconds, :data:`TERMS`) of one step of ``layout`` for a rank of pipeline
    stage ``stage`` holding ``psi`` parameters (``psi_expert`` of them experts; ``matrices`` in
    the update rule's matrix class), given :func:`megalite.planner.estimate.communication`'s
    ``comm`` for that rank."""
    c = compute(m, layout, global_batch, hw)
    terms = dict.fromkeys(TERMS, 0.0)
    terms["compute"] = c
    terms["bubble"] = bubble(c, planner_pipeline.bubble(layout.schedule, layout.pp, num_micro, layout.virtual))
    latency = hidden = 0.0
    for kind, group_psi, n in (("dp", psi - psi_expert, layout.dp * layout.cp), ("edp", psi_expert, layout.edp)):
        if kind not in comm:
            continue
        rate, lam = link_rate(hw, comm[kind]["link"])
        seconds, calls, behind = gradient_reduction(group_psi, n, layout.zero, num_micro, prec, c, layout.recompute, rate,
                                            m.num_layers // layout.pp)
        own = update_traffic(m, layout, prec, stage, BUCKET).get(kind, 0.0)  # Muon's gathers: after backward
        own_calls = 2 * buckets(group_psi) if own else 0
        terms[kind] = seconds + own / rate
        latency += (calls + own_calls) * lam
        hidden += behind
    for kind in ("tp", "pp", "ep"):
        terms[kind] = exposed(comm, kind)
    terms["cp"], behind = context_parallel(m, layout, comm, global_batch, hw)
    for kind, calls in exposed_calls(m, layout, num_micro, comm, stage).items():
        latency += calls * link_rate(hw, comm[kind]["link"])[1] if kind in comm else 0.0
    terms["optimizer"] = optimizer(m, layout, psi, matrices, prec, hw, stage)
    terms["latency"] = latency
    terms["overlap"] = hw.overlap_cost * (hidden + behind)
    return terms


def tokens_per_second(m: ModelConfig, global_batch: int, step_seconds: float) -> float:
    """The whole machine's training throughput."""
    return global_batch * m.seq_length / step_seconds


def mfu(m: ModelConfig, global_batch: int, step_seconds: float, hw: Hardware) -> float:
    """Model FLOPs utilisation: F T / (step time x peak x G), F without recomputation."""
    return flops_per_token(m) * global_batch * m.seq_length / (step_seconds * hw.peak_tflops * 1e12 * hw.world_size)


def days_to_train(m: ModelConfig, global_batch: int, step_seconds: float, train_tokens: float) -> float:
    """Days to see ``train_tokens`` tokens at this step time."""
    return train_tokens / tokens_per_second(m, global_batch, step_seconds) / 86400
