"""Autograd-aware collectives for tensor and sequence parallelism: the conjugate pairs.

Activations are sequence-first, ``(s, b, h)``, so "the sequence dim" is dim 0 and an
all-gather / reduce-scatter along it works on contiguous memory.

| function                  | forward          | backward         |
|---------------------------|------------------|------------------|
| copy_to_tp                | identity         | all-reduce       |
| reduce_from_tp            | all-reduce       | identity         |
| scatter_to_tp   (last)    | split            | all-gather       |
| gather_from_tp  (last)    | all-gather       | split            |
| gather_from_sp  (seq)     | all-gather       | reduce-scatter   |
| reduce_scatter_to_sp (seq)| reduce-scatter   | all-gather       |
| scatter_to_sp   (seq)     | split            | all-gather       |
| all_to_all_swap (a, b)    | all-to-all a->b  | all-to-all b->a  |

Why conjugates: if ``y = f(x)`` replicates ``x`` onto every rank, each rank's ``dL/dy``
is only its own contribution, so ``dL/dx`` is their sum (all-reduce). If ``y`` is the sum
of per-rank partials, every partial sees the whole ``dL/dy`` (identity). Splitting and
gathering are each other's transpose, and reduce-scatter is the transpose of all-gather.

Every collective goes through :func:`_record`, which counts the bytes handed to it, so
benchmarks can compare traffic with theory (DESIGN.md section 5). "Bytes" is the size of
the full (unsharded) tensor the collective works on: the all-reduce input, the
all-gather output, the reduce-scatter input.

Blocked time (straggler reports, :mod:`megalite.resilience.straggler`): while a timer is
installed (:func:`time_blocked`), the synchronous collectives here run inside
:func:`blocked`, the async ones return handles whose ``wait()`` does, and the p2p waits
elsewhere use ``with comm.blocked(): work.wait()``. With no timer installed ``blocked()`` is a
shared no-op context and the handles are torch's own: nothing is timed or allocated.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist

from megalite.observe.memory_tracker import category

# -- traffic accounting --------------------------------------------------------------------------

class CollectiveStats(defaultdict):
    """``{kind: {calls, bytes}}``, and ``by_group``: ``{group: bytes}`` (None: the world)."""

    def __init__(self):
        super().__init__(lambda: {"calls": 0, "bytes": 0})
        self.by_group: dict = defaultdict(int)


_STATS: CollectiveStats | None = None


@contextlib.contextmanager
def count_collectives():
    """Count calls and bytes per collective kind (and per group) inside the block."""
    global _STATS
    previous, _STATS = _STATS, CollectiveStats()
    try:
        yield _STATS
    finally:
        _STATS = previous


# The collective most recently started by this rank: (kind, group), for hang reports.
LAST_COLLECTIVE: tuple[str, object] | None = None


# The dry run's device check: (id of the fake default group, this rank's device), or None.
_EXPECTED_DEVICE: tuple[int, torch.device] | None = None


def expect_device(device: torch.device | None) -> None:
    """From now on, while the current default process group lives, every tensor handed to a
    collective must be on ``device`` (None: no check). The fake process group of a dry run
    accepts a tensor on any device, and torch lets a 0-dim CPU tensor meet a meta one, so
    without this a CPU tensor handed to an all-reduce would pass the placement oracle."""
    global _EXPECTED_DEVICE
    _EXPECTED_DEVICE = None if device is None or not dist.is_initialized() else (
        id(dist.group.WORLD), torch.device(device))


def _check_device(kind: str, tensor: torch.Tensor, group) -> None:
    world, device = _EXPECTED_DEVICE
    if not dist.is_initialized() or id(dist.group.WORLD) != world or dist.get_backend() != "fake":
        return  # another world than the (fake) one the check was set for
    if tensor.device != device:
        raise RuntimeError(f"{kind} handed a tensor on device {tensor.device} {tuple(tensor.shape)}, not on the "
                           f"expected device {device} (this rank's): every tensor a collective meets must be "
                           f"made on the device of the tensors it meets.")


def _record(kind: str, tensor: torch.Tensor, full_numel: int | None = None, group=None) -> None:
    global LAST_COLLECTIVE
    LAST_COLLECTIVE = (kind, group)
    if _EXPECTED_DEVICE is not None:
        _check_device(kind, tensor, group)
    if _STATS is not None:
        entry = _STATS[kind]
        size = (full_numel if full_numel is not None else tensor.numel()) * tensor.element_size()
        entry["calls"] += 1
        entry["bytes"] += size
        _STATS.by_group[group] += size


class OfflineGroup:
    """Stands for a process group when building a rank's model shard without a world
    (checkpoint resharding): it answers size and rank; any collective on it is an error."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def group_size(group) -> int:
    if group is None:
        return 1
    return group.size if isinstance(group, OfflineGroup) else dist.get_world_size(group)


