"""Ring attention over the context-parallel (CP) group, on any device.

Each of C ranks holds a shard of the sequence's queries, keys and values. Causal layout
(load-balanced): the sequence is cut into 2C chunks and rank r holds chunks r and 2C-1-r,
so every rank has one early and one late chunk and the same amount of causal work.
Non-causal: rank r holds the r-th contiguous C-th of the sequence.

Forward, C steps. At step i rank r holds the K/V of rank (r - i) mod C; before computing on
it, it posts the isend of that block to rank r+1 and the irecv of the next one from r-1, so
the transfer overlaps the compute. For each (query chunk, key chunk) pair it calls the
block forward: key chunk after query chunk -> skipped (fully masked, no work); same chunk ->
causal (top-left aligned diagonal); earlier chunk -> unmasked. Partial results are merged
exactly through their log-sum-exp: lse = logaddexp(lse1, lse2), out = sum_j out_j exp(lse_j - lse).

Backward, C steps again. delta = rowsum(dO * O) is computed once; each step gives, from
the *global* lse, this rank's dQ contribution (kept) and dK/dV for the visiting block,
which travel with it round the ring: after C hops the accumulated dK/dV reach their owner.
Each block's dQ/dK/dV comes back in fp32 (the torch path computes in fp32; the Triton kernels
are asked to store fp32) and the ring accumulates in fp32, so a 16-bit run rounds the sum of
the C contributions once, not each of them. The dK/dV exchange is double-buffered: a step computes its contribution into fresh buffers
while the block's accumulator from the previous rank is still in flight, then waits for it,
adds and sends the sum on; so each transfer overlaps the next step's compute.
Communication is point-to-point only (batched isend/irecv to the ring neighbours): every
K/V block must meet every query shard once, and a ring does that moving one block per step
per rank, so the whole sequence is never gathered and each rank holds O(s/C) of it.

Block functions (``backend``), the same numbers up to rounding:
- ``triton``: the Triton flash-attention kernels (``flash_attention_forward`` /
  ``flash_attention_backward``; the GPU default). On a CPU only under ``TRITON_INTERPRET=1``.
- ``torch``: the math path of ``megalite.kernels.attention_reference`` (one block's scores
  materialized, float32 for 16-bit inputs); runs on any device. On ``meta`` (the dry run)
  every backend is replaced by shape-only stand-ins with the Triton kernels' memory.
- ``flash``: flash-attn's block forward (with its LSE) and backward (from the global output
  and LSE), through the adapter of :mod:`megalite.context_parallel.flash_blocks`; a CUDA GPU
  with flash-attn installed, fp16/bf16.
- ``auto``: triton on a CUDA tensor when the kernels can run there, else torch (flash only
  when asked for: which of the two is faster under the ring is not measured yet).

Packed documents (``documents``, whole (b, s) arrays in absolute positions, see
:mod:`megalite.layers.documents`): every visible pair (query chunk a, key chunk a' <= a) runs
causal with its absolute offsets ``a c`` and ``a' c`` (c = s / 2C) and the document slices of
its chunks, so a key is seen only by the queries of its own document. No pair is skipped on
the host: which pairs some document spans is known only on the device (a host decision would
be a sync per layer), so every pair runs and the Triton kernels skip the tiles no document
spans (the torch blocks compute them and mask them to zero; a row that sees no key of a block
has lse = -inf and merges as nothing). The K/V exchange is the same either way. Load balance:
with documents the work of a rank is the sum, over its (query chunk, key chunk) pairs, of the
visible (query, key) pairs inside documents; the 2C-chunk split balances the causal triangle,
and with documents much shorter than a chunk each chunk holds about the same number of
document triangles, so the ranks stay nearly equal (measured in tests/test_packed_attention.py).
flash-attn blocks refuse documents.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from megalite.kernels.attention_reference import (attention_block_backward, attention_block_delta,
                                                  attention_block_forward, fold_head_max, merge_attention)
from megalite.layers.attention import TRITON_MAX_HEAD_DIM, BackendUnavailable, refuse_flash_logit_max, require_flash
from megalite.layers.backends import triton_missing
from megalite.layers.documents import Documents
from megalite.observe.memory_tracker import category
from megalite.parallel import comm

RING_TAG = 7
RING_BACKENDS = ("auto", "triton", "flash", "torch")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class BlockOps(NamedTuple):
    """The per-block functions of one backend, with the Triton kernels' signatures."""
    name: str
    forward: Callable  # (q, k, v, causal=, scale=, q_offset=, k_offset=, doc_start=, doc_end=) -> (out, lse)
    backward: Callable  # (q, k, v, out, dout, lse, causal=, scale=, delta=, offsets and docs) -> (dq, dk, dv)
    delta: Callable  # (out, dout) -> rowsum(dout * out), float32 or float64


