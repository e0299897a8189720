"""Memory per rank by kind, against the ZeRO arithmetic.

For Psi parameters per model replica (this rank's TP/PP share of the model), N DP ranks,
weights and gradients of ``w`` and ``g`` bytes, fp32 master weights and Adam moments
(12 bytes per parameter: ``optimizer_bytes``, the update rule's ``bytes_per_parameter``,
:mod:`megalite.data_parallel.update_rule`; a rule with a matrix class counts its own bytes for
those, Muon 8 for its matrices: ``12`` below is then ``12 Psi_rest + 8 Psi_matrices``):

    stage 0: (w + g + 12) Psi        stage 2: w Psi + (g + 12) Psi / N
    stage 1: (w + g) Psi + 12 Psi/N  stage 3: (w + g + 12) Psi / N

With w = g = 2 (mixed precision) these are the ZeRO paper's 16 Psi, 4 Psi + 12 Psi/N,
2 Psi + 14 Psi/N and 16 Psi/N. Expert parameters (mixture of experts) follow the same
arithmetic with their own N, the expert-data-parallel size (the ranks holding the same experts).
"""
from __future__ import annotations

import torch

from megalite.data_parallel.update_rule import DEFAULT_RULE


def zero_theory_bytes(psi: int, n: int, stage: int, weight_bytes: int, grad_bytes: int,
                      optimizer_bytes: int | None = None, matrix_params: int = 0,
                      matrix_optimizer_bytes: int | None = None) -> dict[str, float]:
    """Bytes per rank by kind; ``optimizer_bytes`` per parameter of master weights and optimizer
    state (default: the default update rule's), ``matrix_optimizer_bytes`` (default: the same)
    for ``matrix_params`` of the ``psi`` that are in the rule's matrix class (Muon's matrices: 8)."""
    optimizer_bytes = DEFAULT_RULE.bytes_per_parameter if optimizer_bytes is None else optimizer_bytes
    matrix_optimizer_bytes = optimizer_bytes if matrix_optimizer_bytes is None else matrix_optimizer_bytes
    w, g = weight_bytes * psi, grad_bytes * psi
    opt = optimizer_bytes * (psi - matrix_params) + matrix_optimizer_bytes * matrix_params
    shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[stage]
    return {"weights": w / shard[0], "gradients": g / shard[1], "master_and_optimizer": opt / shard[2],
            "total": w / shard[0] + g / shard[1] + opt / shard[2]}


def model_parameters(optimizer, expert: bool | None = None) -> int:
    """Psi: parameters of this rank's model replica (unpadded); only the expert or only the
    dense ones with ``expert`` True / False."""
    return sum(n for b in optimizer.sync.buckets if expert is None or b.expert == expert for _, n in b.offsets)


def matrix_parameters(optimizer, expert: bool | None = None) -> int:
    """The part of :func:`model_parameters` in the update rule's matrix class (Muon's matrices)."""
    names = {p: n for c in optimizer.chunks for n, p in c.named_parameters()}
    return sum(n for b in optimizer.sync.buckets if expert is None or b.expert == expert
               for p, (_, n) in zip(b.params, b.offsets) if optimizer.rule.is_matrix(names[p], p))


def describe_memory(optimizer, dp: int) -> str:
    """One line: measured bytes per kind and the ZeRO arithmetic for this configuration."""
    m = optimizer.memory_bytes()
    psi = model_parameters(optimizer)
    w = torch.tensor([], dtype=optimizer.model_dtype).element_size()
    g = torch.tensor([], dtype=optimizer.sync.grad_dtype).element_size()
    rule = optimizer.rule  # master weights + optimizer state, per parameter class
    per_param, per_matrix = rule.bytes_of(False), rule.bytes_of(True)
    theory = zero_theory_bytes(model_parameters(optimizer, False), optimizer.sync.dp, optimizer.stage, w, g, per_param,
                               matrix_parameters(optimizer, False), per_matrix)
    experts = model_parameters(optimizer, True)
    edp = next((b.size for b in optimizer.sync.buckets if b.expert), 1)
    if experts:
        expert_theory = zero_theory_bytes(experts, edp, optimizer.stage, w, g, per_param,
                                          matrix_parameters(optimizer, True), per_matrix)
        theory = {k: v + expert_theory[k] for k, v in theory.items()}
    total = sum(m.values())
    mib = 1 / 2**20
    return (f"memory/rank (ZeRO-{optimizer.stage}, DP {dp}"
            + (f"; {experts / 1e6:.2f}M expert params over EDP {edp}" if experts else "")
            + f", {psi / 1e6:.2f}M params here): weights "
            f"{m['weights'] * mib:.1f} MiB, grads {m['gradients'] * mib:.1f}, master "
            f"{m['master_weights'] * mib:.1f}, optimizer {m['optimizer_state'] * mib:.1f}; total "
            f"{total * mib:.1f} MiB vs ZeRO arithmetic {theory['total'] * mib:.1f} MiB"
            + (f"; optimizer on CPU" if optimizer.offload else ""))