def group_rank(group) -> int:
    if group is None:
        return 0
    return group.rank if isinstance(group, OfflineGroup) else dist.get_rank(group)


# -- blocked time, for straggler reports -----------------------------------------------------------

_NOT_TIMED = contextlib.nullcontext()
# The installed timer: a reusable context manager that adds the time spent inside it to the
# current step's blocked time (megalite.resilience.straggler.BlockedTimer), or None.
_BLOCKED = None


def time_blocked(timer):
    """Install ``timer`` (None: uninstall) as the process's blocked-time accumulator; returns
    the previous one."""
    global _BLOCKED
    previous, _BLOCKED = _BLOCKED, timer
    return previous


def blocked():
    """``with comm.blocked(): work.wait()``: the block counts as time this rank waited for its
    peers (and the wire), not as compute. A no-op while no timer is installed."""
    return _NOT_TIMED if _BLOCKED is None else _BLOCKED


class _TimedWork:
    """A collective's work handle whose ``wait()`` counts as blocked time; everything else
    (``is_completed``, ...) is the handle's own."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        with blocked():
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def _handle(work):
    return work if _BLOCKED is None or work is None else _TimedWork(work)


# -- plain (non-autograd) collectives, counted ----------------------------------------------------

# torch 2.13 renamed the flat all-gather / reduce-scatter; older releases (2.11 on our GPU
# machine) only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce (counted); returns ``x``."""
    if group_size(group) > 1:
        _record("all_reduce", x, group=group)
        with blocked():
            dist.all_reduce(x, op=op, group=group)
    return x


def all_reduce_async(x: torch.Tensor, group):
    """Start an in-place sum all-reduce (counted); returns the work handle."""
    _record("all_reduce", x, group=group)
    return _handle(dist.all_reduce(x, group=group, async_op=True))


def reduce_scatter_async(out: torch.Tensor, x: torch.Tensor, group):
    """Start a sum reduce-scatter of flat ``x`` into ``out`` (rank r gets chunk r)."""
    _record("reduce_scatter", x, group=group)
    return _handle(_reduce_scatter_flat(out, x, group=group, async_op=True))