def resolve_ring_backend(backend: str, q: torch.Tensor) -> str:
    """The block functions' backend for this call, triton, flash or torch (see the module
    docstring); a backend that cannot run here, or an unknown name, raises."""
    device = q.device.type
    if backend == "auto":
        triton_fits = q.dtype in TRITON_DTYPES and q.shape[-1] <= TRITON_MAX_HEAD_DIM
        return "triton" if device == "cuda" and triton_fits and triton_missing("cuda") is None else "torch"
    if backend == "flash":
        require_flash(q, "ring attention on flash-attn")
    elif backend == "triton":
        why = triton_missing(device)
        if why:
            raise BackendUnavailable(f"ring attention on the triton backend cannot run: {why}. "
                                     f"Fix: set that up, or use --attention-backend torch or auto.")
    elif backend != "torch":
        raise BackendUnavailable(f"ring attention backend {backend!r} is unknown; use one of "
                                 f"{', '.join(RING_BACKENDS)}.")
    return backend


def _meta_forward(q, k, v, causal: bool = True, scale: float | None = None, row_max=None, **documents):
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    return out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)


def _meta_backward(q, k, v, out, dout, lse, causal: bool = True, scale: float | None = None, delta=None,
                   **documents):
    return tuple(torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))


def _meta_delta(out, dout):
    return torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)


# On meta tensors (the dry run) nothing is computed: these give the outputs the Triton kernels
# give on a GPU (out like q with v's head size, fp32 lse and delta, fp32 block gradients), and, as those kernels,
# never materialize a block's (s_q x s_k) scores, so the dry run measures a GPU's memory.
META_OPS = BlockOps("meta", _meta_forward, _meta_backward, _meta_delta)


def block_ops(backend: str, q: torch.Tensor, documents: bool = False) -> BlockOps:
    """The block functions for ``backend`` on q's device (``META_OPS`` on meta); Triton or
    flash-attn is imported only when chosen. ``documents``: the blocks take packed documents
    (flash-attn's blocks refuse them)."""
    if q.device.type == "meta":
        return META_OPS
    if documents and backend == "flash":
        raise BackendUnavailable("context-parallel attention on flash-attn blocks does not take packed "
                                 "documents (--reset-attention-mask). Fix: --attention-backend triton "
                                 "(or auto, or torch).")
    name = resolve_ring_backend(backend, q)
    if name == "flash":
        from megalite.context_parallel.flash_blocks import flash_block_backward, flash_block_forward

        return BlockOps("flash", flash_block_forward, flash_block_backward, attention_block_delta)
    if name == "triton":
        from megalite.kernels.flash_attention import flash_attention_forward
        from megalite.kernels.flash_attention_bwd import attention_delta, flash_attention_backward

        # Each block's dQ/dK/dV in fp32: the ring sums C of them (module docstring).
        backward = functools.partial(flash_attention_backward, grad_dtype=torch.float32)
        return BlockOps("triton", flash_attention_forward, backward, attention_delta)
    return BlockOps("torch", attention_block_forward, attention_block_backward, attention_block_delta)


class BlockRowMax:
    """QK-clip's statistic from the blocks (:mod:`megalite.model.qk_clip`): each block forward
    writes its rows' largest visible logit (``row_max``, as its lse), and :meth:`fold` raises
    the (heads,) ``logit_max`` to the block's per-head max, on the device. The max over blocks
    is the max over all the keys a query sees, so it needs no merge rule. flash-attn's blocks
    give no such row max: refused. Inactive (no extra argument, no work) without ``logit_max``."""

    def __init__(self, ops: BlockOps, logit_max: torch.Tensor | None):
        if logit_max is not None and ops.name == "flash":
            refuse_flash_logit_max("context-parallel attention on flash-attn blocks")
        self.logit_max, self.active = logit_max, logit_max is not None and ops.name != "meta"
        self.buffer = None

    def kwargs(self, q: torch.Tensor) -> dict:
        if not self.active:
            return {}
        self.buffer = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        return {"row_max": self.buffer}

    def fold(self) -> None:
        if self.active:
            fold_head_max(self.logit_max, self.buffer)


