"""One pipeline rank's parameters as megalite registers them, and its gradient buckets as the
data-parallel optimizers build them, from the parts' shapes (no model built): what the planner's
ZeRO-2 staging buffer (:func:`largest_gradient_bucket`) and Muon's ZeRO ownership, Gram traffic and
Newton-Schulz FLOPs (:mod:`megalite.planner.update_traffic`) are computed over. Beside
:mod:`megalite.moe.planning`, whose layer counts it uses.
"""
from __future__ import annotations

from typing import NamedTuple

from megalite.config_types import mtp_depths
from megalite.layers.part_shape import LinearShape, MLPShape, PartShape, SelfAttentionShape, norm_parameters
from megalite.moe.planning import _sections, stage_layers
from megalite.moe.settings import moe_layers


def stage_ends(m, tp: int, pp: int, stage: int) -> tuple[list, list]:
    """(elements, isolated, deferred) of a stage's parameters before its layers (word and position
    embeddings; the last stage's copy of the embedding when it is tied or read by the MTP depths)
    and after them (final norm, untied output layer), as ``megalite.planner.stage_parameters``
    counts them; a shared embedding has a gradient bucket of its own (the embedding group's
    all-reduce); every one but the norm has its gradient made by W under a split backward
    (``megalite.layers.weight_grad.mark_deferred``). The MTP depths, registered after these:
    :func:`_mtp_parameter_list`."""
    embedding = m.padded_vocab_size(tp) * m.hidden_size // tp
    tied = not m.untie_embeddings_and_output_weights
    depths = mtp_depths(m)
    shared = tied or depths > 0
    head, tail = [], []
    if stage == 0 or (stage == pp - 1 and shared):
        head.append((embedding, shared, True))
    if stage == 0 and m.position_embedding_type == "learned_absolute":
        head.append((m.max_position_embeddings * m.hidden_size, False, True))
    if stage == pp - 1:
        tail.append((norm_parameters(m), False, False))
        if not tied:
            tail.append((embedding, False, True))
    return head, tail


class StageParameter(NamedTuple):
    """One parameter of a stage on one rank, as megalite registers it: its elements, whether it is
    an expert's (reduced over EDP), whether it has a gradient bucket of its own (a shared
    embedding), whether a layer (or an MTP depth) holds it and, for a weight matrix that an update
    rule's matrix class takes (2-D weights of the layers, stacked experts; not the router), its
    ``shape`` on the rank (rows, cols; stacked experts (E/EP, rows, cols)) and the ``linear`` it is
    the weight of (None: not a TP linear's, e.g. MLA's replicated down-projections, the experts);
    a stacked expert weight's ``name`` (w1, w2: what :func:`megalite.layers.logical_matrices.row_block`
    cuts it by); whether W makes its gradient under a split backward (``deferred``: the TP
    linears' weights, the embeddings, the output layer, the stacked experts; not the norms, biases,
    the router or MLA's replicated down-projections, plain ``nn.Linear``s)."""
    elements: int
    expert: bool = False
    isolated: bool = False
    of_layer: bool = False
    shape: tuple | None = None
    linear: LinearShape | None = None
    name: str = ""
    deferred: bool = False


def _part_parameters(part: type[PartShape], m, tp: int, *size) -> list[StageParameter]:
    """A part's parameters on one rank in registration order (:meth:`PartShape.parameter_list`):
    each linear's weight (a matrix) and bias, then the extras, the replicated matrices first."""
    out = []
    for linear in part.linears(m, *size):
        weight, *bias = linear.parameter_list(tp)
        out += [StageParameter(weight, shape=linear.local_shape(tp), linear=linear, deferred=True)]
        out += [StageParameter(n) for n in bias]
    extras = part.parameter_list(m, tp, *size)[len(out):]
    shapes = part.extra_matrix_shapes(m)
    return out + [StageParameter(n, shape=shapes[k] if k < len(shapes) else None) for k, n in enumerate(extras)]


