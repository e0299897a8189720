"""Gradient buckets: contiguous buffers whose reduction over DP overlaps backward.

Parameters are laid out, in reverse order of registration (roughly the order backward
produces their gradients), in flat buckets of about ``bucket_size`` elements, each padded
to a multiple of the data-parallel size N so it splits into N equal shards. Rank r owns
shard r of every bucket (``Bucket.shard``); with ZeRO stage 0 it owns all of it.

A hook on every parameter (``register_post_accumulate_grad_hook``) moves the fresh
``param.grad`` into the bucket and frees it. When every parameter of a bucket is ready,
the bucket's collective starts asynchronously (``overlap=True``) while backward goes on:

- stage 0 (DDP), accumulation in a persistent full buffer; on the last micro-batch only,
  an **all-reduce** (sum) of the bucket; the conjugate of nothing (data parallelism has no
  forward communication). Gradients = sum / N.
- stage 1, same buffer; a **reduce-scatter** on the last micro-batch: rank r receives the
  summed shard r (the rest of its buffer is not used by its optimizer).
- stages 2 and 3: only the reduced shard persists. Each micro-batch's gradients are staged
  in a temporary bucket buffer and **reduce-scattered** into the persistent shard as soon
  as the bucket is complete, then the staging buffer is dropped (ZeRO-2's trade: less
  memory, one reduce-scatter per micro-batch).

Expert parameters (mixture of experts, ``param.expert_parallel``) live on fewer ranks: their
buckets are reduced over the expert-data-parallel group instead (the ranks holding the same
experts), with the same divisor as the dense buckets, DP x CP, not the group's size: an
expert's gradient on its owner already sums the tokens of its whole expert-parallel group
(see :mod:`megalite.moe.layer`). A bucket never mixes the two kinds.

Buckets start strictly in index order, so every rank issues the same collectives in the
same order even when readiness differs. Parameters that got no gradient in a step (unused
on this rank) simply contribute zeros: ``finish()`` starts any bucket that never became
ready, so nothing hangs and the average stays the mean over all ranks' gradients.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from megalite.device import is_fake
from megalite.observe.memory_tracker import category
from megalite.parallel import comm
from megalite.parallel.sharding import is_expert


def _finished(work) -> bool:
    return work.is_completed()


@dataclass
class Bucket:
    index: int
    params: list
    offsets: list  # (start, numel) of each parameter inside the flat bucket
    numel: int  # padded to a multiple of the DP size
    shard: tuple[int, int]  # this rank's [lo, hi) of the bucket
    grad: torch.Tensor | None = None  # stage 0/1: full accumulation buffer
    grad_shard: torch.Tensor | None = None  # stage 2/3: the persistent reduced shard
    staging: dict = field(default_factory=dict)  # stage 2/3: micro-batch -> local gradients
    pending: list = field(default_factory=list)  # (work, output, target) of in-flight ops
    group: object = None  # the process group reducing this bucket (None: one rank)
    size: int = 1  # that group's size (the bucket splits into this many shards)
    divisor: int = 1  # the reduced sum is divided by this (DP x CP for every bucket)
    expert: bool = False  # an expert-parameter bucket (reduced over expert-data-parallel ranks)


def group_by_size(params: list, bucket_size: int, isolate=lambda p: False) -> list[list]:
    """Consecutive parameters in groups of about ``bucket_size`` elements. Parameters for
    which ``isolate(p)`` is true get a group of their own (a tied embedding must have the
    same shard layout on the first and last pipeline stage)."""
    groups, current, size = [], [], 0
    for p in params:
        if isolate(p):
            groups.append([p])
            continue
        current.append(p)
        size += p.numel()
        if size >= bucket_size:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def split_by_domain(groups: list[list]) -> list[list]:
    """Cut each group where it switches between dense and expert parameters."""
    out = []
    for group in groups:
        current = []
        for p in group:
            if current and is_expert(p) != is_expert(current[-1]):
                out.append(current)
                current = []
            current.append(p)
        if current:
            out.append(current)
    return out


def build_buckets(groups: list[list], dp_size: int, dp_rank: int, stage: int,
                  expert_size: int = 1, expert_rank: int = 0) -> list[Bucket]:
    """One flat bucket per group, padded to a multiple of its group's size (the DP size, or
    the expert-data-parallel size for a group of expert parameters)."""
    buckets = []
    for i, group in enumerate(groups):
        expert = is_expert(group[0])
        size, rank = (expert_size, expert_rank) if expert else (dp_size, dp_rank)
        offsets, start = [], 0
        for p in group:
            offsets.append((start, p.numel()))
            start += p.numel()
        numel = -(-start // size) * size
        per = numel // size
        shard = (0, numel) if stage == 0 else (rank * per, (rank + 1) * per)
        buckets.append(Bucket(i, group, offsets, numel, shard, size=size, expert=expert))
    return buckets


class GradSync:
    """Owns the gradient buckets of one model replica and their reduction over DP.

    Reductions are started in one fixed order on every rank: bucket 0, 1, ... on the last
    micro-batch (stages 0/1), or for each micro-batch j in turn, bucket 0, 1, ... (stages
    2/3). A reduction starts as soon as it is next in that order and its bucket holds the
    gradients of every parameter for that micro-batch.
    """

    def __init__(self, groups: list[list], *, stage: int, group, overlap: bool, grad_dtype: torch.dtype,
                 expert_group=None):
        """``group``: the data-parallel (x CP) group; ``expert_group``: the expert-data-parallel
        group, for buckets of expert parameters."""
        self.stage, self.group, self.overlap, self.grad_dtype = stage, group, overlap, grad_dtype
        self.dp = comm.group_size(group)
        groups = split_by_domain(groups)
        self.buckets = build_buckets(groups, self.dp, comm.group_rank(group), stage,
                                     comm.group_size(expert_group), comm.group_rank(expert_group))
        for b in self.buckets:
            b.group = expert_group if b.expert else group
            b.divisor = self.dp
        params = [p for g in groups for p in g]
        self.device = params[0].device  # every buffer lives where the model's gradients do
        self._where = {}
        for b in self.buckets:
            if stage <= 1:
                b.grad = self._zeros(b.numel)
            else:
                b.grad_shard = self._zeros(b.shard[1] - b.shard[0])
            for p, (start, numel) in zip(b.params, b.offsets):
                self._where[p] = (b, start, numel)
        self._counts: dict = {}
        self.num_micro = 1
        self._order: list[tuple[int, int]] = []
        self._next = 0
        # (bucket, micro-batch, started from a backward hook, gradients arrived so far this step)
        self.launch_log: list[tuple[int, int, bool, int]] = []
        self._arrived = 0
        # Autograd holds the hooks for the parameters' lifetime; each holds this object only weakly,
        # so an error between building and training (remove_hooks never called) still frees it, and
        # with it the groups, before the interpreter shuts down (issue 42: a finished run's abort).
        # Once it is gone, a backward leaves param.grad as plain autograd accumulates it.
        on_grad = weakref.WeakMethod(self._on_grad)

        def hook(param) -> None:
            method = on_grad()
            if method is not None:
                method(param)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]

    def _zeros(self, numel: int) -> torch.Tensor:
        with category("gradients"):
            return torch.zeros(numel, dtype=self.grad_dtype, device=self.device)

    # -- per step ---------------------------------------------------------------------------------
    def start_step(self, num_micro: int, order: list | None = None) -> None:
        """Zero the buffers; the step will run ``num_micro`` micro-batches. ``order``: the
        (bucket, micro-batch) reductions of stages 2/3 with overlap in another order than
        micro-batch by micro-batch (a zero-bubble schedule's, see DistributedOptimizer); it
        must be the same on every rank of the group."""
        self.num_micro = num_micro
        self._counts = {p: 0 for p in self._where}
        self.launch_log = []
        self._arrived = 0
        n = len(self.buckets)
        # Stages 0/1, and 2/3 without overlap: one reduction per bucket after the last micro-batch
        # (2/3 then sum the micro-batches in one staging buffer: holding one per micro-batch
        # until the end would cost M full gradients). Stages 2/3 with overlap: one per micro-batch.
        self._order = [(i, num_micro - 1) for i in range(n)] if self.stage <= 1 or not self.overlap else \
            list(order) if order is not None else [(i, j) for j in range(num_micro) for i in range(n)]
        self._next = 0
        for b in self.buckets:
            b.staging = {}
            (b.grad if b.grad is not None else b.grad_shard).zero_()

    def _on_grad(self, param) -> None:
        if param.grad is None:
            # No new gradient: a zero-bubble B deferred this weight's to its W (autograd still
            # visits the AccumulateGrad node, with an undefined gradient, and runs the hook).
            return
        bucket, start, numel = self._where[param]
        g = param.grad.detach().reshape(-1)
        if self.stage <= 1:
            bucket.grad[start: start + numel].add_(g)
        else:
            micro = min(self._counts[param], self.num_micro - 1) if self.overlap else 0
            if micro not in bucket.staging:
                bucket.staging[micro] = self._zeros(bucket.numel)
            bucket.staging[micro][start: start + numel].add_(g)
        param.grad = None  # moved into the bucket
        self._counts[param] += 1
        self._arrived += 1
        if self.overlap:
            self._launch_ready(from_hook=True)

    def _ready(self, i: int, micro: int) -> bool:
        return all(self._counts[p] > micro for p in self.buckets[i].params)

    def _launch_ready(self, from_hook: bool = False, force: bool = False) -> None:
        while self._next < len(self._order):
            i, micro = self._order[self._next]
            if not (force or self._ready(i, micro)):
                return
            self._launch(self.buckets[i], micro, from_hook)
            self._next += 1

    def _launch(self, b: Bucket, micro: int, from_hook: bool) -> None:
        self.launch_log.append((b.index, micro, from_hook, self._arrived))
        if self.stage <= 1:
            source = b.grad
        else:  # a parameter without gradient in this micro-batch contributes zeros
            source = b.staging.pop(micro if self.overlap else 0, None)
            if source is None:
                source = self._zeros(b.numel)
        if b.size == 1:
            if self.stage >= 2:
                b.grad_shard.add_(source)
            return
        if self.stage == 0:
            b.pending.append((comm.all_reduce_async(source, b.group), None, None))
            return
        if self.stage >= 2:
            # The previous micro-batch's reduction of this bucket finished long ago (a whole
            # micro-batch of compute ran since): fold it in now, so at most one staging buffer
            # per bucket is alive. Keeping them all until finish() holds M full gradients.
            self._complete(b)
        with category("communication"):
            out = torch.empty(b.numel // b.size, dtype=self.grad_dtype, device=self.device)
        target = b.grad[b.shard[0]: b.shard[1]] if self.stage == 1 else b.grad_shard
        b.pending.append((comm.reduce_scatter_async(out, source, b.group), out, target))
        if self.stage >= 2:
            self._fold_finished()

    def finish(self) -> None:
        """Start what has not started (no overlap, or parameters without gradients), wait
        for all of it, and average over DP: ``shard_grad(b)`` then holds the mean gradient."""
        self._launch_ready(force=True)
        for b in self.buckets:
            self._complete(b)
            self.shard_grad(b).div_(b.divisor)

    def _fold_finished(self) -> None:
        """Fold every reduction that has already finished into its shard (a non-blocking check),
        so its output buffer is freed now rather than when the step ends: with all buckets'
        outputs pending, ZeRO-2/3 would hold a second copy of the gradient shard."""
        done = _finished if not is_fake() else lambda work: True  # fake works never report completion
        for b in self.buckets:
            while b.pending and done(b.pending[0][0]):
                work, out, target = b.pending.pop(0)
                work.wait()
                target.add_(out)

    def _complete(self, b: Bucket) -> None:
        """Wait for the bucket's reductions in flight and fold their results into its shard.
        This drops the last reference to their inputs (ZeRO-2/3: a micro-batch's staging
        buffer), so they are freed here, not at the end of the step."""
        for work, out, target in b.pending:
            work.wait()
            if out is not None:
                if self.stage >= 2:
                    target.add_(out)
                else:
                    target.copy_(out)
        b.pending.clear()

    def shard_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced gradient shard of bucket ``b`` (a view)."""
        return b.grad[b.shard[0]: b.shard[1]] if self.stage <= 1 else b.grad_shard

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
