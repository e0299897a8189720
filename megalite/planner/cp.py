"""Context-parallel communication types in the planner (``--cp-comm-type``): which to consider,
their traffic per step and where it runs, allgather's transient memory, and the words that
say why one type was picked. Part of the planner (:mod:`megalite.planner`); the attention
itself is :mod:`megalite.context_parallel.attention`.

**Candidates** for a CP group of C ranks: ``p2p`` (the ring), ``a2a`` (Ulysses), ``allgather``
and ``a2a+p2p`` for every inner size A with 1 < A < C dividing C (B = C/A ranks in the ring).
megalite's rules (:func:`megalite.context_parallel.checks.check_context_parallel`, asked by
:func:`megalite.planner.checks.check_layout`) refuse ``a2a`` unless C divides the heads per TP
rank, and ``a2a+p2p`` unless A does: each all-to-all rank receives whole heads.

**Traffic** per step per rank, for the ``L/P`` layers of a stage and M micro-batches::

    wire[level] = M (L/P) (W[level] + F[level] if recomputation else W[level])

where W is :func:`megalite.context_parallel.traffic.cp_attention_traffic`'s ``wire`` (one layer,
one micro-batch, forward + backward, with b the micro batch, H = a/t heads and G = g/t key/value
groups per TP rank, the activations' element size) and F its forward part. Recomputation, full
or selective, runs the forward again inside backward: megalite's selective recomputation
checkpoints the core attention, CP exchange included, so both add one forward's exchange.
``level`` is ``cp`` (all C ranks) for p2p, a2a and allgather, and ``inner`` (the all-to-all
over A consecutive CP ranks) and ``outer`` (the ring over B) for a2a+p2p: planned as two
kinds, ``cp_inner`` and ``cp_outer``, each on the link its own groups use (megalite's grid:
``rank = tp + TP*(cp + CP*(dp + DP*pp))``, so an inner group is T*A consecutive ranks and sits
inside a node when T*A divides the GPUs per node, while the outer group strides by T*A and
crosses nodes as soon as the CP group does). Time = bytes / the link's bandwidth, no overlap.

**Memory**: p2p keeps two K/V blocks of s/C tokens in flight, a2a's full-sequence tensors hold
H/C heads (the size of the local shards), so both keep what the activation formula already
counts for s/C tokens. allgather gathers the whole sequence's K and V of this TP rank,
2 b G s d e bytes, while a layer computes, and in backward also accumulates dK and dV for the
whole sequence in fp32, 2 b G s d 4 bytes, before reducing them to shards; the block kernel's
own fp32 dK/dV of the longest block (the last chunk's prefix, (2C-1)/(2C) of the sequence) exist
beside them until added. Between forward and backward it keeps only its shards, so the peak is one
layer's backward on top of everything held:
``transient = 2 b G s d (e + 4 + 4 (2C-1)/(2C))``, added to the activations the way other
transients are (the dry run of a 7B layer at 32k tokens measures 0.67 GiB above p2p at C=4 and
1.70 GiB at C=8, against 1.84 and 1.94 GiB here: where the step's peak falls decides how much of
it shows).
"""
from __future__ import annotations

from megalite.config import ModelConfig
from megalite.context_parallel.comm_types import CP_COMM_TYPES, CP_TYPES  # noqa: F401 - CP_COMM_TYPES re-exported
from megalite.context_parallel.traffic import CPTraffic, cp_attention_traffic
from megalite.planner.types import GiB, Hardware, Layout, Plan, cp_type_name, describe_cp  # noqa: F401

KIND = {"cp": "cp", "inner": "cp_inner", "outer": "cp_outer"}  # traffic level -> communication kind


def cp_variants(cp: int, comm_type: str | None = None) -> list[tuple[str, int]]:
    """(type, inner size A) of every CP type considered for C = ``cp`` ranks (A = 1 but for
    a2a+p2p); ``comm_type`` keeps only that type. One (p2p, 1) without CP."""
    if cp == 1:
        return [("p2p", 1)]
    out = [(t.name, 1) for t in CP_TYPES if not t.hierarchical]
    out += [(t.name, a) for t in CP_TYPES if t.hierarchical for a in range(2, cp) if cp % a == 0]
    return [v for v in out if comm_type is None or v[0] == comm_type]


def layer_traffic(m: ModelConfig, layout: Layout, micro: int, act_bytes: int) -> CPTraffic:
    """One layer's CP attention traffic per rank and micro-batch (forward + backward)."""
    t = layout.tp
    return cp_attention_traffic(layout.cp_comm_type, batch=micro, seq=m.seq_length,
                                heads=m.num_attention_heads // t, groups=m.num_query_groups // t,
                                head_dim=m.head_dim, cp=layout.cp, element_size=act_bytes,
                                inner=layout.cp_inner if layout.cp_sizes else None)


def forward_wire(traffic: CPTraffic, layout: Layout) -> dict[str, float]:
    """The forward part of ``traffic.wire``: what a recomputation sends again. A send leaves
    whole; an all-to-all, all-gather or reduce-scatter over n ranks (n-1)/n of what it is handed."""
    c, a, hierarchical = layout.cp, layout.cp_inner, layout.cp_sizes is not None
    out: dict[str, float] = {}
    for kind, nbytes in traffic.handed["forward"].items():
        if hierarchical:
            level = "inner" if kind == "all_to_all" else "outer"
        else:
            level = "cp"
        n = a if hierarchical else c
        out[level] = out.get(level, 0.0) + nbytes * (1.0 if kind == "send" else (n - 1) / n)
    return out


