"""All-gather context parallelism: every rank gathers the whole sequence's keys and values.

Forward: one all-gather of K and V together over the CP group (rank-major, put in natural
order), then each rank attends its own load-balanced query chunks (``context_parallel.data``)
to the keys they may see. Query chunk a (of 2C, each c tokens) sees keys [0, a c) without a
mask and keys [a c, (a+1) c), its own chunk, with the causal diagonal; the two partial results
are merged exactly through their log-sum-exp, as in the ring. The diagonal blocks need only
this rank's own K/V, so they are computed while the all-gather is in flight (the overlap
this type allows: with the fused QKV projection there is no separate Q projection to hide the
gather behind). Non-causal: the local queries against all keys, one call after the gather.
The block functions are the ring's (:func:`.ring_attention.block_ops`: Triton, flash-attn or
torch), so every backend gives the same numbers.

Backward: K and V are gathered again (only this rank's shards are kept between forward and
backward, so the activation memory stays O(s/C); the full K/V exist only while one layer
computes), the diagonal blocks again run during the gather, every block's dK/dV land in a
full-sequence fp32 buffer, and one reduce-scatter (the transpose of the all-gather) sums the C
ranks' contributions and hands each rank its own shards, in the activations' dtype.

Packed documents (whole (b, s) arrays, absolute positions): every block runs causal with its
absolute offsets (query chunk a at ``a c``, the gathered keys [0, a c) at 0, the diagonal at
``a c``) and the document slices, so a key is seen only within its document. The gathered range
is not narrowed to the query chunk's earliest document start: that start is known only on the
device (narrowing would be a host sync per layer); the Triton kernels skip the key tiles before
it instead, and the torch blocks mask them.

Traffic per rank and layer, counted as bytes handed to the collectives (all-gather output,
reduce-scatter input): forward b G s (d + d_v) e (K and V side by side), backward the same again plus b G s (d + d_v) e
reduced; (C-1)/C of each crosses the wire. See ``context_parallel.traffic``.
"""
from __future__ import annotations

import torch

from megalite.context_parallel.data import rank_major_to_natural
from megalite.context_parallel.ring_attention import (BlockRowMax, assemble_output, block_ops,
                                                      check_documents_length, local_chunk_ids)
from megalite.layers.documents import Documents
from megalite.kernels.attention_reference import merge_attention
from megalite.observe.memory_tracker import category
from megalite.parallel import comm


