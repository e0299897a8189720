"""The model's sizes from its parts' shapes, without building it: parameters per layer and in
all, the parameters a token meets, model FLOPs per token (the one definition MFU, the planner
and the dry run read) and the activations one layer keeps for backward.

**FLOPs per token, training**::

    flops_per_token = 3 x (2 N_active + sum over layers of attended_flops x length)

N_active: the parameters a token meets (an MoE layer's token meets top-k of its experts); 2 per
parameter forward (a multiply-add), 3 x for forward and backward (backward is two matmuls per
forward one). For GPT's softmax attention ``attended_flops`` = 4 h (Q K^T and P V), which gives
the usual ``6 N + 12 L h s``. ``length``: the positions a token attends to, s, or with packed
documents the mean over tokens of their document's length (:func:`megalite.observe.monitor.attended_length`).
Full recomputation runs the forward again: 4/3 of this (:func:`megalite.planner.step_time.compute`).

**Multi-token prediction** (``--mtp-num-layers`` D, :mod:`megalite.model.mtp`): each depth adds
its parameters (three norms, ``eh_proj`` 2h x h split over TP, a transformer layer of the last
layer's spec) to N, its layer's attention to the attended FLOPs, and one more pass through the
shared output layer per token: ``2 V h`` forward FLOPs that no parameter of its own counts, so
``flops_per_token`` adds ``6 D V h``.
"""
from __future__ import annotations

from megalite.config_types import mtp_depths
from megalite.layers.part_shape import norm_parameters
from megalite.model.parts import layer_spec
from megalite.moe import planning as moe_planning
from megalite.moe.settings import moe_layers


def layer_parameters(m, tp: int = 1) -> tuple[int, int]:
    """(split over TP, replicated) parameters of one dense transformer layer on one TP rank: its
    attention's and MLP's (their shapes) and its two norms.

    GPT-2 (LayerNorm, biases, FFN 4h, no GQA): split (12 h^2 + 7 h) / t, replicated 6 h
    (two norms of 2h, the attention projection and FC2 biases, added after the reduction)."""
    spec = layer_spec(m, 0)
    attn_split, attn_replicated = spec.attention.parameter_counts(m)
    mlp_split, mlp_replicated = spec.mlp.parameter_counts(m)
    return (attn_split + mlp_split) // tp, 2 * norm_parameters(m) + attn_replicated + mlp_replicated


def layer_matrix_parameters(m, tp: int = 1) -> int:
    """The weight-matrix elements of one dense transformer layer on one TP rank (its attention's
    and MLP's :meth:`~megalite.layers.part_shape.PartShape.matrix_counts`): the part of
    :func:`layer_parameters` an update rule's matrix class takes (Muon); norms and biases are not."""
    spec = layer_spec(m, 0)
    attn_split, attn_replicated = spec.attention.matrix_counts(m)
    mlp_split, mlp_replicated = spec.mlp.matrix_counts(m)
    return (attn_split + mlp_split) // tp + attn_replicated + mlp_replicated


