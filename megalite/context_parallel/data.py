"""Hand each context-parallel rank its part of every sequence (tokens, labels, positions),
and convert between that layout and the natural order.

Causal attention, load-balanced: the sequence is cut into 2C equal chunks and rank r keeps
chunks r and 2C-1-r (the early chunks have little causal work, the late ones much; one of
each balances the ranks). Position ids keep the true positions, so learned positions and
RoPE see where each token really is. Non-causal attention needs no reordering: rank r keeps
the r-th contiguous C-th.

When the C ranks' shards are concatenated in rank order (an all-gather, or the all-to-all of
Ulysses), the result is "rank-major": [c_0, c_{2C-1}, c_1, c_{2C-2}, ...]. ``rank_major_to_natural``
turns it into [c_0, c_1, ..., c_{2C-1}] and ``natural_to_rank_major`` back. Both are views
plus one copy, and each is the other's inverse (so autograd's backward of one is the other).
"""
from __future__ import annotations

import torch


# Packed documents' boundaries (see megalite.layers.documents): every rank keeps them whole, in
# absolute positions, so it knows where the document of every key of the sequence starts and ends.
WHOLE_SEQUENCE_KEYS = ("doc_start", "doc_end")


def context_parallel_slice(batch: dict, cp_rank: int, cp_size: int, causal: bool = True) -> dict:
    """Slice every (b, s) tensor of a micro-batch along the sequence for this CP rank; the
    documents' ``doc_start`` / ``doc_end`` stay whole (tiny int32 arrays, absolute positions)."""
    if cp_size == 1:
        return batch
    out = {}
    for key, t in batch.items():
        if key in WHOLE_SEQUENCE_KEYS or t.dim() < 2:  # no sequence dimension (an injected loss factor)
            out[key] = t
            continue
        chunks = t.chunk(2 * cp_size if causal else cp_size, dim=1)
        if causal:
            out[key] = torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=1)
        else:
            out[key] = chunks[cp_rank]
    return out


def rank_major_to_natural(x: torch.Tensor, dim: int, size: int, causal: bool = True) -> torch.Tensor:
    """``size`` ranks' load-balanced shards, concatenated in rank order along ``dim``, in the
    sequence's natural order. Non-causal shards are contiguous already: returned as given."""
    if size == 1 or not causal:
        return x
    n = x.shape[dim]
    parts = x.unflatten(dim, (size, 2, n // (2 * size)))  # (.., rank, early/late, chunk, ..)
    early = parts.select(dim + 1, 0)  # chunk r of rank r: ranks in order
    late = parts.select(dim + 1, 1).flip(dim)  # chunk 2C-1-r of rank r: ranks in reverse
    return torch.cat([early.flatten(dim, dim + 1), late.flatten(dim, dim + 1)], dim=dim)


def natural_to_rank_major(x: torch.Tensor, dim: int, size: int, causal: bool = True) -> torch.Tensor:
    """The inverse of :func:`rank_major_to_natural`: rank r's two chunks next to each other,
    ranks in order (the layout a reduce-scatter or all-to-all hands back rank by rank)."""
    if size == 1 or not causal:
        return x
    n = x.shape[dim]
    early, late = x.unflatten(dim, (2, size, n // (2 * size))).unbind(dim)
    return torch.stack([early, late.flip(dim)], dim=dim + 1).flatten(dim, dim + 2)