class RingExchange:
    """Send tensors to the next CP rank while receiving the same shapes from the previous."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        # Per call (a RingExchange lives for one attention call, and so do these logs):
        self.events: list[tuple[str, float]] = []  # (what, time) for the overlap test
        self.work: list[tuple[int, int, bool]] = []  # (q chunk, k chunk, causal) per block forward

    def start(self, tensors: list[torch.Tensor]):
        tensors = [t.contiguous() for t in tensors]
        with category("communication"):
            received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = []
        for t, r in zip(tensors, received):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, RING_TAG))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, RING_TAG))
            comm._record("send", t, group=self.group)
        self.events.append(("posted", time.perf_counter()))
        return received, dist.batch_isend_irecv(ops)

    def finish(self, pending) -> list[torch.Tensor]:
        received, works = pending
        with comm.blocked():  # waiting for the ring neighbour (straggler reports)
            for w in works:
                w.wait()
        self.events.append(("arrived", time.perf_counter()))
        return received


def local_chunk_ids(rank: int, size: int, causal: bool) -> list[int]:
    return [rank, 2 * size - 1 - rank] if causal else [rank]


def block_kwargs(documents: Documents | None, causal: bool, q_chunk: int, k_chunk: int, chunk: int,
                 k_chunks: int = 1) -> dict:
    """The keyword arguments of one block call: queries of chunk ``q_chunk`` against the
    ``k_chunks`` key chunks from ``k_chunk`` on (each ``chunk`` tokens). Without documents, just
    ``causal`` (the diagonal); with them, causal with the absolute offsets and the document slices."""
    if documents is None:
        return {"causal": causal}
    return documents.block(q_chunk * chunk, chunk, k_chunk * chunk, k_chunks * chunk)


def check_documents_length(documents: Documents | None, chunk: int, chunks: int, causal: bool) -> None:
    """Documents span the whole sequence (``chunks`` chunks of ``chunk``), and need causal attention."""
    if documents is None:
        return
    if not causal:
        raise ValueError("packed documents need causal attention.")
    if documents.start.shape[1] != chunk * chunks:
        raise ValueError(f"packed documents cover {documents.start.shape[1]} positions, the sequence has "
                         f"{chunk * chunks} ({chunks} chunks of {chunk}): pass the whole sequence's "
                         f"doc_start/doc_end, unsliced.")


def _pairs(rank, src, size, causal):
    """(local q index, q chunk id, local k index, k chunk id, causal kernel?) of visible pairs."""
    q_ids, k_ids = local_chunk_ids(rank, size, causal), local_chunk_ids(src, size, causal)
    for qi, qa in enumerate(q_ids):
        for ki, ka in enumerate(k_ids):
            if causal and ka > qa:
                continue  # every key after every query: fully masked, no work
            yield qi, qa, ki, ka, causal and ka == qa


def assemble_output(q: torch.Tensor, acc: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out, lse) of each local query chunk, in order -> one output like q but of the
    value head size d_v (the partials'), laid out (s, b, heads, d_v): the order proj reads (as the
    Triton kernel writes it), so the model's permute + reshape is a view and the output is kept
    once; and the lse of all chunks."""
    (b, heads, s, _), d_v = q.shape, acc[0][0].shape[3]
    out = torch.empty((s, b, heads, d_v), dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)
    start = 0
    for part, _ in acc:
        out[:, :, start: start + part.shape[2]].copy_(part)
        start += part.shape[2]
    return out, torch.cat([a[1] for a in acc], dim=2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, exchange, ops, documents=None, logit_max=None):
        size, rank = exchange.size, exchange.rank
        rows = BlockRowMax(ops, logit_max)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)  # partials merged in float32
        n = 2 if causal else 1
        q_parts = q.chunk(n, dim=2)
        chunk = q_parts[0].shape[2]
        check_documents_length(documents, chunk, n * size, causal)
        acc = [None] * n
        k_cur, v_cur = k, v
        for i in range(size):
            src = (rank - i) % size
            pending = exchange.start([k_cur, v_cur]) if i < size - 1 else None
            exchange.events.append(("compute", time.perf_counter()))
            k_parts, v_parts = k_cur.chunk(n, dim=2), v_cur.chunk(n, dim=2)
            for qi, qa, ki, ka, diag in _pairs(rank, src, size, causal):
                exchange.work.append((qa, ka, diag))  # the load-balance count of the tests
                o, lse = ops.forward(q_parts[qi], k_parts[ki], v_parts[ki], scale=scale,
                                     **block_kwargs(documents, diag, qa, ka, chunk), **rows.kwargs(q_parts[qi]))
                rows.fold()
                o = o.to(acc_dtype)
                acc[qi] = (o, lse) if acc[qi] is None else merge_attention(acc[qi][0], acc[qi][1], o, lse)
            exchange.events.append(("computed", time.perf_counter()))
            if pending is not None:
                k_cur, v_cur = exchange.finish(pending)
        out, lse = assemble_output(q, acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.exchange, ctx.ops, ctx.documents = causal, scale, exchange, ops, documents
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        exchange, causal, scale, ops, documents = ctx.exchange, ctx.causal, ctx.scale, ctx.ops, ctx.documents
        size, rank = exchange.size, exchange.rank
        n = 2 if causal else 1
        chunk = q.shape[2] // n
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        delta = ops.delta(out, dout)
        q_parts, o_parts, do_parts = q.chunk(n, 2), out.chunk(n, 2), dout.chunk(n, 2)
        lse_parts, delta_parts = lse.chunk(n, 2), delta.chunk(n, 2)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dq_parts = dq.chunk(n, 2)
        k_cur, v_cur = k, v
        travelling = None  # the dK/dV accumulator of the block computed next, on its way here
        for i in range(size):
            src = (rank - i) % size
            pending = exchange.start([k_cur, v_cur]) if i < size - 1 else None
            k_parts, v_parts = k_cur.chunk(n, 2), v_cur.chunk(n, 2)
            # This step's contribution to the visiting block's dK/dV goes into fresh buffers, so
            # the accumulator sent by the previous rank can still be in flight meanwhile.
            dk_blk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
            dv_blk = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
            dk_parts, dv_parts = dk_blk.chunk(n, 2), dv_blk.chunk(n, 2)
            exchange.events.append(("bwd compute", time.perf_counter()))
            for qi, qa, ki, ka, diag in _pairs(rank, src, size, causal):
                dq_p, dk_p, dv_p = ops.backward(
                    q_parts[qi], k_parts[ki], v_parts[ki], o_parts[qi], do_parts[qi], lse_parts[qi],
                    scale=scale, delta=delta_parts[qi], **block_kwargs(documents, diag, qa, ka, chunk))
                dq_parts[qi].add_(dq_p.to(acc_dtype))
                dk_parts[ki].add_(dk_p.to(acc_dtype))
                dv_parts[ki].add_(dv_p.to(acc_dtype))
            exchange.events.append(("bwd computed", time.perf_counter()))
            if travelling is not None:  # the block's accumulator from the ranks it visited before
                dk_in, dv_in = exchange.finish(travelling)
                dk_blk.add_(dk_in)
                dv_blk.add_(dv_in)
            # The block's gradients travel on with it; after C hops they are home. The transfer
            # overlaps the next step's compute (double buffering: waited for only after it).
            exchange.events.append(("dkv posted", time.perf_counter()))
            travelling = exchange.start([dk_blk, dv_blk])
            if pending is not None:
                k_cur, v_cur = exchange.finish(pending)
        dk_acc, dv_acc = exchange.finish(travelling)
        return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), None, None, None, None, None, None, None


def ring_attention(q, k, v, group, causal: bool = True, scale: float | None = None,
                   exchange: RingExchange | None = None, backend: str = "auto",
                   documents: Documents | None = None, logit_max: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence's keys and values.

    q: (b, heads, s_local, d); k: (b, groups, s_local, d); v: (b, groups, s_local, d_v) (the value
    head size may differ; the output has it), in the layout of
    :func:`megalite.context_parallel.data.context_parallel_slice`. ``backend``: auto, triton,
    flash or torch (the block functions, see the module docstring). ``documents``: packed
    documents of the whole sequence (b, s), absolute positions, causal only. No dropout.
    ``logit_max``: (heads,) float32, raised to each head's largest visible logit of this
    rank's queries (:class:`BlockRowMax`; the max over CP ranks is QK-clip's, after the step)."""
    ops = block_ops(backend, q, documents is not None)
    exchange = exchange or RingExchange(group)
    return _RingAttention.apply(q, k, v, group, causal, scale, exchange, ops, documents, logit_max)