def _mtp_parameter_list(m, tp: int, ep: int, attention: type[PartShape]) -> list[StageParameter]:
    """The MTP depths' parameters (``--mtp-num-layers``, megalite.model.mtp) in registration order:
    per depth enorm, hnorm, eh_proj (2h x h, column-parallel), one layer of the last layer's kind,
    its final norm."""
    depths = mtp_depths(m)
    norm = [StageParameter(m.hidden_size)] * (norm_parameters(m) // m.hidden_size)
    layer = _layer_parameter_list(m, tp, ep, moe_layers(m)[m.num_layers - 1], attention)
    projection = LinearShape("eh_proj", 2 * m.hidden_size, m.hidden_size, True, False)
    eh_proj = StageParameter(projection.weight // tp, shape=projection.local_shape(tp), linear=projection, deferred=True)
    return (2 * norm + [eh_proj] + layer + norm) * depths


def _layer_parameter_list(m, tp: int, ep: int, moe: bool,
                          attention: type[PartShape] = SelfAttentionShape) -> list[StageParameter]:
    """One layer's parameters on one rank, in registration order: the attention's norm and part
    (``attention``: its shape), the MLP's norm and the dense MLP, or the router, the stacked
    experts' fc1 and fc2 and the shared expert (a dense MLP)."""
    norm = [StageParameter(m.hidden_size)] * (norm_parameters(m) // m.hidden_size)
    out = norm + _part_parameters(attention, m, tp) + norm
    if not moe:
        return out + _part_parameters(MLPShape, m, tp)
    local, f, fs, h = m.num_experts // ep, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size, m.hidden_size
    out += [StageParameter(m.num_experts * h),
            StageParameter(local * _sections(m) * f * h, True, shape=(local, _sections(m) * f, h), name="w1",
                           deferred=True),
            StageParameter(local * h * f, True, shape=(local, h, f), name="w2", deferred=True)]
    return out + _part_parameters(MLPShape, m, tp, fs or 0)


def stage_parameter_list(m, tp: int, ep: int, pp: int, stage: int,
                         attention: type[PartShape] = SelfAttentionShape) -> list[StageParameter]:
    """Every parameter of a stage on one rank, in registration order: :func:`stage_ends`' head,
    the layers, the tail, the last stage's MTP depths."""
    head, tail = stage_ends(m, tp, pp, stage)
    flags = moe_layers(m)
    out = [StageParameter(n, isolated=iso, deferred=w) for n, iso, w in head]
    layer = {moe: [p._replace(of_layer=True) for p in _layer_parameter_list(m, tp, ep, moe, attention)]
             for moe in {flags[i] for i in stage_layers(m, pp, stage)}}  # a dense layer's, an MoE layer's
    for i in stage_layers(m, pp, stage):
        out += layer[flags[i]]
    out += [StageParameter(n, isolated=iso, deferred=w) for n, iso, w in tail]
    if stage == pp - 1:
        out += [p._replace(of_layer=True) for p in _mtp_parameter_list(m, tp, ep, attention)]
    return out


def stage_buckets(m, tp: int, ep: int, pp: int, stage: int, bucket_size: int,
                  attention: type[PartShape] = SelfAttentionShape,
                  chunks: tuple[int, tuple[int, ...]] | None = None,
                  split_backward: bool = False) -> list[list[StageParameter]]:
    """A stage's gradient buckets as megalite's data-parallel optimizers build them
    (``megalite.data_parallel.ddp`` ``group_by_size`` then ``split_by_domain``), each the list of
    its parameters in member order: the parameters in reverse registration order in groups of
    about ``bucket_size`` elements (a tied embedding a group of its own), each group cut where it
    switches between dense and expert parameters. ``chunks`` = (C, the rank's global chunks in its
    order): a rank of a multi-chunk schedule (ZBV, the interleaved 1F1B) holds those chunks of the
    C-way split, each as a stage of a C-stage pipeline (the embedding on chunk 0; the output layer
    and MTP depths on chunk C - 1), bucketed from its last chunk back. ``split_backward`` (ZB-H1,
    ZBV): each chunk is bucketed apart, the parameters B makes gradients for before those W makes
    (``deferred``), so that no bucket waits from a micro-batch's B to its W."""
    if chunks is None:
        lists = [stage_parameter_list(m, tp, ep, pp, stage, attention)]
    else:
        total, mine = chunks
        lists = [stage_parameter_list(m, tp, ep, total, g, attention) for g in mine]
    if split_backward:
        runs = [[p for p in reversed(params) if p.deferred == in_w]
                for params in reversed(lists) for in_w in (False, True)]
    else:
        runs = [[p for params in reversed(lists) for p in reversed(params)]]
    return [bucket for run in runs for bucket in _buckets_of(run, bucket_size)]


def _buckets_of(params: list[StageParameter], bucket_size: int) -> list[list[StageParameter]]:
    """``group_by_size`` (isolated parameters a group of their own) then ``split_by_domain``, on
    parameters in bucketing order."""
    groups, current, filled = [], [], 0
    for p in params:
        if p.isolated:
            groups.append([p])
            continue
        current.append(p)
        filled += p.elements
        if filled >= bucket_size:  # the group is complete
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    buckets = []
    for group in groups:
        part = [group[0]]
        for p in group[1:]:
            if p.expert != part[-1].expert:  # cut where the domain switches
                buckets.append(part)
                part = []
            part.append(p)
        buckets.append(part)
    return buckets


def gradient_buckets(m, tp: int, ep: int, pp: int, stage: int, bucket_size: int,
                     attention: type[PartShape] = SelfAttentionShape,
                     chunks: tuple[int, tuple[int, ...]] | None = None,
                     split_backward: bool = False) -> list[tuple[int, bool, bool]]:
    """A stage's gradient buckets (:func:`stage_buckets`; ``chunks``, ``split_backward`` as there),
    each as (elements, expert, holds a layer's parameters; ``attention``: the layers' attention
    shape, the planner passes the part the config picks). A bucket holding a layer's (or an MTP
    depth's) parameters holds weight matrices: what Muon's ZeRO step gathers
    (:mod:`megalite.planner.update_traffic`)."""
    return [(sum(p.elements for p in bucket), bucket[0].expert, any(p.of_layer for p in bucket))
            for bucket in stage_buckets(m, tp, ep, pp, stage, bucket_size, attention, chunks,
                                        split_backward)]


def largest_gradient_bucket(m, tp: int, ep: int, pp: int, stage: int, bucket_size: int,
                            attention: type[PartShape] = SelfAttentionShape) -> int:
    """Elements of the largest gradient bucket of a stage (what ZeRO-2 stages per micro-batch):
    the largest of :func:`gradient_buckets`."""
    return max((n for n, _, _ in gradient_buckets(m, tp, ep, pp, stage, bucket_size, attention)), default=0)
