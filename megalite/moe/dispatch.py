"""Token dispatch: sort assignments by expert, run the experts, unsort and combine.

Serial (one rank holds all E experts), for tokens ``x`` (T, h) and the router's
``ids, weights, kept`` (T, k)::

    keys      = ids where kept, else E          (dropped assignments sort last, then cut)
    order     = stable argsort(keys)[:N]        N = number of kept assignments
    token     = order // k                      which token each sorted row comes from
    x_sorted  = x[token]                        (N, h), grouped by expert, token order within
    y_sorted  = grouped_mlp(x_sorted, counts)   counts[e] rows per expert
    out       = sum over rows: out[token] += w_sorted * y_sorted      (index_add; sum over k)

Expert parallel over a group of P ranks: rank p holds experts ``[p*E/P, (p+1)*E/P)``. After the
local sort (by *global* expert id) the rows for rank p are contiguous, and inside them grouped
by local expert. Then

1. ``all_to_all`` of the per-expert counts (E ints out, E ints in, equal splits of E/P): rank p
   learns ``recv[q, e]``, how many rows rank q sends for each of its local experts. Integers,
   no gradient. The split sizes must be host ints for ``all_to_all_single``: counts and recv
   are read together, the one device->host sync of the layer (Megatron does the same for
   dropless EP); with capacity dropping the number of kept rows N comes from the same read.
2. ``all_to_all`` of the rows with split sizes: send ``sum_e counts[p-shard]`` rows to each p,
   receive ``sum_e recv[q, :]`` from each q. Autograd-aware (:class:`_AllToAll`): the gradient
   of a row goes back to where the row came from, i.e. **backward is the reverse all-to-all
   with input and output split sizes swapped** -- the conjugate (the all-to-all with given
   splits is a permutation of rows across ranks; the transpose of a permutation is its inverse).
3. The received rows are ordered (source rank, local expert); a local permutation reorders them
   to (local expert, source rank) for the grouped matmul, and its inverse restores the order
   (:func:`expert_major_permutation`: built on the device from the recv counts, no host loop).
4. ``all_to_all`` back (forward: splits swapped; backward: the original splits), then combine
   exactly as in the serial case, on the rank that owns the tokens.

Because each rank sorts stably in token order and the receiver groups by (expert, source rank),
expert e sees the global batch's rows in global token order, as in the serial layer over the
concatenated batch.

**Host syncs** (device->host reads) per MoE layer; backward never reads anything (its
all-to-alls reuse the forward's split sizes, the grouped GEMM its offsets):

=========================================  =======  ========
case                                       forward  backward
=========================================  =======  ========
EP = 1, dropless, ``--moe-grouped-gemm``   0        0        (counts stay on the device)
EP = 1, dropless, torch loop of experts    1        0        (the loop slices by host counts)
EP = 1, capacity dropping                  1        0        (N and the counts in one read)
EP > 1, any of the above                   1        0        (counts, recv, N in one read)
=========================================  =======  ========

(tests/test_moe_gpu_faults.py counts them. A layer recomputed under activation checkpointing
runs its forward again inside backward, sync included.)

Every tensor is made on the input's device. **Without routing data** -- on meta tensors (no
values) or under the fake process group (its collectives move nothing: ``recv`` would hold
whatever its memory held, on a GPU garbage used as split sizes) -- the split sizes fall back to
perfectly balanced routing, with no sync: every rank sends ``T*k`` rows (all of them, dropped
ones too, with weight 0), ``T*k/E`` per expert. A dry run then measures the memory and traffic
of balanced routing, the same on meta and on a real device.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megalite.device import is_fake
from megalite.moe.router import expert_counts
from megalite.parallel import comm

# experts(x_sorted, counts): counts are host ints, or an (E_local,) integer tensor on x's device
ExpertsFn = Callable[[torch.Tensor, "list[int] | torch.Tensor"], torch.Tensor]


# -- host split sizes -------------------------------------------------------------------------------

def _balanced(total: int, parts: int) -> list[int]:
    base, rem = divmod(total, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def host_ints(t: torch.Tensor, balanced_total: int) -> list[int]:
    """``t.tolist()`` (one device->host sync); on meta, a balanced split of ``balanced_total``."""
    if t.device.type == "meta":
        return _balanced(balanced_total, t.numel())
    return [int(v) for v in t.reshape(-1).tolist()]


def no_routing_data(x: torch.Tensor) -> bool:
    """Meta tensors, or the fake process group (its collectives write nothing): the counts a
    collective would bring are unknown, so split sizes assume balanced routing."""
    return x.device.type == "meta" or is_fake()


# -- the autograd-aware all-to-all ------------------------------------------------------------------

def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Plain (counted) all-to-all of rows: ``input_splits[q]`` rows of ``x`` go to rank q,
    ``output_splits[q]`` rows arrive from rank q (rank order)."""
    x = x.contiguous()
    shape = (sum(output_splits),) + tuple(x.shape[1:])
    # the fake group writes nothing: zeros, not garbage, reach the experts of a dry run
    out = x.new_zeros(shape) if is_fake() else x.new_empty(shape)
    comm._record("all_to_all", x, group=group)
    with comm.blocked():
        dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """fwd: all-to-all with (output_splits, input_splits); bwd: the reverse, splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x, output_splits, input_splits, group):
    if comm.group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


# -- sort / combine ---------------------------------------------------------------------------------

def expert_order(expert_ids, kept, num_experts):
    """``(order (T*k,), counts (E,))`` without a sync: the assignments stably sorted by expert
    (token order within an expert; dropped ones last), and the kept assignments per expert."""
    counts = expert_counts(expert_ids, num_experts, kept)
    keys = expert_ids if kept is None else torch.where(kept, expert_ids, torch.full_like(expert_ids, num_experts))
    return torch.argsort(keys.reshape(-1), stable=True), counts


def gather_sorted(x, weights, order, n, k):
    """The first ``n`` sorted assignments: ``(x_sorted (n, h), token (n,), w_sorted (n,))``."""
    order = order[:n]
    token = torch.div(order, k, rounding_mode="floor")
    return x.index_select(0, token), token, weights.reshape(-1).index_select(0, order)


def combine(y_sorted, token, w_sorted, num_tokens):
    """``out[t] = sum over t's kept assignments of w * y`` (the sum over k)."""
    out = y_sorted.new_zeros((num_tokens, y_sorted.shape[1]))
    return out.index_add(0, token, y_sorted * w_sorted.to(y_sorted.dtype)[:, None])


