"""Hand each context-parallel rank its part of every sequence (tokens, labels, positions).

Causal attention, load-balanced: the sequence is cut into 2C equal chunks and rank r keeps
chunks r and 2C-1-r (the early chunks have little causal work, the late ones much; one of
each balances the ranks). Position ids keep the true positions, so learned positions and
RoPE see where each token really is. Non-causal attention needs no reordering: rank r keeps
the r-th contiguous C-th.
"""
from __future__ import annotations

import torch


def context_parallel_slice(batch: dict, cp_rank: int, cp_size: int, causal: bool = True) -> dict:
    """Slice every (b, s) tensor of a micro-batch along the sequence for this CP rank."""
    if cp_size == 1:
        return batch
    out = {}
    for key, t in batch.items():
        chunks = t.chunk(2 * cp_size if causal else cp_size, dim=1)
        if causal:
            out[key] = torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=1)
        else:
            out[key] = chunks[cp_rank]
    return out