def step_bytes(m: ModelConfig, layout: Layout, micro: int, num_micro: int, act_bytes: int,
               layers: int | None = None) -> dict[str, float]:
    """Wire bytes per rank per step by level (module docstring): M x the stage's layers x one
    layer's forward + backward, plus one forward more under recomputation."""
    if layout.cp == 1:
        return {}
    layers = m.num_layers // layout.pp if layers is None else layers
    traffic = layer_traffic(m, layout, micro, act_bytes)
    again = forward_wire(traffic, layout) if layout.recompute != "none" else {}
    return {level: num_micro * layers * (w + again.get(level, 0.0)) for level, w in traffic.wire.items()}


def link(volume: float, slow: bool, hw: Hardware) -> dict:
    """A communication entry: bytes, the link and the time there (no overlap)."""
    gbps = hw.ib_gbps if slow else hw.nvlink_gbps
    return {"bytes": volume, "link": "InfiniBand" if slow else "NVLink", "seconds": volume / (gbps * 1e9)}


def cp_communication(m: ModelConfig, layout: Layout, micro: int, num_micro: int, act_bytes: int,
                     hw: Hardware, spans) -> dict[str, dict]:
    """Per kind ('cp', or 'cp_inner' and 'cp_outer'), the step's CP traffic on its link.
    ``spans(kind)``: whether a group of that grid kind has ranks on two nodes."""
    out = {}
    for level, volume in step_bytes(m, layout, micro, num_micro, act_bytes).items():
        if volume > 0:
            out[KIND[level]] = link(volume, spans(KIND[level]), hw)
    return out


def transient_bytes(m: ModelConfig, layout: Layout, micro: int, act_bytes: int) -> float:
    """allgather's peak beyond the activations: the whole sequence's K and V of this TP rank,
    their fp32 gradient buffers and the longest block's fp32 gradients during one layer's
    backward, 2 b G s d (e + 4 + 4 (2C-1)/(2C)); 0 otherwise."""
    if layout.cp == 1 or layout.cp_comm_type != "allgather":
        return 0.0
    groups = m.num_query_groups // layout.tp
    longest_block = (2 * layout.cp - 1) / (2 * layout.cp)
    return 2 * micro * groups * m.seq_length * m.head_dim * (act_bytes + 4 + 4 * longest_block)


# -- the words -------------------------------------------------------------------------------------

def _same_but_type(a: Layout, b: Layout) -> bool:
    strip = lambda x: (x.tp, x.pp, x.dp, x.cp, x.zero, x.recompute, x.ep)  # noqa: E731
    return strip(a) == strip(b)


def _links(e) -> str:
    on = {"NVLink": 0.0, "InfiniBand": 0.0}
    for kind, c in e.comm.items():
        if kind in KIND.values():
            on[c["link"]] += c["bytes"]
    seconds = sum(c["seconds"] for k, c in e.comm.items() if k in KIND.values())
    return (f"{on['InfiniBand'] / GiB:.2f} GiB on InfiniBand + {on['NVLink'] / GiB:.2f} GiB on NVLink, "
            f"{seconds * 1e3:.0f} ms")


def explain_cp_type(p: Plan) -> list[str]:
    """Why the chosen layout's CP type: every type of the same layout with its CP bytes per step
    per GPU on InfiniBand and NVLink, the time, the memory; the rule that refused a type."""
    chosen = p.choice
    if chosen is None or chosen.layout.cp == 1:
        return []
    lay, usable = chosen.layout, p.hardware.usable_bytes
    rivals = [e for e in p.estimates if _same_but_type(e.layout, lay) and e is not chosen]
    refused = {k: v for k, v in p.invalid.items() if _same_but_type(k, lay)}
    name = cp_type_name(lay)
    if p.cp_comm_type:
        head = f"CP type {name}: fixed by --cp-comm-type {p.cp_comm_type}"
    else:
        head = (f"CP type {name}: the shortest estimated step of this layout's types that fit (their attention "
                f"FLOPs are equal; the ring hides behind attention, the all-to-alls and gathers do not)")
    parts = [f"{name} {_links(chosen)}, {chosen.memory['total'] / GiB:.1f} GiB"]
    for e in rivals:
        extra = transient_bytes(p.model, e.layout, p.micro, p.precision.act_bytes)
        held = f" (with {extra / GiB:.2f} GiB of full-sequence K/V, fp32 dK/dV and block gradients)" if extra else ""
        fit = "" if e.fits else f" > {usable / GiB:.1f} usable"
        parts.append(f"{cp_type_name(e.layout)} {_links(e)}, {e.memory['total'] / GiB:.1f} GiB{held}{fit}")
    lines = [head + "; CP traffic per step per GPU: " + "; ".join(parts) + "."]
    for layout, reason in refused.items():
        lines.append(f"Not {cp_type_name(layout)}: {reason.split(' Fix:')[0]}")
    return lines
