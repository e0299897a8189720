"""Layout planner: memory, bubble and communication per GPU for every candidate layout.

Pure arithmetic (no processes, no tensors); ``tools/plan_parallel.py`` is its command line.
Units: bytes; memory is compared in GiB (2**30 bytes: a "24 GB" card holds 24 GiB).

**Model state** (per rank, Psi = parameters this rank's TP/PP shard holds, N = DP x CP,
the ranks that share one shard of the model and reduce its gradients; megalite's grid
reduces over ``dp_cp``). Mixed precision with Adam stores per parameter 2 bytes of bf16
weights + 2 bytes of bf16 gradients + 12 bytes of fp32 optimizer state (4 master weight
+ 4 Adam m + 4 Adam v) = **16 bytes**, and the ZeRO stages divide the parts by N
(``megalite.data_parallel.accounting.zero_theory_bytes``): 16 Psi, 4 Psi + 12 Psi/N,
2 Psi + 14 Psi/N, 16 Psi/N. A 7B model therefore needs 16 x 7e9 = 112 GB before
activations. (A rougher rule counts fp16 weights + fp16 gradients + 4 bytes of optimizer
state = 8 bytes/param, i.e. 56 GB for 7B; that undercounts Adam, which keeps an fp32
master copy and two fp32 moments. Both exceed a 24 GB GPU many times over, so plain DDP
is impossible either way; the planner uses the 16-byte figure and reports its parts.)
megalite's ``--bf16`` accumulates gradients in fp32 by default (``fp32_grads``: 18 bytes), and so
does the planner by default (:mod:`megalite.planner.flags` reads every default from
``pretrain_gpt.py``'s parser and writes each layout as the flags that train it).

**Experts** (``m.num_experts``; ``Layout.ep``): the MoE layers' parameters, their model state
over the expert-data-parallel group, their routed-token activations and transients, the
all-to-all ('ep') and expert-gradient ('edp') traffic are in :mod:`megalite.moe.planning`.

Psi of a rank on pipeline stage p, with TP = t: its L/P layers, whose large matrices are
split over TP and whose norms and row-parallel biases are replicated, plus on the first
stage the word embedding (vocabulary padded to a multiple of 128 t, split over TP) and
learned positions, and on the last stage the final norm and the output layer (with tied
embeddings and P > 1 the last stage holds its own copy of the word embedding).

**Activations** per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"), 16-bit, with dropout masks of 1 byte (none
without dropout: ``--hidden-dropout 0`` drops the two per layer and the embedding's),
for s tokens, micro batch b, hidden h, a heads::

    s b h (34 + 5 a s / h)     bytes without recomputation, t = 1
    s b h (10 + 24/t + 5 a s / (h t))            with TP, no sequence parallelism
    s b h / t (34 + 5 a s / h)                   with TP and sequence parallelism
    selective recomputation drops the 5 a s / h term (attention scores, recomputed);
    full recomputation keeps only the layer input, 2 s b h (/t under SP), plus one
    layer's full activations while it is recomputed during backward.

The 34 is 10 replicated (norm inputs 2+2, QKV and FC1 inputs 2+2, two dropout masks 1+1)
plus 24 split over TP (Q, K, V 2+2+2, attention output 2, GELU input and output 2 x 8 for
an FFN of 4h); the code computes the parts from the real FFN size, key/value groups and
SwiGLU (which stores gate, up, silu(gate) and their product: 8 s b f instead of 4 s b f).
The last stage adds fp32 logits for the loss, 4 s b V / t. With CP each rank holds s/CP
tokens (``--cp-comm-type allgather`` adds one layer's full-sequence K/V and fp32 dK/dV during
backward: :mod:`megalite.planner.cp`). ``flash_attention=True`` drops the scores term as selective recomputation does
(flash-style kernels never store the s x s probabilities). The attention output is kept once:
megalite's Triton kernel writes it in the (s, b, heads, d) order proj reads (and flash-attn's
(b, s, heads, d) output is a view there too); torch SDPA on a GPU returns (b, heads, s, d), so
proj keeps a second copy, B s b h / t more per layer, which is not counted here.

**Data**: the step's M micro-batches, all on the device from its start, 28 bytes a token (36 with
``--reset-attention-mask``), plus CP's sliced copies (:mod:`megalite.planner.documents`).

Micro-batches in flight: 1 without PP (gradient accumulation finishes each backward
before the next forward); with PP, M = global batch / (micro batch x DP) per step and the
schedule (``Layout.schedule``: 1f1b, zb-h1, zbv) sets the bubble, the micro-batches whose
activations and W inputs a stage holds, and ZBV's chunks: :mod:`megalite.planner.pipeline`.

**Communication** per step, bytes on the wire per rank (ring collectives: an all-reduce
moves 2 (n-1)/n of the tensor, all-gather and reduce-scatter (n-1)/n each), w and g the
weight and gradient bytes::

    DP, ZeRO-0: all-reduce of the gradients             2 Psi g (N-1)/N
    ZeRO-1: reduce-scatter gradients + all-gather weights   Psi (g + w) (N-1)/N
    ZeRO-2: reduce-scatter every micro-batch (megalite)     Psi (M g + w) (N-1)/N
    ZeRO-3: + weights gathered before each forward and backward: Psi M (g + 2 w) (N-1)/N,
            1.5x DDP at M = 1
    TP: 4 all-reduces of b s h (2 bytes) per layer per micro-batch (6 with full recompute);
        under SP an all-gather + reduce-scatter pair in place of each, plus the backward's
        all-gathers of the QKV and FC1 inputs (kept as sequence shards): one all-reduce more
    PP: each micro-batch's activation forward and its gradient backward, b s h (/t under SP)
    CP: by --cp-comm-type (:mod:`megalite.planner.cp`): the ring's K/V (and backward's dK/dV),
        Ulysses' all-to-alls, allgather's gathered K/V, or both levels of a2a+p2p

A group runs on NVLink (~450 GB/s) when all its ranks are on one node and on InfiniBand
(~50 GB/s) otherwise; rank order is megalite's grid, ``rank = tp + TP*(cp + CP*(dp + DP*pp))``.
Times assume no overlap with compute (an upper bound on what communication can cost).

**Step time** (:mod:`megalite.planner.step_time`): each estimate carries its step's named terms
(``Estimate.step``: compute, bubble, the exposed part of each kind of communication above,
optimizer, latency, the overlap's cost) for a rank of the fullest stage.

**Recommendation** (:mod:`megalite.planner.search`): the layout that fits with the shortest
estimated step; among those within 1% of it, the first along the practitioners' ladder (see
``RUNGS`` and ``ladder_key`` there): DDP; ZeRO-1; ZeRO-2; TP inside a node (2, 4, 8, with sequence
parallelism); PP across nodes (TP as large as the node allows); ZeRO-3; then CP (CP 2 climbs the
same ladder, then CP 4 ...; the CP types and pipeline schedules of one layout fastest first).
Within a step, recomputation none before selective; full recomputation last. The explanation
prints the recommendation's step term by term, tokens/s, MFU, the runner-up and the margin, and
why each simpler step does not fit or is slower.
"""
from __future__ import annotations