def mtp_matrix_parameters(m, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) weight-matrix elements of all D MTP depths on one rank: ``eh_proj`` and its
    layer's matrices (:func:`mtp_parameters` less the norms, biases and router)."""
    d = mtp_depths(m)
    if not d:
        return 0, 0
    last = range(m.num_layers - 1, m.num_layers)
    dense, expert = moe_planning.layers_matrix_parameters(m, layer_matrix_parameters(m, tp), tp, ep, last)
    return d * (dense + 2 * m.hidden_size * m.hidden_size // tp), d * expert


def total_matrix_parameters(m) -> int:
    """The weight-matrix elements of the whole model (layers, experts, MTP depths): the part of
    :func:`total_parameters` an update rule's matrix class takes; embeddings, output layer,
    norms, biases and routers are the rest."""
    layers = sum(moe_planning.layers_matrix_parameters(m, layer_matrix_parameters(m)))
    return layers + sum(mtp_matrix_parameters(m))


def mtp_is_moe(m) -> bool:
    """Whether the MTP depths' layer is MoE: it takes the spec of the model's last layer."""
    return bool(m.num_experts) and moe_layers(m)[m.num_layers - 1]


def mtp_parameters(m, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of all D MTP depths on one rank: per depth three norms (enorm,
    hnorm, final_norm; replicated), ``eh_proj`` (2h x h, column-parallel, no bias) and one
    transformer layer of the last layer's spec (its E/EP experts when MoE)."""
    d = mtp_depths(m)
    if not d:
        return 0, 0
    last = range(m.num_layers - 1, m.num_layers)
    dense, expert = moe_planning.layers_parameters(m, layer_parameters(m, tp), tp, ep, last)
    return d * (dense + 3 * norm_parameters(m) + 2 * m.hidden_size * m.hidden_size // tp), d * expert


def total_parameters(m) -> int:
    """Parameters of the whole model, real (unpadded) vocabulary, tied embedding once, MTP depths included."""
    split, replicated = layer_parameters(m)
    vocab = m.vocab_size * m.hidden_size * (1 if not m.untie_embeddings_and_output_weights else 2)
    positions = m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0
    layers = m.num_layers * (split + replicated)
    if m.num_experts:
        layers = sum(moe_planning.layers_parameters(m, (split, replicated)))
    return layers + vocab + positions + norm_parameters(m) + sum(mtp_parameters(m))


def skipped_expert_parameters(m) -> int:
    """Parameters a token does not meet: E - k experts of each MoE layer (0 for a dense model)."""
    if not m.num_experts:
        return 0
    layers = sum(moe_layers(m)) + (mtp_depths(m) if mtp_is_moe(m) else 0)
    return layers * (m.num_experts - m.moe_router_topk) * moe_planning.expert_parameters(m)


def active_parameters(m) -> int:
    """Parameters one token meets (for FLOPs)."""
    return total_parameters(m) - skipped_expert_parameters(m)


def attended_flops(m) -> float:
    """Forward FLOPs per token per attended position, all layers and MTP depths (4 L h for softmax attention)."""
    layers = list(range(m.num_layers)) + [m.num_layers - 1] * mtp_depths(m)
    return float(sum(layer_spec(m, i).attention.attended_flops(m) for i in layers))


def cache_bytes_per_token(m, element_bytes: int = 2, tp: int = 1) -> int:
    """Generation cache bytes per token of one sequence, all layers, on one TP rank: each layer's
    attention part's :meth:`PartShape.cache_elements_per_token` times ``element_bytes``
    (2 L g d e / t for grouped-query attention; L (r_kv + d_r) e for Multi-head Latent Attention,
    whose latent every TP rank holds whole)."""
    return element_bytes * sum(layer_spec(m, i).attention.cache_elements_per_token(m, tp) for i in range(m.num_layers))


def flops_per_token(m, attended: float | None = None) -> float:
    """Model FLOPs per token for training (module docstring): 6 x the parameters a token meets +
    3 x the attention's FLOPs over ``attended`` positions (default s): ``6 N + 12 L h s`` for GPT;
    with D MTP depths their parameters and attention, and ``6 D V h`` for their output logits."""
    length = m.seq_length if attended is None else attended
    extra_logits = mtp_depths(m) * m.vocab_size * m.hidden_size
    return 6.0 * (active_parameters(m) + extra_logits) + 3.0 * attended_flops(m) * length


def layer_activation_bytes(m, micro: int, tp: int = 1, sp: bool = False, cp: int = 1,
                           recompute: str = "none", act_bytes: int = 2, flash_attention: bool = False) -> float:
    """Bytes one dense layer keeps for backward per micro-batch, s = seq/CP tokens of b = ``micro``:
    the two norms' inputs and the two 1-byte dropout masks (with hidden dropout), replicated, plus
    each part's (:meth:`PartShape.activation_bytes`): replicated ones divided by t under SP (except
    what a part keeps gathered, :meth:`PartShape.sequence_gathered_bytes`), split ones by t. Full recomputation keeps the layer input only, e s b h (/t under SP)."""
    s, b, B = m.seq_length / cp, micro, act_bytes
    sbh = s * b * m.hidden_size
    if recompute == "full":
        return B * sbh / (tp if sp else 1)
    spec = layer_spec(m, 0)
    masks = 2 if m.hidden_dropout > 0 else 0  # two 1-byte dropout masks (the fused kernel's)
    attn = spec.attention.activation_bytes(m, s, b, B, recompute, flash_attention)
    mlp = spec.mlp.activation_bytes(m, s, b, B, recompute, flash_attention)
    replicated = (2 * B + masks) * sbh + attn[0] + mlp[0]
    gathered = sum(part.sequence_gathered_bytes(m, s, b, B) for part in (spec.attention, spec.mlp))
    kept_whole = gathered * (1 - 1 / tp) if sp else 0.0  # of the replicated bytes, whole under SP too
    return replicated / (tp if sp else 1) + kept_whole + (attn[1] + mlp[1] + (attn[2] + mlp[2])) / tp


def mtp_activation_bytes(m, micro: int, tp: int = 1, sp: bool = False, cp: int = 1, recompute: str = "none",
                         act_bytes: int = 2, flash_attention: bool = False) -> float:
    """Bytes the D MTP depths keep for backward per micro-batch on the last stage (0 without MTP):
    per depth its layer's (:func:`layer_activation_bytes`), the inputs of enorm, hnorm and
    final_norm and of ``eh_proj`` (2h, gathered over the sequence under SP), and the output layer's
    input and fp32 logits of V/t per token (kept for the cross-entropy's backward)."""
    d = mtp_depths(m)
    if not d:
        return 0.0
    s, b, B = m.seq_length / cp, micro, act_bytes
    sbh = s * b * m.hidden_size
    layer = layer_activation_bytes(m, micro, tp, sp, cp, recompute, act_bytes, flash_attention)
    norms = 4 * B * sbh / (tp if sp else 1)  # enorm, hnorm, final_norm inputs; the output layer's input
    proj = 2 * B * sbh  # eh_proj's input [e; h] (whole sequence under SP, as the column linear keeps it)
    logits = 4 * s * b * m.padded_vocab_size(tp) / tp
    return d * (layer + norms + proj + logits)