# -- the two paths ----------------------------------------------------------------------------------

def dispatch_serial(x, expert_ids, weights, kept, experts: ExpertsFn, num_experts: int) -> torch.Tensor:
    """All experts local: sort, grouped experts, combine. Dropless, the counts stay on the
    device (the experts decide whether they need them on the host); with capacity dropping,
    the number of kept rows is read with the counts, one sync."""
    T, k = expert_ids.shape
    order, counts = expert_order(expert_ids, kept, num_experts)
    if kept is None:
        n, group_counts = T * k, counts
    else:
        group_counts = host_ints(counts, T * k)  # the one sync; on meta: all T*k, balanced
        n = sum(group_counts)
    x_sorted, token, w_sorted = gather_sorted(x, weights, order, n, k)
    y_sorted = experts(x_sorted, group_counts)
    return combine(y_sorted, token, w_sorted, T)


def expert_major_permutation(counts: torch.Tensor, P: int, E_local: int, n: int):
    """``(perm, position)`` for ``n`` received rows in (source rank q, local expert e) blocks of
    ``counts[q * E_local + e]`` rows (a device tensor; ``n`` its sum, a host int): ``x[perm]``
    is in (e, q) order, and received row i lands at ``position[i]`` (so ``y[position]`` is back
    in received order; ``position[perm] = arange(n)``). With ``c`` the (P, E_local) matrix::

        src[q, e] = exclusive prefix sum of c, row-major (q, e)     where block (q, e) starts
        dst[q, e] = exclusive prefix sum of c^T, row-major (e, q)   where it goes
        position[i] = i - src[block(i)] + dst[block(i)]

    Vectorised on the device; ``repeat_interleave`` is told its output size, so no sync."""
    c = counts.reshape(P, E_local)
    flat = c.reshape(-1)
    src = torch.cumsum(flat, 0) - flat
    by_expert = c.t().reshape(-1)
    dst = (torch.cumsum(by_expert, 0) - by_expert).reshape(E_local, P).t().reshape(-1)
    block = torch.repeat_interleave(torch.arange(P * E_local, device=counts.device), flat, output_size=n)
    rows = torch.arange(n, device=counts.device)
    position = rows - src[block] + dst[block]
    perm = torch.empty_like(position).scatter_(0, position, rows)
    return perm, position


def dispatch_ep(x, expert_ids, weights, kept, experts: ExpertsFn, num_experts: int, group) -> torch.Tensor:
    """Experts split over the EP ``group`` (``experts`` computes this rank's E/P experts)."""
    P = comm.group_size(group)
    E_local = num_experts // P
    T, k = expert_ids.shape
    order, counts = expert_order(expert_ids, kept, num_experts)

    # 1. counts: recv[q * E_local + e] = rows rank q sends to my local expert e.
    recv = torch.empty_like(counts)
    comm._record("all_to_all", counts, group=group)
    with comm.blocked():
        dist.all_to_all_single(recv, counts, group=group)
    if no_routing_data(x):  # balanced routing on every rank, all T*k rows (module docstring)
        n = T * k
        send_counts = _balanced(n, num_experts)
        mine = send_counts[comm.group_rank(group) * E_local:][:E_local]
        recv_counts = mine * P  # every rank sends what this one does
        recv = torch.tensor(recv_counts, dtype=counts.dtype, device=counts.device)
    else:
        both = host_ints(torch.cat([counts, recv]), 0)  # the one sync of the layer
        send_counts, recv_counts = both[:num_experts], both[num_experts:]
        n = T * k if kept is None else sum(send_counts)
    send_splits = [sum(send_counts[p * E_local:(p + 1) * E_local]) for p in range(P)]
    recv_splits = [sum(recv_counts[q * E_local:(q + 1) * E_local]) for q in range(P)]
    x_sorted, token, w_sorted = gather_sorted(x, weights, order, n, k)

    # Each buffer is dropped as soon as the next one exists (none is saved for backward: the
    # all-to-alls and index_selects keep only split sizes and indices), so at most two of the
    # N x h row buffers are alive at once.
    # 2. rows to the experts' owners
    x_recv = all_to_all(x_sorted, recv_splits, send_splits, group)
    del x_sorted

    # 3. local experts, rows grouped by (local expert, source rank)
    perm, position = expert_major_permutation(recv, P, E_local, sum(recv_splits))
    local_counts = [sum(recv_counts[q * E_local + e] for q in range(P)) for e in range(E_local)]
    x_local = x_recv.index_select(0, perm)
    del x_recv
    y_local = experts(x_local, local_counts)
    del x_local
    y_recv = y_local.index_select(0, position)
    del y_local

    # 4. rows back to the tokens' owners, combine
    y_sorted = all_to_all(y_recv, send_splits, recv_splits, group)
    del y_recv
    return combine(y_sorted, token, w_sorted, T)