import functools

from megalite.config import ModelConfig
from megalite.data_parallel.accounting import zero_theory_bytes
from megalite.layers.part_shape import norm_parameters
from megalite.model.counting import layer_activation_bytes, layer_parameters, total_parameters  # noqa: F401  (the parts' shapes)
from megalite.model.counting import layer_matrix_parameters, mtp_depths, mtp_matrix_parameters, mtp_parameters
from megalite.model.parts import attention_part
from megalite.moe import parameter_buckets, planning as moe_planning
from megalite.parallel.grid import EXPERT_KINDS, GridLayout
from megalite.pipeline.schedule_kinds import schedule as describe_schedule
from megalite.planner import cp as planner_cp, documents as planner_documents, pipeline as planner_pipeline
from megalite.planner.flags import training_defaults
from megalite.planner.pipeline import stage_activation_bytes
from megalite.planner.step_time import step_terms
from megalite.planner.types import Estimate, GiB, Hardware, Layout, Precision
from megalite.planner.update_traffic import update_traffic

DEFAULT_BUCKET = training_defaults()["ddp_bucket_size"]  # elements, pretrain_gpt.py's default


# -- parameters ------------------------------------------------------------------------------------

_COUNTS: dict[tuple, tuple] = {}  # (id(m), function, its arguments) -> (m, count): a search asks each often


