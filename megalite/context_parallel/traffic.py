"""Theory of context-parallel attention traffic: bytes per rank, per layer, per micro-batch
(forward and backward), for each communication type.

Symbols: b micro-batch, s sequence, C = CP size (A x B for a2a+p2p), L = s/C tokens per rank,
H query heads and G key/value groups per TP rank, d head dim, e bytes per activation element,
f = max(e, 4) (gradients that travel summed travel in fp32). G' = G when the all-to-all group
size divides G, else lcm(G, size) (replicated key/value heads).

"Handed" bytes follow :mod:`megalite.parallel.comm`'s counter: a send's tensor, an
all-to-all's input, an all-gather's output, a reduce-scatter's input. "Wire" bytes are what
leaves the rank: all of a send, (n-1)/n of an all-to-all, all-gather or reduce-scatter over n.

| type      | forward (handed)                  | backward (handed)                                  |
|-----------|-----------------------------------|----------------------------------------------------|
| p2p       | send (C-1) 2bGLd e                | send (C-1) 2bGLd e + C 2bGLd f (dK/dV, fp32)       |
| a2a       | all-to-all (2H + 2G') bLd e       | all-to-all (2H + 2G') bLd e                        |
| allgather | all-gather 2bGs d e               | all-gather 2bGsd e + reduce-scatter 2bGsd e        |
| a2a+p2p   | a2a over A as a2a, with G'(A);    | a2a over A; ring over B as backward p2p, with      |
|           | ring over B: send (B-1) 2bG'Ld e  | (B-1) 2bG'Ld e + B 2bG'Ld f                        |

Recomputation (full or selective) runs the forward again inside backward: add one forward.
A value head size d_v of its own (``v_head_dim``, MLA): every "2 ... d" above that counts K and
V (or q and the output) becomes "(d + d_v)".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megalite.context_parallel.comm_types import cp_comm_type
from megalite.context_parallel.ulysses import expanded_kv_groups


@dataclass
class CPTraffic:
    """``handed[phase][kind]``: bytes handed to collectives of that kind (phase "forward" or
    "backward"); ``wire[level]``: bytes leaving the rank on the "cp" group, or on the "inner"
    (all-to-all) and "outer" (ring) groups of a2a+p2p."""
    handed: dict = field(default_factory=lambda: {"forward": {}, "backward": {}})
    wire: dict = field(default_factory=dict)

    def add(self, phase: str, kind: str, nbytes: float, level: str, wire_fraction: float) -> None:
        self.handed[phase][kind] = self.handed[phase].get(kind, 0) + nbytes
        self.wire[level] = self.wire.get(level, 0) + nbytes * wire_fraction

    @property
    def total(self) -> float:
        return sum(sum(kinds.values()) for kinds in self.handed.values())


def _ring(t: CPTraffic, size: int, kv: float, f_over_e: float, level: str) -> None:
    """kv: bytes of this rank's K and V shards together."""
    t.add("forward", "send", (size - 1) * kv, level, 1.0)
    t.add("backward", "send", (size - 1) * kv + size * kv * f_over_e, level, 1.0)


def _all_to_all(t: CPTraffic, size: int, q: float, kv: float, level: str) -> None:
    """q, kv: bytes of this rank's q and output together, and of its expanded K and V shards."""
    for phase in ("forward", "backward"):
        t.add(phase, "all_to_all", q + kv, level, (size - 1) / size)


def cp_attention_traffic(comm_type: str, *, batch: int, seq: int, heads: int, groups: int, head_dim: int,
                         cp: int, element_size: int = 2, inner: int | None = None,
                         v_head_dim: int | None = None) -> CPTraffic:
    """The theory of one layer's CP attention traffic per rank (module docstring). ``heads`` and
    ``groups`` per TP rank; ``inner``: the all-to-all size A of a2a+p2p; ``v_head_dim``: the
    value head size when it differs from ``head_dim`` (the q/k one)."""
    kind = cp_comm_type(comm_type)  # refuses an unknown type
    t = CPTraffic()
    if cp == 1:
        return t
    local = seq // cp
    f_over_e = max(element_size, 4) / element_size
    # one head of this rank's shard, q/k and v together (2 d when the sizes agree)
    unit = batch * local * (head_dim + (head_dim if v_head_dim is None else v_head_dim)) * element_size
    if kind.hierarchical:
        if not inner or cp % inner:
            raise ValueError(f"{kind.name} needs the inner (all-to-all) size dividing CP={cp}, got {inner}")
        expanded = expanded_kv_groups(groups, inner)
        if inner > 1:
            _all_to_all(t, inner, heads * unit, expanded * unit, "inner")
        if cp // inner > 1:
            # After the all-to-all a rank holds G'/A groups of A L tokens: G' L per head dim.
            _ring(t, cp // inner, expanded * unit, f_over_e, "outer")
    elif comm_type == "p2p":
        _ring(t, cp, groups * unit, f_over_e, "cp")
    elif comm_type == "a2a":
        _all_to_all(t, cp, heads * unit, expanded_kv_groups(groups, cp) * unit, "cp")
    else:  # allgather
        full_kv = groups * unit * cp
        t.add("forward", "all_gather", full_kv, "cp", (cp - 1) / cp)
        t.add("backward", "all_gather", full_kv, "cp", (cp - 1) / cp)
        t.add("backward", "reduce_scatter", full_kv, "cp", (cp - 1) / cp)
    return t
