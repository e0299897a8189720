"""Mixture-of-experts arithmetic for the layout planner (:mod:`megalite.planner`).

Pure arithmetic, like the planner: parameters, model state, activations and traffic of the
MoE layers of one rank, for a layout with tensor parallel size t (sequence parallel), context
parallel c, data parallel d and expert parallel size EP (a divisor of t c d and of E). Notation:
h hidden, E experts, k top-k, F = ``moe_ffn_hidden_size``, F_s the shared expert's FFN
(``moe_shared_expert_intermediate_size``, 0 without one), sec = 2 for SwiGLU (fc1 = [gate; up])
else 1, B the activation bytes (2 in bf16), s the sequence, b the micro batch.

**Parameters of one MoE layer on one rank** (its attention and norms are a dense layer's)::

    router      E h                      replicated (sequence-parallel-marked under TP)
    experts     E/EP (sec + 1) h F       whole on their rank (expert-tensor-parallel 1), no bias
    shared      (sec + 1) h F_s / t      TP-split MLP (+ biases: sec F_s / t split, h replicated)

in place of the dense MLP of ``ffn_hidden_size``. Which layers are MoE: :func:`megalite.moe.
settings.moe_layers` (every N-th layer or a 0/1 pattern); a stage owns layers
[p L/P, (p+1) L/P) (the planner does not model virtual stages).

**Model state.** Dense parameters Psi_d are replicated over N = DP x CP ranks; expert
parameters Psi_e over EDP = t c d / EP ranks, and ZeRO-1/2 shard their gradients and
optimizer state over that group (``megalite.data_parallel``): the ZeRO arithmetic per group,
e.g. ZeRO-1: 4 Psi_d + 12 Psi_d / N + 4 Psi_e + 12 Psi_e / EDP (w = g = 2 bytes).

**Activations of one MoE layer per micro-batch**, measured with the meta dry run and
:mod:`megalite.observe.memory_tracker` under perfectly balanced routing (what the meta run assumes).
A rank routes T = s/c b/t tokens (t = 1 without SP) and N = T k rows; what the layer keeps for
backward, beyond what its attention and norms keep (a dense layer's)::

    router     4 T h (fp32 copy of its input) + 4 E h (fp32 weight) + 8 T E (fp32 logits, probs)
               + 12 T k (top-k ids int64, top-k probs fp32) + 8 T (sum over k, logsumexp)
    rows       B N h     the routed rows at the experts (fc1's input)
    experts    2 sec B N F   SwiGLU: fc1 out 2F, silu(gate) F, product F; GELU: fc1 out, gelu out
    combine    2 B N h + 2 N   rows back (kept by ``y * w`` for the router's gradient) and the
               weighted rows (``index_add`` keeps its source); the weights in B bytes
    indices    8 N x (2 + 2 [EP > 1])   sort order, token of each row (+ the EP permutation
               and its inverse)
    shared     a dense MLP of F_s: its input B s/c b h (/t under SP) + 2 sec B s/c b F_s / t

replacing the dense MLP's B s/c b h (fc1 input; under SP this rank's shard, /t) + 2 sec B s/c
b F / t.
The input of the MoE block itself is not kept (the router keeps its fp32 copy).
With a capacity factor the meta run and this arithmetic keep every row (balanced routing
never drops one); imbalanced routing puts up to max/mean load more rows on a rank.

**The stage's peak**: the larger of the planner's dense rule (the micro-batches in flight hold
all their activations) and an MoE moment: one micro-batch holding its layers up to the stage's
last MoE layer while that layer's dispatch buffers (forward) or its experts' weight gradients
(backward) are live, :func:`transient_bytes`. ZeRO-2's staging buffer is the largest gradient
bucket, :func:`megalite.moe.parameter_buckets.largest_gradient_bucket` (expert and dense parameters
never share one).

**Communication per step** (wire bytes per rank, M micro-batches, n_moe MoE layers on the
stage): the all-to-all of rows out and back, forward and backward, moves
4 N h B (EP-1)/EP per MoE layer and micro-batch (6 N h B with full recomputation: the
forward runs again), plus the counts (8 E bytes, once per forward). Expert gradients are
reduced over EDP with the dense rules (ZeRO-0: 2 Psi_e g; ZeRO-1: Psi_e (g + w);
ZeRO-2: Psi_e (M g + w); times (EDP-1)/EDP). An MoE layer without a shared expert has no TP
traffic in its MLP: half a dense layer's (attention only).
"""
from __future__ import annotations