def _per_model(count):
    """``count(m, *args)`` remembered per model object and arguments: a search estimates every ZeRO
    stage and recomputation of one grid, whose parameters are the same (as ``stage_activation_bytes``
    does, the entry holds the model itself, so a new model at a reused id misses)."""
    @functools.wraps(count)
    def remembered(m: ModelConfig, *args):
        key = (id(m), count.__name__, *args)
        hit = _COUNTS.get(key)
        if hit is None or hit[0] is not m:
            if len(_COUNTS) > 20000:
                _COUNTS.clear()
            hit = _COUNTS[key] = (m, count(m, *args))
        return hit[1]
    return remembered


def stage_parameters(m: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0, ep: int = 1,
                     schedule: str = "1f1b", virtual: int = 1) -> int:
    """Psi of one rank on pipeline stage ``stage``: what its weights and gradients hold
    (with experts: its dense parameters and its E/EP experts, :mod:`megalite.moe.planning`).
    ZBV: chunks p and 2P-1-p of 2P; rank 0 holds embedding and output layer (tied: both copies);
    interleaved (``virtual`` V > 1): chunks c P + p of P V."""
    return _stage_parameters(m, tp, pp, stage, ep, schedule, virtual)


@_per_model
def _stage_parameters(m: ModelConfig, tp: int, pp: int, stage: int, ep: int, schedule: str,
                      virtual: int = 1) -> int:
    kind = describe_schedule(schedule)
    if kind.chunks_per_rank(virtual) > 1:  # each of the rank's chunks as a stage of a pipeline of P V chunks
        return sum(stage_parameters(m, tp, kind.pipeline_chunks(pp, virtual), g, ep)
                   for g in kind.local_chunks(pp, stage, virtual))
    split, replicated = layer_parameters(m, tp)
    psi = (m.num_layers // pp) * (split + replicated)
    if m.num_experts:
        psi = sum(moe_planning.layers_parameters(m, (split, replicated), tp, ep,
                                                 moe_planning.stage_layers(m, pp, stage)))
    embedding = m.padded_vocab_size(tp) * m.hidden_size // tp
    tied = not m.untie_embeddings_and_output_weights
    first, last = stage == 0, stage == pp - 1
    if first:
        psi += embedding
        if m.position_embedding_type == "learned_absolute":
            psi += m.max_position_embeddings * m.hidden_size
    if last:
        psi += norm_parameters(m)
        if not tied or not first:  # the output layer, or the last stage's copy of the embedding
            psi += embedding
        if mtp_depths(m):  # the MTP depths, and an untied model's copy of the embedding they read
            psi += sum(mtp_parameters(m, tp, ep)) + (embedding if not tied and not first else 0)
    return psi


def stage_expert_parameters(m: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0, ep: int = 1,
                            schedule: str = "1f1b", virtual: int = 1) -> int:
    """The part of :func:`stage_parameters` that is experts (reduced over expert-data-parallel ranks)."""
    return _stage_expert_parameters(m, tp, pp, stage, ep, schedule, virtual)


@_per_model
def _stage_expert_parameters(m: ModelConfig, tp: int, pp: int, stage: int, ep: int, schedule: str,
                      virtual: int = 1) -> int:
    if not m.num_experts:
        return 0
    kind = describe_schedule(schedule)
    if kind.chunks_per_rank(virtual) > 1:
        return sum(stage_expert_parameters(m, tp, kind.pipeline_chunks(pp, virtual), g, ep)
                   for g in kind.local_chunks(pp, stage, virtual))
    layers = moe_planning.stage_layers(m, pp, stage)
    mtp = mtp_parameters(m, tp, ep)[1] if stage == pp - 1 else 0
    return moe_planning.layers_parameters(m, layer_parameters(m, tp), tp, ep, layers)[1] + mtp


def stage_matrix_parameters(m: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0, ep: int = 1,
                            schedule: str = "1f1b", virtual: int = 1) -> int:
    """The part of :func:`stage_parameters` that is weight matrices of the layers (attention and
    MLP linears, MLA's projections, stacked experts, MTP's ``eh_proj`` and layer): what an update
    rule's matrix class takes (Muon), counted from the parts' ``matrix_counts``; embeddings, the
    output layer, norms, biases and routers are the rest."""
    return _stage_matrix_parameters(m, tp, pp, stage, ep, schedule, virtual)


@_per_model
def _stage_matrix_parameters(m: ModelConfig, tp: int, pp: int, stage: int, ep: int, schedule: str,
                      virtual: int = 1) -> int:
    kind = describe_schedule(schedule)
    if kind.chunks_per_rank(virtual) > 1:
        return sum(stage_matrix_parameters(m, tp, kind.pipeline_chunks(pp, virtual), g, ep)
                   for g in kind.local_chunks(pp, stage, virtual))
    layers = moe_planning.stage_layers(m, pp, stage)
    mtp = sum(mtp_matrix_parameters(m, tp, ep)) if stage == pp - 1 else 0
    return sum(moe_planning.layers_matrix_parameters(m, layer_matrix_parameters(m, tp), tp, ep, layers)) + mtp


def model_state_bytes(psi: int, n: int, zero: int, prec: Precision, matrices: int = 0) -> dict[str, float]:
    """Weights, gradients, fp32 master + optimizer state per rank (the ZeRO arithmetic);
    ``matrices`` of the ``psi`` parameters take ``prec.matrix_bytes`` of master + state (Muon: 8)."""
    return zero_theory_bytes(psi, n, zero, prec.weight_bytes, prec.grad_bytes, prec.optimizer_bytes, matrices,
                             prec.matrix_bytes)


# -- activations -----------------------------------------------------------------------------------

# -- communication ---------------------------------------------------------------------------------

# What the planner's communication figures count, said under every table that prints them.
WIRE_MEASURE = ("wire bytes per rank per step: what one rank sends over its links in ring collectives, "
                "(n-1)/n of the tensor for n ranks, twice for an all-reduce, all of a p2p send; "
                "tools/dry_run.py prints the same measure as 'wire'")


def format_communication(comm: dict) -> str:
    """Each kind's wire bytes per rank per step in GiB with its link and time (no overlap), e.g.
    ``DP 0.68 GiB on NVLink 2 ms``: the unit and measure of tools/dry_run.py's 'wire' column."""
    return ", ".join(f"{k.upper()} {c['bytes'] / GiB:.2f} GiB on {c['link']} {c['seconds'] * 1e3:.0f} ms"
                     for k, c in comm.items())


def group_spans_nodes(layout: Layout, kind: str, gpus_per_node: int) -> bool:
    """Whether any group of this kind ('tp', 'cp', 'dp_cp', 'pp', 'ep', 'edp') has ranks on two nodes."""
    grid = GridLayout(**{**layout.grid_sizes(), "experts": kind in EXPERT_KINDS})  # the rank mapping alone
    return _spans(grid, kind, gpus_per_node)


@functools.lru_cache(maxsize=4096)
def _spans(grid: GridLayout, kind: str, gpus_per_node: int) -> bool:
    return any(len({r // gpus_per_node for r in ranks}) > 1 for ranks in grid.groups(kind))  # megalite's rank order


def communication(m: ModelConfig, layout: Layout, psi: int, micro: int, num_micro: int, prec: Precision,
                  hw: Hardware, stage: int = 0) -> dict[str, dict]:
    """Per kind: wire bytes per rank per step, the link it runs on and the time there.
    With experts (``stage``: whose MoE layers and experts; :mod:`megalite.moe.planning`), the
    expert part of ``psi`` is reduced over EDP ('edp') and tokens travel over EP ('ep')."""
    n, t, M = layout.dp * layout.cp, layout.tp, num_micro
    psi_e = stage_expert_parameters(m, t, layout.pp, stage, layout.ep, layout.schedule, layout.virtual)
    psi, n_moe = psi - psi_e, planner_pipeline.moe_layers_on_rank(m, layout.schedule, layout.pp, stage, layout.virtual)
    dp = moe_planning.gradient_reduction_bytes(psi, n, layout.zero, M, prec.weight_bytes, prec.grad_bytes)
    layers = m.num_layers // layout.pp
    bsh = micro * m.seq_length / layout.cp * m.hidden_size * prec.act_bytes
    passes = 6 if layout.recompute == "full" else 4
    regather = 1 if layout.sp else 0  # SP: backward all-gathers QKV's and FC1's inputs again
    tp = M * layers * (passes + regather) * bsh * 2 * (t - 1) / t
    if n_moe and not m.moe_shared_expert_intermediate_size:  # an MoE MLP has no TP traffic
        tp -= M * n_moe * (passes + regather) / 2 * bsh * 2 * (t - 1) / t
    ep = moe_planning.all_to_all_bytes(m, micro, M, n_moe, t, layout.sp, layout.cp, layout.ep, prec.act_bytes,
                                       layout.recompute)
    edp = moe_planning.gradient_reduction_bytes(psi_e, layout.edp, layout.zero, M, prec.weight_bytes, prec.grad_bytes)
    sends = planner_pipeline.p2p_factor(layout.schedule, layout.pp, layout.virtual)  # ZBV 2, interleaved V
    pp = 2 * M * bsh / (t if layout.sp else 1) * sends if layout.pp > 1 else 0.0
    update = update_traffic(m, layout, prec, stage, DEFAULT_BUCKET)  # the update rule's own (Muon's)
    dp, tp, edp = dp + update.get("dp", 0.0), tp + update.get("tp", 0.0), edp + update.get("edp", 0.0)
    spans = functools.partial(group_spans_nodes, layout, gpus_per_node=hw.gpus_per_node)
    result = {kind: planner_cp.link(volume, spans(group), hw)
              for kind, group, volume in (("dp", "dp_cp", dp), ("tp", "tp", tp), ("pp", "pp", pp)) if volume > 0}
    result.update(planner_cp.cp_communication(m, layout, micro, M, prec.act_bytes, hw, spans))
    result.update({kind: planner_cp.link(volume, spans(group), hw)
                   for kind, group, volume in (("ep", "ep", ep), ("edp", "edp", edp)) if volume > 0})
    return result


# -- one layout ------------------------------------------------------------------------------------

@_per_model
def _largest_gradient_bucket(m: ModelConfig, tp: int, ep: int, pp: int, stage: int) -> int:
    """:func:`megalite.moe.parameter_buckets.largest_gradient_bucket` at pretrain_gpt.py's bucket size."""
    return parameter_buckets.largest_gradient_bucket(m, tp, ep, pp, stage, DEFAULT_BUCKET, attention_part(m))


def stage_memory(m: ModelConfig, layout: Layout, stage: int, micro: int, num_micro: int, prec: Precision,
                 flash_attention: bool = False, documents: bool = False, detail: dict | None = None) -> tuple[int, dict]:
    """(parameters, memory by kind in bytes) of one rank of pipeline stage ``stage``; "data" is
    the step's micro-batches on the device (``documents``: with --reset-attention-mask's arrays;
    :func:`megalite.planner.documents.batch_bytes`); ``detail``: :func:`stage_activation_bytes`'s."""
    psi = stage_parameters(m, layout.tp, layout.pp, stage, layout.ep, layout.schedule, layout.virtual)
    matrices = 0 if prec.matrix_bytes == prec.optimizer_bytes else stage_matrix_parameters(  # Muon's 8 bytes
        m, layout.tp, layout.pp, stage, layout.ep, layout.schedule, layout.virtual)
    mem = model_state_bytes(psi, layout.dp * layout.cp, layout.zero, prec, matrices)
    psi_e = stage_expert_parameters(m, layout.tp, layout.pp, stage, layout.ep, layout.schedule, layout.virtual)
    if psi_e:  # expert parameters (all matrices): the ZeRO arithmetic over the expert-data-parallel group
        mem = moe_planning.model_state_bytes(psi - psi_e, psi_e, layout.dp * layout.cp, layout.edp, layout.zero,
                                             prec.weight_bytes, prec.grad_bytes, prec.optimizer_bytes,
                                             matrices - psi_e if matrices else 0, prec.matrix_optimizer_bytes)
    mem["activations"] = stage_activation_bytes(m, layout, stage, micro, num_micro, prec, flash_attention, detail)
    mem["buffers"] = 0.0
    split, replicated = layer_parameters(m, layout.tp)
    if layout.zero == 3:  # two layers gathered (current + prefetch), embeddings kept for the step
        mem["buffers"] = prec.weight_bytes * (2 * (split + replicated)
                                              + psi - (m.num_layers // layout.pp) * (split + replicated))
    if layout.zero >= 2:  # the bucket being filled: a full-size gradient staging buffer (a layer
        # under ZeRO-3, --ddp-bucket-size elements under ZeRO-2), reduce-scattered when complete
        bucket = split + replicated if layout.zero == 3 else min(psi, DEFAULT_BUCKET)
        if psi_e:  # expert and dense parameters never share a bucket
            bucket = _largest_gradient_bucket(m, layout.tp, layout.ep, layout.pp, stage)
        mem["buffers"] += prec.grad_bytes * bucket
    mem["data"] = planner_documents.batch_bytes(m.seq_length, micro, num_micro, layout.cp, documents)
    mem["total"] += mem["activations"] + mem["buffers"] + mem["data"]
    return psi, mem


def estimate(m: ModelConfig, layout: Layout, global_batch: int, micro: int, prec: Precision, hw: Hardware,
             flash_attention: bool = False, documents: bool = False) -> Estimate:
    """Memory of the fullest pipeline stage, the bubble, the communication and the step time's
    terms (:mod:`megalite.planner.step_time`) of one layout, the latter two for a rank of that
    stage (``documents``: the batch carries --reset-attention-mask's arrays)."""
    num_micro = global_batch // (micro * layout.dp)
    best = None
    for stage in range(layout.pp):
        detail: dict = {}  # the peak's state and its W inputs (part of the activations)
        psi, mem = stage_memory(m, layout, stage, micro, num_micro, prec, flash_attention, documents, detail)
        if best is None or mem["total"] > best[2]["total"]:
            best = (stage, psi, mem, detail)
    stage, psi, mem, detail = best
    comm = communication(m, layout, psi, micro, num_micro, prec, hw, stage)
    psi_e = stage_expert_parameters(m, layout.tp, layout.pp, stage, layout.ep, layout.schedule, layout.virtual)
    matrices = 0 if prec.matrix_bytes == prec.optimizer_bytes else stage_matrix_parameters(
        m, layout.tp, layout.pp, stage, layout.ep, layout.schedule, layout.virtual)
    step = step_terms(m, layout, global_batch, num_micro, comm, prec, hw, psi, psi_e, matrices, stage)
    bubble = planner_pipeline.bubble(layout.schedule, layout.pp, num_micro, layout.virtual)
    return Estimate(layout, num_micro, stage, psi, mem, bubble,
                    comm, mem["total"] <= hw.usable_bytes, detail["held"], detail["w_inputs"], step["compute"], step)
