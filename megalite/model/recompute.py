"""Activation recomputation (Megatron's --recompute-granularity / -method / -num-layers).

full: a checkpointed layer keeps only its input; its activations are recomputed during
backward. With ``uniform`` the layers are checkpointed in groups of N (only each group's
input is kept); with ``block`` the first N layers of each pipeline chunk are checkpointed
and the rest keep their activations.
selective: only the core attention (scores, softmax, attention-weighted values) is
recomputed; it is the part whose activations grow with s^2 and cost few FLOPs.

Recomputation must reproduce the forward exactly, dropout masks included: the default RNG
stream is restored by torch.utils.checkpoint; the tracker's other streams (tensor-parallel
dropout) are snapshotted here and restored for the recompute, then put back.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megalite.parallel.random import get_rng_tracker


def checkpointed(fn, *args):
    """fn(*args) whose activations are recomputed in backward, with identical randomness."""
    tracker = get_rng_tracker()
    snapshot = tracker.stream_states()
    first = [True]

    def run(*inner):
        if first[0]:
            first[0] = False
            return fn(*inner)
        current = tracker.stream_states()
        tracker.set_stream_states(snapshot)
        try:
            return fn(*inner)
        finally:
            tracker.set_stream_states(current)

    return checkpoint(run, *args, use_reentrant=False)


def run_layers(layers: list, x: torch.Tensor, rope, granularity: str | None, method: str, num_layers: int,
               training: bool) -> torch.Tensor:
    """Apply the transformer layers with full recomputation as configured."""
    if granularity != "full" or not training or not torch.is_grad_enabled():
        for layer in layers:
            x = layer(x, rope)
        return x
    if method == "block":
        for i, layer in enumerate(layers):
            x = checkpointed(layer, x, rope) if i < num_layers else layer(x, rope)
        return x
    for start in range(0, len(layers), num_layers):  # uniform: groups of num_layers
        group = layers[start: start + num_layers]

        def run_group(h, r, group=group):
            for layer in group:
                h = layer(h, r)
            return h

        x = checkpointed(run_group, x, rope)
    return x
