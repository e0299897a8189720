"""The rules of context-parallel attention, checked by ``megalite.config.validate`` before any
group or model exists. Each raises :class:`ConfigError` naming the values, the rule and a fix;
a layout that only costs speed (an all-to-all group spanning nodes) returns a warning.

Why the rules (C = CP ranks, H = heads, T = TP, so each rank computes H/T heads):

- ``a2a`` swaps the sequence shard for a head shard over the C ranks: each gets (H/T)/C
  whole heads of the full sequence, so C must divide H/T.
- ``a2a+p2p`` does that swap over the inner group of A ranks only and runs the ring over the
  outer B = C/A: A*B = C and A must divide H/T (the ring has no head condition).
- Attention dropout needs the whole row of probabilities on one rank with one RNG stream;
  the ring (and so the hierarchical type) never has it, and megalite's all-to-all and
  all-gather paths share the same no-dropout kernels, so no type drops attention.
"""
from __future__ import annotations

from megalite.context_parallel.comm_types import CP_COMM_TYPES, cp_comm_type  # noqa: F401 - re-exported
from megalite.errors import ConfigError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_context_parallel(model, parallel, gpus_per_node: int | None = None) -> list[str]:
    """Validate ``model.cp_comm_type`` and ``parallel.hierarchical_context_parallel_sizes``
    against the layout (heads divisible by TP is checked before this). Returns warnings."""
    kind, sizes = model.cp_comm_type, parallel.hierarchical_context_parallel_sizes
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    heads = model.num_attention_heads
    per_rank = heads // tp
    described = cp_comm_type(kind)  # refuses an unknown type
    if sizes is not None:
        shown = " ".join(str(x) for x in sizes)
        if not described.hierarchical:
            raise ConfigError(f"--hierarchical-context-parallel-sizes {shown} is given with "
                              f"--cp-comm-type {kind}: the sizes split the CP group only for the "
                              f"hierarchical type. Fix: add --cp-comm-type a2a+p2p, or drop the sizes.")
        if len(sizes) != 2 or any(not isinstance(x, int) or x < 1 for x in sizes):
            raise ConfigError(f"--hierarchical-context-parallel-sizes {shown}: need two positive "
                              f"integers A B (A inner all-to-all ranks, B outer ring ranks).")
        a, b = sizes
        if a * b != cp:
            raise ConfigError(f"--hierarchical-context-parallel-sizes {a} {b}: A*B = {a * b} must equal "
                              f"--context-parallel-size ({cp}), every CP rank being in one inner and one "
                              f"outer group. Fix: choose A*B = {cp}, e.g. A B from "
                              f"{', '.join(f'{d} {cp // d}' for d in _divisors(cp))}.")
    if cp == 1:
        return []  # no context parallelism: the type is never used
    if model.attention_dropout > 0:
        raise ConfigError(f"--context-parallel-size {cp} with --attention-dropout "
                          f"{model.attention_dropout}: context-parallel attention (every "
                          f"--cp-comm-type) has no attention dropout (the ring's blocks never hold "
                          f"the whole row of probabilities to drop from, and the all-to-all and "
                          f"all-gather types share its kernels). Fix: --attention-dropout 0.")
    if described.all_to_all and not described.hierarchical and per_rank % cp != 0:
        good = [d for d in _divisors(cp) if per_rank % d == 0 and d > 1]
        hier = (f", or a2a+p2p with an inner size dividing {per_rank} "
                f"(--hierarchical-context-parallel-sizes {good[-1]} {cp // good[-1]})" if good else "")
        raise ConfigError(f"--cp-comm-type a2a with --num-attention-heads {heads}, "
                          f"--tensor-model-parallel-size {tp} and --context-parallel-size {cp}: the "
                          f"all-to-all gives each CP rank whole heads, so the heads per TP rank "
                          f"({heads}/{tp} = {per_rank}) must be divisible by CP ({cp}). Fix: "
                          f"--cp-comm-type p2p or allgather{hier}.")
    if described.hierarchical:
        if sizes is None:
            raise ConfigError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B "
                              f"(all-to-all over A consecutive CP ranks, the ring over B; A*B = "
                              f"--context-parallel-size {cp}). Fix: add the sizes, e.g. "
                              f"--hierarchical-context-parallel-sizes {_inner_guess(cp, per_rank)} "
                              f"{cp // _inner_guess(cp, per_rank)}.")
        a = sizes[0]
        if per_rank % a != 0:
            raise ConfigError(f"--hierarchical-context-parallel-sizes {a} {sizes[1]} with "
                              f"--num-attention-heads {heads} and --tensor-model-parallel-size {tp}: "
                              f"the inner all-to-all over A = {a} ranks gives each whole heads, so the "
                              f"heads per TP rank ({heads}/{tp} = {per_rank}) must be divisible by A. "
                              f"Fix: an inner size dividing {per_rank} (and CP {cp}): "
                              f"--hierarchical-context-parallel-sizes {_inner_guess(cp, per_rank)} "
                              f"{cp // _inner_guess(cp, per_rank)}.")
    return _node_warnings(kind, sizes, tp, cp, gpus_per_node)


def _inner_guess(cp: int, per_rank: int) -> int:
    """The largest inner size dividing both CP and the heads per TP rank."""
    return max(d for d in _divisors(cp) if per_rank % d == 0)


def _node_warnings(kind: str, sizes, tp: int, cp: int, gpus_per_node: int | None) -> list[str]:
    """The all-to-all group (all C ranks for a2a, the inner A for a2a+p2p) is A consecutive CP
    ranks, i.e. T*A consecutive global ranks starting at a multiple of T*A: on one node exactly
    when T*A divides the GPUs per node."""
    described = cp_comm_type(kind)
    if not gpus_per_node or not described.all_to_all:
        return []
    a = sizes[0] if described.hierarchical else cp
    span = tp * a
    if a == 1 or gpus_per_node % span == 0:
        return []
    fix = ("use --cp-comm-type a2a+p2p with an inner size A where TP*A divides the GPUs per node "
           "(the ring over the outer group crosses nodes well), or p2p"
           if not described.hierarchical else "choose A with TP*A dividing the GPUs per node")
    return [f"context-parallel all-to-all group of {a} CP ranks x TP {tp} = {span} consecutive ranks "
            f"spans nodes ({gpus_per_node} GPUs per node): its four all-to-alls per layer, forward and "
            f"backward, would travel over InfiniBand (~50 GB/s) instead of NVLink (~450 GB/s). "
            f"Fix: {fix}."]