from megalite.data_parallel.accounting import zero_theory_bytes
from megalite.layers.part_shape import MLPShape
from megalite.moe.settings import moe_layers


def _sections(m) -> int:
    return 2 if m.swiglu else 1


def expert_parameters(m) -> int:
    """One expert: fc1 (sec F x h) and fc2 (h x F), no bias."""
    return (_sections(m) + 1) * m.hidden_size * m.moe_ffn_hidden_size


def mlp_parameters(m, ffn: int, tp: int = 1) -> tuple[int, int]:
    """(split over TP, replicated) parameters of megalite's dense MLP of FFN size ``ffn`` (its shape)."""
    split, replicated = MLPShape.parameter_counts(m, ffn)
    return split // tp, replicated


def moe_mlp_parameters(m, tp: int = 1, ep: int = 1) -> tuple[int, int, int]:
    """(split over TP, replicated, expert) parameters of one MoE MLP on one rank."""
    split, replicated = mlp_parameters(m, m.moe_shared_expert_intermediate_size or 0, tp)
    return split, replicated + m.num_experts * m.hidden_size, m.num_experts // ep * expert_parameters(m)


def stage_layers(m, pp: int = 1, stage: int = 0) -> range:
    n = m.num_layers // pp
    return range(stage * n, (stage + 1) * n)


def stage_moe_flags(m, pp: int = 1, stage: int = 0) -> list[bool]:
    """For each of the stage's layers, in order, whether it is MoE (all False for a dense model)."""
    if not m.num_experts:
        return [False] * len(stage_layers(m, pp, stage))
    flags = moe_layers(m)
    return [flags[i] for i in stage_layers(m, pp, stage)]


def stage_moe_layers(m, pp: int = 1, stage: int = 0) -> int:
    """How many of the stage's layers are MoE."""
    return sum(stage_moe_flags(m, pp, stage))


def layers_parameters(m, dense_layer: tuple[int, int], tp: int = 1, ep: int = 1,
                      layers: range | None = None) -> tuple[int, int]:
    """(dense, expert) parameters of ``layers`` on one rank, given a dense layer's
    (split, replicated) on that rank (:func:`megalite.planner.layer_parameters`)."""
    layers = range(m.num_layers) if layers is None else layers
    n_moe = sum(moe_layers(m)[i] for i in layers)
    dense = len(layers) * sum(dense_layer)
    if not n_moe:
        return dense, 0
    mlp = sum(mlp_parameters(m, m.ffn_hidden_size, tp))
    split, replicated, expert = moe_mlp_parameters(m, tp, ep)
    return dense + n_moe * (split + replicated - mlp), n_moe * expert


def mlp_matrix_parameters(m, ffn: int, tp: int = 1) -> int:
    """Weight-matrix elements of megalite's dense MLP of FFN size ``ffn`` on one rank."""
    split, replicated = MLPShape.matrix_counts(m, ffn)
    return split // tp + replicated


