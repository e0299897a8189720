"""All-to-all context parallelism (DeepSpeed-Ulysses), and its hierarchical form with a ring.

Each of the A ranks of the all-to-all group holds all heads of its shard of the sequence.
One all-to-all per tensor (over heads -> over sequence) gives every rank the whole (group's)
sequence for heads/A of the heads; the attention in between is the ordinary single-device
call (Triton, flash-attn or torch, unchanged), and a last all-to-all turns the output back
into sequence shards. Backward: each all-to-all's transpose is the all-to-all the other way
(:func:`megalite.parallel.comm.all_to_all_swap`), so the gradients take the same four
exchanges back.

Sequence order: the ranks hold load-balanced chunks (``context_parallel.data``); the
gathered sequence arrives rank-major and is put in natural order before attention (and back
after), so the causal mask is the plain one.

Grouped-query attention: q heads are laid out group by group, so rank a's heads
[a H/A, (a+1) H/A) use key/value groups [a G/A, (a+1) G/A) when A divides G. Otherwise each
key/value group is repeated G'/G times, G' = lcm(G, A) (H divides by both, so by G'): every
rank then gets whole repeated groups, and autograd sums the copies' gradients back.

Hierarchical (``a2a+p2p``): the all-to-all runs inside an inner group of A ranks (one node's
NVLink), the ring (:mod:`.ring_attention`) over the outer group of B = C/A ranks. The inner
group whose outer index is j holds chunks [A j, A (j+1)) and their mirror images of the 2C
chunking: in natural order these are chunks j and 2B-1-j of a 2B chunking, exactly the
load-balanced layout a ring of B ranks expects.

Packed documents (whole (b, s) arrays, absolute positions): after the all-to-all the
sequence is whole and in natural order, so the plain attention call takes the full arrays;
under a2a+p2p the ring over the outer group does (its chunk j of the 2B chunking starts at the
absolute position j s / 2B, the offsets the ring computes from its own rank and size).
"""
from __future__ import annotations

import math

import torch

from megalite.context_parallel.data import natural_to_rank_major, rank_major_to_natural
from megalite.context_parallel.ring_attention import ring_attention
from megalite.layers.attention import attention
from megalite.layers.documents import Documents
from megalite.parallel import comm


def expanded_kv_groups(groups: int, size: int) -> int:
    """Key/value groups after replication so that ``size`` ranks get whole groups each."""
    return groups if groups % size == 0 else math.lcm(groups, size)


def sequence_to_heads(x: torch.Tensor, group, causal: bool = True) -> torch.Tensor:
    """(b, heads, s_local, d) sequence shards -> (b, heads/A, A s_local, d) in natural order."""
    y = comm.all_to_all_swap(x, 1, 2, group)
    return rank_major_to_natural(y, 2, comm.group_size(group), causal)


def heads_to_sequence(x: torch.Tensor, group, causal: bool = True) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`: back to all heads of this rank's shard."""
    y = natural_to_rank_major(x, 2, comm.group_size(group), causal)
    return comm.all_to_all_swap(y, 2, 1, group)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inner, outer=None, *,
                      causal: bool = True, backend: str = "auto", documents: Documents | None = None,
                      logit_max: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence: all-to-all over
    ``inner``, then the ring over ``outer`` (None or one rank: plain attention), then back.
    q: (b, heads, s_local, d); k, v: (b, groups, s_local, d), heads divisible by the inner
    size (the config refuses other layouts before any work); v's head size may differ from
    q's and k's (the output has v's). ``logit_max`` (heads,): raised to each head's largest
    visible logit; after the all-to-all this rank attends heads [a H/A, (a+1) H/A) of them
    (a its inner rank) over the whole sequence, so only that slice is raised here and the
    other ranks' slices stay -inf, for QK-clip's max over the CP group to fill."""
    size = comm.group_size(inner)
    heads, groups = q.shape[1], k.shape[1]
    if heads % size != 0:
        raise ValueError(f"all-to-all context parallelism over {size} ranks needs the heads per "
                         f"rank ({heads}) divisible by {size}")
    wanted = expanded_kv_groups(groups, size)
    if wanted != groups:
        k, v = k.repeat_interleave(wanted // groups, dim=1), v.repeat_interleave(wanted // groups, dim=1)
    q, k, v = (sequence_to_heads(t, inner, causal) for t in (q, k, v))
    mine = None
    if logit_max is not None:  # a view: the attention below raises this rank's heads in place
        per_rank = heads // size
        mine = logit_max[comm.group_rank(inner) * per_rank: (comm.group_rank(inner) + 1) * per_rank]
    if comm.group_size(outer) > 1:
        out = ring_attention(q, k, v, outer, causal=causal, backend=backend, documents=documents, logit_max=mine)
    else:
        out = attention(q, k, v, causal=causal, backend=backend, documents=documents, logit_max=mine)
    return heads_to_sequence(out, inner, causal)
