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
   no gradient. The split sizes must be host ints for ``all_to_all_single``: this is the one
   device->host sync of the layer (Megatron does the same for dropless EP).
2. ``all_to_all`` of the rows with split sizes: send ``sum_e counts[p-shard]`` rows to each p,
   receive ``sum_e recv[q, :]`` from each q. Autograd-aware (:class:`_AllToAll`): the gradient
   of a row goes back to where the row came from, i.e. **backward is the reverse all-to-all
   with input and output split sizes swapped** -- the conjugate (the all-to-all with given
   splits is a permutation of rows across ranks; the transpose of a permutation is its inverse).
3. The received rows are ordered (source rank, local expert); a local permutation reorders them
   to (local expert, source rank) for the grouped matmul, and its inverse restores the order.
4. ``all_to_all`` back (forward: splits swapped; backward: the original splits), then combine
   exactly as in the serial case, on the rank that owns the tokens.

Because each rank sorts stably in token order and the receiver groups by (expert, source rank),
expert e sees the global batch's rows in global token order, as in the serial layer over the
concatenated batch.

Every tensor is made on the input's device. On meta tensors the counts are unknown (routing is
data-dependent), so host split sizes fall back to perfectly balanced routing: the dry run then
measures the memory and traffic of balanced routing.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.moe.router import expert_counts

ExpertsFn = Callable[[torch.Tensor, list], torch.Tensor]


# -- host split sizes -------------------------------------------------------------------------------

def _balanced(total: int, parts: int) -> list[int]:
    base, rem = divmod(total, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def host_ints(t: torch.Tensor, balanced_total: int) -> list[int]:
    """``t.tolist()`` (one device->host sync); on meta, a balanced split of ``balanced_total``."""
    if t.device.type == "meta":
        return _balanced(balanced_total, t.numel())
    return [int(v) for v in t.reshape(-1).tolist()]


# -- the autograd-aware all-to-all ------------------------------------------------------------------

def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Plain (counted) all-to-all of rows: ``input_splits[q]`` rows of ``x`` go to rank q,
    ``output_splits[q]`` rows arrive from rank q (rank order)."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    comm._record("all_to_all", x, group=group)
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

def sort_by_expert(x, expert_ids, weights, kept, num_experts):
    """Kept assignments sorted by expert (stable: token order within an expert).
    ``kept=None`` means dropless (no sync needed to know how many rows there are).
    Returns ``(x_sorted (N, h), token (N,), w_sorted (N,), counts (E,) tensor, N)``."""
    T, k = expert_ids.shape
    counts = expert_counts(expert_ids, num_experts, kept)
    if kept is None:
        keys, n_kept = expert_ids.reshape(-1), T * k
    else:
        keys = torch.where(kept, expert_ids, torch.full_like(expert_ids, num_experts)).reshape(-1)
        n_kept = sum(host_ints(counts, T * k))  # a sync; on meta: all T*k
    order = torch.argsort(keys, stable=True)[:n_kept]
    token = torch.div(order, k, rounding_mode="floor")
    return x.index_select(0, token), token, weights.reshape(-1).index_select(0, order), counts, n_kept


def combine(y_sorted, token, w_sorted, num_tokens):
    """``out[t] = sum over t's kept assignments of w * y`` (the sum over k)."""
    out = y_sorted.new_zeros((num_tokens, y_sorted.shape[1]))
    return out.index_add(0, token, y_sorted * w_sorted.to(y_sorted.dtype)[:, None])


# -- the two paths ----------------------------------------------------------------------------------

def dispatch_serial(x, expert_ids, weights, kept, experts: ExpertsFn, num_experts: int) -> torch.Tensor:
    """All experts local: sort, grouped experts, combine."""
    x_sorted, token, w_sorted, counts, n = sort_by_expert(x, expert_ids, weights, kept, num_experts)
    y_sorted = experts(x_sorted, host_ints(counts, n))
    return combine(y_sorted, token, w_sorted, x.shape[0])


def _rank_to_expert_major(recv: list[int], P: int, E_local: int, device) -> torch.Tensor:
    """Row permutation taking the received order (source rank q, local expert e) to
    (e, q). ``recv`` is the (P x E_local) count matrix, row-major."""
    starts, s = [], 0
    for n in recv:
        starts.append(s)
        s += n
    pieces = [torch.arange(starts[q * E_local + e], starts[q * E_local + e] + recv[q * E_local + e],
                           device=device)
              for e in range(E_local) for q in range(P)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def dispatch_ep(x, expert_ids, weights, kept, experts: ExpertsFn, num_experts: int, group) -> torch.Tensor:
    """Experts split over the EP ``group`` (``experts`` computes this rank's E/P experts)."""
    P = comm.group_size(group)
    E_local = num_experts // P
    T, k = expert_ids.shape
    x_sorted, token, w_sorted, counts, n = sort_by_expert(x, expert_ids, weights, kept, num_experts)

    # 1. counts: recv[q * E_local + e] = rows rank q sends to my local expert e.
    recv = torch.empty_like(counts)
    comm._record("all_to_all", counts, group=group)
    dist.all_to_all_single(recv, counts, group=group)
    both = host_ints(torch.cat([counts, recv]), 2 * T * k)  # one sync; meta: balanced
    send_counts, recv_counts = both[:num_experts], both[num_experts:]
    send_splits = [sum(send_counts[p * E_local:(p + 1) * E_local]) for p in range(P)]
    recv_splits = [sum(recv_counts[q * E_local:(q + 1) * E_local]) for q in range(P)]

    # Each buffer is dropped as soon as the next one exists (none is saved for backward: the
    # all-to-alls and index_selects keep only split sizes and indices), so at most two of the
    # N x h row buffers are alive at once.
    # 2. rows to the experts' owners
    x_recv = all_to_all(x_sorted, recv_splits, send_splits, group)
    del x_sorted

    # 3. local experts, rows grouped by (local expert, source rank)
    perm = _rank_to_expert_major(recv_counts, P, E_local, x.device)
    local_counts = [sum(recv_counts[q * E_local + e] for q in range(P)) for e in range(E_local)]
    x_local = x_recv.index_select(0, perm)
    del x_recv
    y_local = experts(x_local, local_counts)
    del x_local
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    y_recv = y_local.index_select(0, inverse)
    del y_local

    # 4. rows back to the tokens' owners, combine
    y_sorted = all_to_all(y_recv, send_splits, recv_splits, group)
    del y_recv
    return combine(y_sorted, token, w_sorted, T)