def layers_matrix_parameters(m, dense_layer: int, tp: int = 1, ep: int = 1,
                             layers: range | None = None) -> tuple[int, int]:
    """(dense, expert) weight-matrix elements of ``layers`` on one rank (the part of
    :func:`layers_parameters` an update rule's matrix class takes), given a dense layer's
    (:func:`megalite.model.counting.layer_matrix_parameters`): an MoE layer's shared expert and
    its E/EP experts in place of the dense MLP; not the router (a classifier, AdamW's in Muon)."""
    layers = range(m.num_layers) if layers is None else layers
    n_moe = sum(moe_layers(m)[i] for i in layers)
    dense = len(layers) * dense_layer
    if not n_moe:
        return dense, 0
    mlp = mlp_matrix_parameters(m, m.ffn_hidden_size, tp)
    shared = mlp_matrix_parameters(m, m.moe_shared_expert_intermediate_size or 0, tp)
    return dense + n_moe * (shared - mlp), n_moe * (m.num_experts // ep * expert_parameters(m))


def model_state_bytes(dense: int, expert: int, n: int, edp: int, zero: int, weight_bytes: int, grad_bytes: int,
                      optimizer_bytes: int | None = None, dense_matrices: int = 0,
                      matrix_optimizer_bytes: int | None = None) -> dict[str, float]:
    """Weights, gradients and master + Adam state per rank: the ZeRO arithmetic of the dense
    parameters over N = DP x CP plus that of the expert parameters over EDP. ``optimizer_bytes``:
    per parameter, master weights and optimizer state (default: the default update rule's);
    ``matrix_optimizer_bytes`` (default: the same) for the ``dense_matrices`` of the dense
    parameters and for every expert parameter (the experts are all weight matrices)."""
    out = {}
    for psi, group, matrices in ((dense, n, dense_matrices), (expert, edp, expert)):
        s = zero_theory_bytes(psi, group, zero, weight_bytes, grad_bytes, optimizer_bytes, matrices,
                              matrix_optimizer_bytes)
        for key in ("weights", "gradients", "master_and_optimizer"):
            out[key] = out.get(key, 0.0) + s[key]
    out["total"] = out["weights"] + out["gradients"] + out["master_and_optimizer"]
    return out


# -- activations -----------------------------------------------------------------------------------

def routed_tokens(m, micro: int, tp: int = 1, sp: bool = False, cp: int = 1) -> float:
    """T: the tokens one rank routes per micro-batch, s/CP b (/TP under sequence parallelism)."""
    return m.seq_length / cp * micro / (tp if sp else 1)


def mlp_activation_bytes(m, ffn: int, micro: int, tp: int = 1, sp: bool = False, cp: int = 1,
                         act_bytes: int = 2) -> float:
    """What megalite's dense MLP of ``ffn`` keeps: fc1's input (under SP this rank's sequence
    shard: it is gathered again in backward) and its intermediates."""
    if not ffn:
        return 0.0
    sbh = m.seq_length / cp * micro * m.hidden_size
    inp = act_bytes * sbh / (tp if sp else 1)
    return inp + 2 * _sections(m) * act_bytes * m.seq_length / cp * micro * ffn / tp


def routed_activation_bytes(m, micro: int, tp: int = 1, sp: bool = False, cp: int = 1, ep: int = 1,
                            act_bytes: int = 2) -> float:
    """Router, dispatch, experts and combine of one MoE layer, one micro-batch (module docstring)."""
    h, E, k, B = m.hidden_size, m.num_experts, m.moe_router_topk, act_bytes
    T = routed_tokens(m, micro, tp, sp, cp)
    N = T * k
    router = 4 * T * h + 4 * E * h + 8 * T * E + 12 * T * k + 8 * T
    experts = 2 * _sections(m) * B * N * m.moe_ffn_hidden_size
    rows = 3 * B * N * h + 2 * N  # rows at the experts, rows back, weighted rows; the weights
    indices = 8 * N * (4 if ep > 1 else 2)
    return router + experts + rows + indices


def moe_layer_delta(m, micro: int, tp: int = 1, sp: bool = False, cp: int = 1, ep: int = 1,
                    act_bytes: int = 2) -> float:
    """Bytes an MoE layer keeps per micro-batch minus what a dense layer keeps: the routed part
    and the shared expert, less the dense MLP."""
    args = dict(micro=micro, tp=tp, sp=sp, cp=cp, act_bytes=act_bytes)
    return (routed_activation_bytes(m, micro, tp, sp, cp, ep, act_bytes)
            + mlp_activation_bytes(m, m.moe_shared_expert_intermediate_size or 0, **args)
            - mlp_activation_bytes(m, m.ffn_hidden_size, **args))


def transient_bytes(m, micro: int, tp: int = 1, sp: bool = False, cp: int = 1, ep: int = 1, act_bytes: int = 2,
                    weight_bytes: int = 2) -> tuple[float, float]:
    """(forward, backward): what an MoE layer adds, for a moment, to the activations it keeps
    (megalite today, measured with the meta dry run):

    - forward (EP > 1): the dispatch drops each row buffer once the next exists, so besides
      what is kept, the rows returned and the weighted rows (2 B N h) are live while combine
      makes its output (B T h); EP = 1: B T h;
    - backward: the experts' weights are unbound once (:func:`megalite.moe.experts.grouped_mlp`),
      so each expert's weight gradient is its own slice and the unbind's backward stacks them
      once. Measured on one layer under the tracker (L = 2..8 local experts, F = 1024..4096):
      the backward peak exceeds the forward's kept bytes by about the layer's weight gradients
      |w1| + |w2| (|w1| = L sec F h, |w2| = L F h, weight dtype) less the combine's rows already
      spent (2 B N h), within 4 MiB for L <= 4 (16 MiB more at L = 8). (Before the unbind,
      indexing ``w[e]`` gave every expert a gradient of the whole stacked weight: 3 |w1| + |w2|.)"""
    T = routed_tokens(m, micro, tp, sp, cp)
    h, B, N = m.hidden_size, act_bytes, T * m.moe_router_topk
    forward = B * T * h + (2 * B * N * h if ep > 1 else 0)
    local = m.num_experts // ep
    w1 = local * _sections(m) * m.moe_ffn_hidden_size * h * weight_bytes
    w2 = local * m.moe_ffn_hidden_size * h * weight_bytes
    return forward, w1 + w2 - 2 * B * N * h


# -- communication ---------------------------------------------------------------------------------

def all_to_all_bytes(m, micro: int, num_micro: int, moe_layers_here: int, tp: int = 1, sp: bool = False,
                     cp: int = 1, ep: int = 1, act_bytes: int = 2, recompute: str = "none") -> float:
    """Wire bytes per rank per step on the EP group: rows out and back, forward and backward
    (and the recomputed forward), 4 (6) N h B (EP-1)/EP, plus the counts, 8 E per forward."""
    if ep <= 1 or not moe_layers_here:
        return 0.0
    forwards = 2 if recompute == "full" else 1
    N = routed_tokens(m, micro, tp, sp, cp) * m.moe_router_topk
    per_layer = (2 + 2 * forwards) * N * m.hidden_size * act_bytes + forwards * 8 * m.num_experts
    return num_micro * moe_layers_here * per_layer * (ep - 1) / ep


def gradient_reduction_bytes(psi: int, n: int, zero: int, num_micro: int, weight_bytes: int,
                             grad_bytes: int) -> float:
    """Wire bytes per rank per step reducing ``psi`` parameters' gradients over ``n`` ranks:
    DDP all-reduces (2 g Psi), ZeRO-1 reduce-scatters once and all-gathers the weights, ZeRO-2
    reduce-scatters every micro-batch, ZeRO-3 also gathers the weights twice per micro-batch; all
    times (n-1)/n on a ring. The planner uses it for the dense parameters over DP x CP and for
    the expert parameters over EDP."""
    if n <= 1 or not psi:
        return 0.0
    w, g, M = weight_bytes, grad_bytes, num_micro
    return {0: 2 * psi * g, 1: psi * (g + w), 2: psi * (M * g + w), 3: psi * M * (g + 2 * w)}[zero] * (n - 1) / n


def wire_from_handed(handed: float, n: int, all_reduce: bool = False) -> float:
    """Convert the dry run's bytes handed to a group's collectives (the full tensor: all-to-all
    input, reduce-scatter input, all-gather output) into ring wire bytes per rank, as the
    planner counts them: (n-1)/n of it, twice for an all-reduce."""
    return handed * (2 if all_reduce else 1) * (n - 1) / n if n > 1 else 0.0