def all_gather_async(out: torch.Tensor, x: torch.Tensor, group):
    """Start an all-gather of flat ``x`` into ``out`` (rank order)."""
    _record("all_gather", x, out.numel(), group=group)
    return _handle(_all_gather_flat(out, x, group=group, async_op=True))


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (rank order)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    with category("communication"):
        out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _record("all_gather", x, out.numel(), group=group)
    with blocked():
        _all_gather_flat(out, x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, then rank r keeps chunk r of dim 0."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[0] % world != 0:
        raise ValueError(f"reduce-scatter along dim 0 of size {x.shape[0]} over {world} ranks: "
                         f"size must be divisible by the group size")
    x = x.contiguous()
    with category("communication"):
        out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _record("reduce_scatter", x, group=group)
    with blocked():
        _reduce_scatter_flat(out, x, group=group)
    return out


def all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim (rank order)."""
    world = group_size(group)
    if world == 1:
        return x
    # (..., n) -> (n, ...) -> gathered (world * n, ...) in rank order -> (..., world * n)
    return all_gather_dim0(x.movedim(-1, 0), group).movedim(0, -1)


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim``."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world != 0:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {world} ranks evenly")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def all_to_all_dims(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split ``x`` into ``world`` equal parts along ``scatter_dim``, send part j to rank j, and
    concatenate what arrives along ``gather_dim`` in rank order (one ``all_to_all_single``).
    Context parallelism's Ulysses step: sequence-sharded heads in, head-sharded sequence out."""
    world = group_size(group)
    if world == 1:
        return x
    n = x.shape[scatter_dim]
    if n % world != 0:
        raise ValueError(f"all-to-all over {world} ranks splits dim {scatter_dim} of size {n}: "
                         f"size must be divisible by the group size")
    # (..., n, ...) -> (world, ..., n / world, ...): part j first, contiguous for the collective.
    send = x.unflatten(scatter_dim, (world, n // world)).movedim(scatter_dim, 0).contiguous()
    with category("communication"):
        received = torch.empty_like(send)
    _record("all_to_all", send, group=group)
    with blocked():
        dist.all_to_all_single(received, send, group=group)
    # received[j] came from rank j: put the rank index just before gather_dim and merge the two.
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


# -- autograd functions ---------------------------------------------------------------------------

def _identity(x, group):
    return x


def _all_reduce_copy(x, group):
    return all_reduce(x.contiguous().clone(), group)


def _split_last(x, group):
    return split_dim(x, -1, group)


def _split_seq(x, group):
    return split_dim(x, 0, group)


class _ConjugatePair(torch.autograd.Function):
    """y = forward_op(x); dL/dx = backward_op(dL/dy): one row of the table above."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group), None, None, None


def _pair(x, group, forward_op, backward_op):
    if group_size(group) == 1:
        return x
    return _ConjugatePair.apply(x, group, forward_op, backward_op)


class _AllToAllSwap(torch.autograd.Function):
    """y = all_to_all_dims(x, a, b); dL/dx = all_to_all_dims(dL/dy, b, a): the all-to-all that
    scatters a and gathers b is a permutation of the ranks' data, and its transpose (the
    gradient) is the all-to-all the other way."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all_dims(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all_dims(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all_swap(x, scatter_dim: int, gather_dim: int, group):
    """Autograd all-to-all: fwd scatters ``scatter_dim`` and gathers ``gather_dim``; bwd the
    reverse. Dims are counted from the front (non-negative)."""
    if group_size(group) == 1:
        return x
    return _AllToAllSwap.apply(x, scatter_dim, gather_dim, group)


def copy_to_tp(x, group):
    """Enter a TP region with a replicated input. fwd: identity; bwd: all-reduce."""
    return _pair(x, group, _identity, _all_reduce_copy)


def reduce_from_tp(x, group):
    """Leave a TP region by summing partial results. fwd: all-reduce; bwd: identity."""
    return _pair(x, group, _all_reduce_copy, _identity)


def scatter_to_tp(x, group):
    """Keep this rank's slice of the last dim. fwd: split; bwd: all-gather."""
    return _pair(x, group, _split_last, all_gather_last)


def gather_from_tp(x, group):
    """Concatenate the ranks' slices of the last dim. fwd: all-gather; bwd: split."""
    return _pair(x, group, all_gather_last, _split_last)


def gather_from_sp(x, group):
    """Sequence shards -> full sequence, to feed a column-parallel layer.
    fwd: all-gather (seq); bwd: reduce-scatter (seq), since each rank's gradient is partial."""
    return _pair(x, group, all_gather_dim0, reduce_scatter_dim0)


def reduce_scatter_to_sp(x, group):
    """Partial sums of the full sequence -> this rank's reduced sequence shard.
    fwd: reduce-scatter (seq); bwd: all-gather (seq)."""
    return _pair(x, group, reduce_scatter_dim0, all_gather_dim0)


def scatter_to_sp(x, group):
    """A replicated full sequence -> this rank's shard. fwd: split (seq); bwd: all-gather."""
    return _pair(x, group, _split_seq, all_gather_dim0)