class GatheredKV:
    """An all-gather of this rank's K and V shards (b, groups, s_local, d) and (b, groups, s_local,
    d_v), started at once; :meth:`wait` gives the whole sequence's K and V (b, groups, s, d) and
    (b, groups, s, d_v) in natural order. K and V travel side by side along the last dim
    (s_local, b, g, d + d_v), so the value head size may differ from the key's."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, group, causal: bool):
        self.size, self.causal = comm.group_size(group), causal
        self.sizes = [k.shape[3], v.shape[3]]
        local = torch.cat([k, v], dim=3).permute(2, 0, 1, 3).contiguous()  # (s_local, b, g, d + d_v)
        with category("communication"):
            self.full = torch.empty((self.size * local.shape[0],) + tuple(local.shape[1:]), dtype=k.dtype,
                                    device=k.device)
        self.work = comm.all_gather_async(self.full, local, group)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.work.wait()
        full = rank_major_to_natural(self.full, 0, self.size, self.causal)  # (s, b, g, d + d_v)
        self.full = None  # the rank-major copy goes as soon as the natural one exists
        k_full, v_full = full.permute(1, 2, 0, 3).split(self.sizes, dim=3)
        return k_full, v_full


def rank_major_chunks(size: int, causal: bool) -> list[int]:
    """The natural chunk ids in rank-major order: rank 0's, then rank 1's, ..."""
    return [c for r in range(size) for c in ((r, 2 * size - 1 - r) if causal else (r,))]


def scatter_sequence_sum(both: torch.Tensor, group, causal: bool, dtype: torch.dtype, key_size: int):
    """Every rank's full-sequence partial dK and dV side by side, ``both`` (s, b, groups, d + d_v)
    in natural order (``key_size`` = d)
    -> this rank's shards of their sums (one reduce-scatter of both, in ``dtype``). The rank-major
    send buffer is filled chunk by chunk, cast on the way: no further full-sequence copy."""
    size = comm.group_size(group)
    with category("communication"):
        rank_major = torch.empty(both.shape, dtype=dtype, device=both.device)
    ids = rank_major_chunks(size, causal)
    natural = both.chunk(len(ids), 0)
    for dst, chunk_id in zip(rank_major.chunk(len(ids), 0), ids):
        dst.copy_(natural[chunk_id])
    mine = comm.reduce_scatter_dim0(rank_major, group)  # (s_local, b, g, d + d_v)
    dk_local, dv_local = mine.permute(1, 2, 0, 3).split([key_size, mine.shape[3] - key_size], dim=3)
    return dk_local, dv_local


def _diagonal_blocks(rank: int, size: int, chunk: int, causal: bool):
    """(local part, key start, key end) of the blocks on the causal diagonal: local keys only."""
    if causal:
        for part, a in enumerate(local_chunk_ids(rank, size, causal)):
            yield part, a * chunk, (a + 1) * chunk


def _gathered_blocks(rank: int, size: int, chunk: int, causal: bool):
    """(local part, key start, key end) of the unmasked blocks that need gathered keys."""
    if not causal:
        yield 0, 0, None
        return
    for part, a in enumerate(local_chunk_ids(rank, size, causal)):
        if a > 0:
            yield part, 0, a * chunk


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, ops, documents=None, logit_max=None):
        size, rank = comm.group_size(group), comm.group_rank(group)
        rows = BlockRowMax(ops, logit_max)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        n = 2 if causal else 1
        q_parts, k_parts, v_parts = q.chunk(n, 2), k.chunk(n, 2), v.chunk(n, 2)
        chunk = q_parts[0].shape[2]
        check_documents_length(documents, chunk, n * size, causal)
        gathered = GatheredKV(k, v, group, causal)
        acc = [None] * n

        def add(part, o, lse):
            rows.fold()
            o = o.to(acc_dtype)
            acc[part] = (o, lse) if acc[part] is None else merge_attention(*acc[part], o, lse)

        for part, lo, hi in _diagonal_blocks(rank, size, chunk, causal):  # while the gather runs
            add(part, *ops.forward(q_parts[part], k_parts[part], v_parts[part], scale=scale,
                                   **_kwargs(documents, True, lo, hi, lo, chunk), **rows.kwargs(q_parts[part])))
        k_full, v_full = gathered.wait()
        for part, lo, hi in _gathered_blocks(rank, size, chunk, causal):
            q_start = local_chunk_ids(rank, size, causal)[part] * chunk
            add(part, *ops.forward(q_parts[part], k_full[:, :, lo:hi], v_full[:, :, lo:hi], scale=scale,
                                   **_kwargs(documents, False, lo, hi, q_start, chunk), **rows.kwargs(q_parts[part])))
        out, lse = assemble_output(q, acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.ops, ctx.documents = group, causal, scale, ops, documents
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, ops, documents = ctx.group, ctx.causal, ctx.scale, ctx.ops, ctx.documents
        size, rank = comm.group_size(group), comm.group_rank(group)
        gathered = GatheredKV(k, v, group, causal)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        delta = ops.delta(out, dout)
        n = 2 if causal else 1
        q_parts, o_parts, do_parts = q.chunk(n, 2), out.chunk(n, 2), dout.chunk(n, 2)
        k_parts, v_parts = k.chunk(n, 2), v.chunk(n, 2)
        lse_parts, delta_parts = lse.chunk(n, 2), delta.chunk(n, 2)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dq_parts = dq.chunk(n, 2)
        b, groups, s_local, d = k.shape
        # dK and dV of the whole sequence in fp32, laid out (s, b, g, d + d_v) as the reduce-scatter sends.
        both = torch.zeros((size * s_local, b, groups, d + v.shape[3]), dtype=acc_dtype, device=k.device)
        dk_full, dv_full = both.permute(1, 2, 0, 3).split([d, v.shape[3]], dim=3)
        chunk = q_parts[0].shape[2]

        def block(part, k_blk, v_blk, lo, hi, diag):
            q_start = local_chunk_ids(rank, size, causal)[part] * chunk
            dq_p, dk_p, dv_p = ops.backward(q_parts[part], k_blk, v_blk, o_parts[part], do_parts[part],
                                            lse_parts[part], scale=scale, delta=delta_parts[part],
                                            **_kwargs(documents, diag, lo, hi, q_start, chunk))
            dq_parts[part].add_(dq_p.to(acc_dtype))
            dk_full[:, :, lo:hi].add_(dk_p.to(acc_dtype))
            dv_full[:, :, lo:hi].add_(dv_p.to(acc_dtype))

        for part, lo, hi in _diagonal_blocks(rank, size, chunk, causal):  # while the gather runs
            block(part, k_parts[part], v_parts[part], lo, hi, True)
        k_full, v_full = gathered.wait()
        for part, lo, hi in _gathered_blocks(rank, size, chunk, causal):
            block(part, k_full[:, :, lo:hi], v_full[:, :, lo:hi], lo, hi, False)
        del k_full, v_full, dk_full, dv_full  # the gathered K/V are not needed for the reduce-scatter
        dk, dv = scatter_sequence_sum(both, group, causal, k.dtype, d)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None


def _kwargs(documents: Documents | None, diag: bool, lo: int, hi: int, q_start: int, chunk: int) -> dict:
    """A block's keyword arguments: keys [lo, hi) against the query chunk starting at ``q_start``
    (``chunk`` tokens); with documents, causal at those absolute offsets (see the module docstring)."""
    if documents is None:
        return {"causal": diag}
    return documents.block(q_start, chunk, lo, hi - lo)


def allgather_attention(q, k, v, group, causal: bool = True, scale: float | None = None,
                        backend: str = "auto", documents: Documents | None = None,
                        logit_max: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence, K/V all-gathered.
    Shapes and layout as :func:`.ring_attention.ring_attention`; ``documents`` and
    ``logit_max`` as there."""
    return _AllGatherAttention.apply(q, k, v, group, causal, scale, block_ops(backend, q, documents is not None),
                                     documents, logit_max)
