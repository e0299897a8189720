"""The global tensors a local parameter holds, by the names checkpoints use.

Most parameters are one global tensor (or a tensor-parallel shard of one), named as in the
model (``layers.7.mlp.fc1.weight``). A stacked expert parameter (``layers.3.mlp.experts.w1``,
shape (E_local, ...), see :mod:`megalite.moe.experts`) holds E_local global tensors, one per
expert, named by the *global* expert index: ``layers.3.mlp.experts.7.fc1.weight``. So a
checkpoint written under one expert-parallel size loads under any other, and serially.
"""
from __future__ import annotations

from megalite.parallel.sharding import is_expert


def global_pieces(name: str, p) -> list[tuple[str, int, int, tuple]]:
    """``(global name, start, numel, shape)`` of each global tensor inside ``p`` (flat ranges)."""
    if not is_expert(p):
        return [(name, 0, p.numel(), tuple(p.shape))]
    prefix = name.rsplit(".", 1)[0]
    shape = tuple(p.shape[1:])
    per = p[0].numel() if p.shape[0] else 0
    return [(f"{prefix}.{p.expert_first + i}.{p.expert_leaf}", i * per, per, shape) for i in range(p.shape[0])]
