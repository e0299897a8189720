"""All-gather context parallelism: every rank gathers the whole sequence's keys and values.

Forward: all-gather K and V over the CP group (rank-major, put in natural order), then each
rank attends its own load-balanced query chunks (``context_parallel.data``) to the keys they
may see. Query chunk a (of 2C, each c tokens) sees keys [0, a c) without a mask and keys
[a c, (a+1) c) with the causal diagonal; the two partial results are merged exactly through
their log-sum-exp, as in the ring. Non-causal: the local queries against all keys, one call.
The block functions are the ring's (:func:`.ring_attention.block_ops`: Triton, flash-attn or
torch), so every backend gives the same numbers.

Backward: K and V are gathered again (only this rank's shards are kept between forward and
backward, so the activation memory stays O(s/C); the full K/V exist only while one layer
computes), each block's dK/dV land in a full-sequence fp32 buffer, and a reduce-scatter
(the transpose of the all-gather) sums the C ranks' contributions and hands each rank its
own shards, in the activations' dtype.

Traffic per rank and layer, counted as bytes handed to the collectives (all-gather output,
reduce-scatter input): forward 2 b G s d e (K and V), backward 2 b G s d e again plus 2 b G s d e
reduced; (C-1)/C of each crosses the wire. See ``context_parallel.traffic``.
"""
from __future__ import annotations

import torch

from megalite.context_parallel.data import natural_to_rank_major, rank_major_to_natural
from megalite.context_parallel.ring_attention import block_ops, local_chunk_ids
from megalite.kernels.attention_reference import merge_attention
from megalite.parallel import comm


def gather_sequence(x: torch.Tensor, group, causal: bool) -> torch.Tensor:
    """(b, groups, s_local, d) shards -> (b, groups, s, d), natural order (one all-gather)."""
    size = comm.group_size(group)
    full = comm.all_gather_dim0(x.permute(2, 0, 1, 3).contiguous(), group)  # (C s_local, b, g, d)
    return rank_major_to_natural(full, 0, size, causal).permute(1, 2, 0, 3)


def scatter_sequence_sum(x: torch.Tensor, group, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """(b, groups, s, d) per-rank partial sums -> this rank's shard of their sum (reduce-scatter)."""
    size = comm.group_size(group)
    rank_major = natural_to_rank_major(x.permute(2, 0, 1, 3), 0, size, causal).to(dtype)
    return comm.reduce_scatter_dim0(rank_major.contiguous(), group).permute(1, 2, 0, 3)


def _blocks(rank: int, size: int, chunk: int, causal: bool):
    """(local query part, key range start, key range end, causal diagonal?) of every block."""
    if not causal:
        yield 0, 0, None, False
        return
    for part, a in enumerate(local_chunk_ids(rank, size, causal)):
        if a > 0:
            yield part, 0, a * chunk, False  # every earlier chunk: no mask
        yield part, a * chunk, (a + 1) * chunk, True  # its own chunk: the diagonal


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, ops):
        size, rank = comm.group_size(group), comm.group_rank(group)
        k_full, v_full = gather_sequence(k, group, causal), gather_sequence(v, group, causal)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        q_parts = q.chunk(2 if causal else 1, dim=2)
        chunk = q_parts[0].shape[2]
        acc = [None] * len(q_parts)
        for part, lo, hi, diag in _blocks(rank, size, chunk, causal):
            o, lse = ops.forward(q_parts[part], k_full[:, :, lo:hi], v_full[:, :, lo:hi], causal=diag, scale=scale)
            o = o.to(acc_dtype)
            acc[part] = (o, lse) if acc[part] is None else merge_attention(*acc[part], o, lse)
        b, heads, s, d = q.shape  # the output laid out (s, b, heads, d), as the ring's
        out = torch.empty((s, b, heads, d), dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)
        out.copy_(torch.cat([a[0] for a in acc], dim=2))
        lse = torch.cat([a[1] for a in acc], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.ops = group, causal, scale, ops
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, ops = ctx.group, ctx.causal, ctx.scale, ctx.ops
        size, rank = comm.group_size(group), comm.group_rank(group)
        k_full, v_full = gather_sequence(k, group, causal), gather_sequence(v, group, causal)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        delta = ops.delta(out, dout)
        n = 2 if causal else 1
        q_parts, o_parts, do_parts = q.chunk(n, 2), out.chunk(n, 2), dout.chunk(n, 2)
        lse_parts, delta_parts = lse.chunk(n, 2), delta.chunk(n, 2)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dq_parts = dq.chunk(n, 2)
        dk_full = torch.zeros(k_full.shape, dtype=acc_dtype, device=k.device)
        dv_full = torch.zeros(v_full.shape, dtype=acc_dtype, device=v.device)
        for part, lo, hi, diag in _blocks(rank, size, q_parts[0].shape[2], causal):
            dq_p, dk_p, dv_p = ops.backward(
                q_parts[part], k_full[:, :, lo:hi], v_full[:, :, lo:hi], o_parts[part], do_parts[part],
                lse_parts[part], causal=diag, scale=scale, delta=delta_parts[part])
            dq_parts[part].add_(dq_p.to(acc_dtype))
            dk_full[:, :, lo:hi].add_(dk_p.to(acc_dtype))
            dv_full[:, :, lo:hi].add_(dv_p.to(acc_dtype))
        dk = scatter_sequence_sum(dk_full, group, causal, k.dtype)
        dv = scatter_sequence_sum(dv_full, group, causal, v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None


def allgather_attention(q, k, v, group, causal: bool = True, scale: float | None = None,
                        backend: str = "auto") -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence, K/V all-gathered.
    Shapes and layout as :func:`.ring_attention.ring_attention`."""
    return _AllGatherAttention.apply(q, k, v, group, causal, scale, block_ops(backend, q))
