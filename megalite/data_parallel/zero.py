"""The data-parallel optimizer: DDP and ZeRO stages 1-3 as options of one class.

Per rank, for a model of Psi parameters, N data-parallel ranks, mixed precision with Adam
(2-byte weights and gradients, 4-byte master weights and two 4-byte moments):

| stage | weights | gradients   | master + Adam  | total          |
|-------|---------|-------------|----------------|----------------|
| 0     | 2 Psi   | 2 Psi       | 12 Psi         | 16 Psi         |
| 1     | 2 Psi   | 2 Psi       | 12 Psi / N     | 4 Psi + 12 Psi/N |
| 2     | 2 Psi   | 2 Psi / N   | 12 Psi / N     | 2 Psi + 14 Psi/N |
| 3     | 2 Psi/N | 2 Psi / N   | 12 Psi / N     | 16 Psi / N     |

(with ``--accumulate-allreduce-grads-in-fp32`` the gradient columns take 4 bytes.)

The step, on this rank's shard of every bucket (:mod:`megalite.data_parallel.ddp`):
1. gradients reduced over DP (all-reduce for stage 0, reduce-scatter otherwise), then the
   sums that cross other groups: sequence-parallel parameters over TP, the tied embedding
   over the first/last pipeline stage (both linear, so they commute with the DP mean);
2. unscale (fp16 loss scale), global norm over the shards (DP for stages >= 1, then TP x PP,
   each parameter counted once);
3. AdamW on the fp32 master shard (on the CPU with ``offload``), with torch's fused kernel,
   clipping and the inf/NaN skip decided on the device (:mod:`megalite.data_parallel.adamw`);
4. the new weights reach the model: stage 0 copies them, stages 1-2 all-gather the
   shards into every replica, stage 3 keeps only the shard (gathered before use).
"""
from __future__ import annotations

import contextlib

import torch

from megalite.config import TrainConfig
from megalite.data_parallel.ddp import GradSync, group_by_size
from megalite.data_parallel.sharded_params import ShardedParameters
from megalite.data_parallel.update_rule import (DEFAULT_RULE, MASTER_KIND, BucketLayout, ParamPlace, ShardGeometry,
                                                StateLayout, UpdateRule)
from megalite.host_memory import HostBuffer
from megalite.observe.memory_tracker import category
from megalite.pipeline.plan import resolve_schedule
from megalite.pipeline.schedule_kinds import schedule as schedule_kind
from megalite.parallel import comm
from megalite.parallel.sharding import is_expert, is_tensor_parallel, sum_local_tied_copies


def _shard_ranges(bucket, shard, fn) -> list[tuple[int, int]]:
    """[a, z) ranges of the bucket's shard (shard-relative) held by parameters with fn(param)."""
    lo, hi = shard
    ranges = []
    for p, (start, numel) in zip(bucket.params, bucket.offsets):
        a, z = max(start, lo), min(start + numel, hi)
        if a < z and fn(p):
            if ranges and ranges[-1][1] == a - lo:  # adjacent: one range, one operation
                ranges[-1] = (ranges[-1][0], z - lo)
            else:
                ranges.append((a - lo, z - lo))
    return ranges


def host_device(device: torch.device) -> torch.device:
    """Where offloaded optimizer state lives: the CPU (or meta, in a meta dry run)."""
    return torch.device("meta") if device.type == "meta" else torch.device("cpu")


class DistributedOptimizer:
    """An update rule (AdamW unless told otherwise) over DP-sharded fp32 master weights; see the
    module docstring. The rule's state shards are in ``state`` by name, and are attributes too
    (``exp_avg``, ``exp_avg_sq`` for AdamW). A state the rule keeps for some parameters only
    (Muon's ``exp_avg_sq``: not for its matrices) is a compact tensor per shard over its keepers'
    elements (:class:`~megalite.data_parallel.rule_types.StateLayout`, ``state_layout``); read a
    parameter's slice of any kind through :meth:`state_piece`."""

    def __init__(self, chunks, t: TrainConfig, grid, *, stage: int = 0, bucket_size: int = 40_000_000,
                 overlap: bool = True, offload: bool = False, param_dtype: torch.dtype = torch.float32,
                 grad_dtype: torch.dtype | None = None, rule: UpdateRule = DEFAULT_RULE):
        """``chunks``: this rank's model chunks, initialized in fp32 (the master weights are
        taken from them before they are cast to ``param_dtype``)."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        self.t, self.grid, self.stage, self.offload, self.rule = t, grid, stage, offload, rule
        self._orders: dict[int, list] = {}  # zero-bubble ZeRO-2 reduction orders, per M
        self.chunks = list(chunks)
        self.model_dtype = param_dtype
        grad_dtype = grad_dtype or param_dtype
        self.group = grid.dp_cp_group if grid is not None else None
        names = {p: n for c in self.chunks for n, p in c.named_parameters()}
        if stage == 3:  # one bucket per transformer layer (gathered as a unit), then the rest
            groups = []
            for c in reversed(self.chunks):
                layers = [list(layer.parameters()) for layer in reversed(list(c.layers.values()))]
                in_layers = {p for g in layers for p in g}
                groups += layers + [[p for p in reversed(list(c.parameters())) if p not in in_layers]]
        else:  # by size, in reverse order of definition (roughly the order backward produces them)
            tied = lambda p: getattr(p, "tied_embedding", False)  # noqa: E731
            if schedule_kind(t.pipeline_schedule).split_backward:
                # Per chunk (ZBV's two chunks finish a micro-batch at different times), gradients
                # made by B (norms, biases) apart from those made by W: no bucket waits from one
                # micro-batch's B to its W (see layers.weight_grad.mark_deferred).
                groups = []
                for c in reversed(self.chunks):
                    mine = list(reversed(list(c.parameters())))
                    for in_w in (False, True):
                        part = [p for p in mine if getattr(p, "deferred_wgrad", False) == in_w]
                        groups += group_by_size(part, bucket_size, tied)
            else:
                params = [p for c in reversed(self.chunks) for p in reversed(list(c.parameters()))]
                groups = group_by_size(params, bucket_size, isolate=tied)
        groups = [[p for p in g if p.requires_grad] for g in groups]
        groups = [g for g in groups if g]
        params = [p for g in groups for p in g]
        self.expert_group = grid.edp_group if grid is not None else None
        self.sync = GradSync(groups, stage=stage, group=self.group, overlap=overlap, grad_dtype=grad_dtype,
                             expert_group=self.expert_group)
        self.device = params[0].device
        self.state_device = host_device(self.device) if offload else self.device
        pinned = offload and self.device.type == "cuda"
        tp_rank = grid.tp_rank if grid is not None else 0
        self.master = []
        self.places = self._places(names)  # every parameter piece of this rank's shards
        self.state_layout = StateLayout(rule, self.places, [b.shard[1] - b.shard[0] for b in self.sync.buckets])
        self.state: dict[str, list[torch.Tensor]] = {name: [] for name in rule.state_names}
        for name, shards in self.state.items():  # optimizer.exp_avg etc., as before the rule seam
            if hasattr(self, name):
                raise ValueError(f"update rule {rule.name}: state name {name!r} is taken by the optimizer")
            setattr(self, name, shards)
        # Which elements of each shard are decayed, counted in the norm, or sequence-parallel:
        # index ranges (no per-element masks: those would cost 4 bytes per parameter each).
        self.decay_ranges, self.norm_ranges, self.sp_ranges = [], [], []
        self._host_grad, self._host_weight = [], []  # offload: pinned staging buffers
        self._host_staging = HostBuffer()  # offload: the one allocation they are views of
        for i, b in enumerate(self.sync.buckets):
            lo, hi = b.shard  # the fp32 master shard, straight from the (still fp32) weights
            master = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
            for p, (start, numel) in zip(b.params, b.offsets):
                a, z = max(start, lo), min(start + numel, hi)
                if a < z:
                    master[a - lo: z - lo] = p.detach().reshape(-1)[a - start: z - start]
            self.master.append(master.to(self.state_device))
            for name, shards in self.state.items():  # hi - lo elements, or its keepers' (StateLayout)
                shards.append(torch.zeros(self.state_layout.numel(name, i),
                                          device=self.state_device))
            self.decay_ranges.append(_shard_ranges(b, b.shard, lambda p: p.ndim >= 2 and "norm" not in names[p]))
            self.norm_ranges.append(_shard_ranges(b, b.shard, lambda p: not getattr(p, "embedding_copy", False)
                                                  and (is_tensor_parallel(p) or is_expert(p) or tp_rank == 0)))
            self.sp_ranges.append(_shard_ranges(b, b.shard, lambda p: getattr(p, "sequence_parallel", False)))
        if offload:  # page-locked on a GPU, exactly their size (megalite.host_memory), views of one buffer
            layout = [(f"{kind}/{i}", (b.shard[1] - b.shard[0],), dtype) for i, b in enumerate(self.sync.buckets)
                      for kind, dtype in (("grad", grad_dtype), ("weight", param_dtype))]
            layout.sort(key=lambda entry: -torch.empty((), dtype=entry[2]).element_size())  # widest first: aligned
            views = self._host_staging.views(layout, pinned=pinned) if self.state_device.type == "cpu" else {
                key: torch.empty(shape, dtype=dtype, device=self.state_device) for key, shape, dtype in layout}
            self._host_grad = [views[f"grad/{i}"] for i in range(len(self.sync.buckets))]
            self._host_weight = [views[f"weight/{i}"] for i in range(len(self.sync.buckets))]
        for p in params:  # the model now holds its weights in the training dtype
            p.data = p.data.to(param_dtype)
        geometry = {"geometry": self._geometry(names)} if rule.wants_geometry else {}  # update_rule docstring
        self.update = rule.build(self.master, self.state, self.decay_ranges, t, **geometry)  # the rule's stepper
        self.param_groups = [{"lr": t.lr}]  # for schedulers and logging
        self._update_waits: list = []  # CUDA events the next update waits for (wait_before_next_update)
        self.sharded = ShardedParameters(self.chunks, self.sync, self.group) if stage == 3 else None

    def _places(self, names) -> tuple:
        """Where each parameter lies in this rank's master shards (:class:`ParamPlace`, in shard order)."""
        places = []
        for i, b in enumerate(self.sync.buckets):
            lo, hi = b.shard
            for p, (start, numel) in zip(b.params, b.offsets):
                a, z = max(start, lo), min(start + numel, hi)
                if a < z:
                    places.append(ParamPlace(names[p], p, i, a - lo, z - lo, a - start))
        return tuple(places)

    def _geometry(self, names) -> ShardGeometry:
        """Where each parameter lies in this rank's master shards, for a rule that asks."""
        buckets = [BucketLayout(b.shard[0], b.shard[1], b.numel, b.group, self.stage >= 1 and b.size > 1,
                                tuple((names[p], p, start) for p, (start, _) in zip(b.params, b.offsets)))
                   for b in self.sync.buckets]
        return ShardGeometry(self.places, self.grid.tp_group if self.grid is not None else None,
                             getattr(self.chunks[0], "cfg", None), tuple(buckets), self.state_layout)

    def state_piece(self, kind: str, shard: int, offset: int, count: int) -> torch.Tensor | None:
        """Master shard ``shard``'s elements ``[offset, offset + count)`` (one parameter's) of
        checkpoint kind ``kind`` (the master weights or a state tensor), a view; None where the
        rule keeps no such state for that parameter (a Muon matrix's ``exp_avg_sq``). The one
        way the checkpoint writers and readers reach the state."""
        if kind == MASTER_KIND:
            return self.master[shard][offset: offset + count]
        return self.state_layout.view(self.state[kind][shard], kind, shard, offset, offset + count)

    # -- the train-step protocol ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True, num_micro: int = 1) -> None:
        self.sync.start_step(num_micro, self._arrival_order(num_micro))
        if self.sharded is not None:
            self.sharded.begin_step()

    def _arrival_order(self, num_micro: int):
        """Under a zero-bubble schedule or several chunks per rank (ZBV, the interleaved 1F1B) with
        ZeRO-2 and overlap: the (bucket, micro-batch) reductions in the order the rank's operation
        list completes them (a bucket's gradients of micro-batch j are complete after the last B
        or W, or fused BW, that makes one of them), the same on every rank of the group (they run
        the same list). ZBV runs the W's of its two chunks out of micro-batch order and the
        interleaved 1F1B the backwards of its V chunks (micro-batch j of the last chunk long
        before j of the first), so the default order, every bucket of micro-batch j before any of
        j + 1, would keep several micro-batches' staging buffers waiting (under the interleaved
        1F1B as much as the whole gradient). None: the default order."""
        grid, t = self.grid, self.t
        out_of_order = schedule_kind(t.pipeline_schedule).split_backward or len(self.chunks) > 1
        if not out_of_order or self.stage < 2 or not self.sync.overlap or grid is None:
            return None
        if num_micro in self._orders:  # the same every step: computed once per M
            return self._orders[num_micro]
        position = resolve_schedule(t.pipeline_schedule, grid.layout.pp, len(self.chunks)).op_positions(
            num_micro, grid.pp_rank)
        chunk_of = {p: c for c, chunk in enumerate(self.chunks) for p in chunk.parameters()}

        def done(i: int, j: int) -> int:
            return max(position[("W" if getattr(p, "deferred_wgrad", False) else "B", j, chunk_of[p])]
                       for p in self.sync.buckets[i].params)

        pairs = [(i, j) for j in range(num_micro) for i in range(len(self.sync.buckets))]
        self._orders[num_micro] = sorted(pairs, key=lambda ij: (done(*ij), ij[1], ij[0]))
        return self._orders[num_micro]

    def finish_grad_sync(self) -> None:
        """Wait for the DP reduction, then the cross-group sums (SP over TP, tied embedding)."""
        self.sync.finish()
        if self.sharded is not None:
            self.sharded.end_step()
        if self.grid is None:
            return
        tied = [self.sync.shard_grad(b) for b in self.sync.buckets if getattr(b.params[0], "tied_embedding", False)]
        local_tied = sum_local_tied_copies(tied)  # ZBV: both copies on this rank
        for b, ranges in zip(self.sync.buckets, self.sp_ranges):
            if ranges and comm.group_size(self.grid.tp_group) > 1:
                g = self.sync.shard_grad(b)
                flat = comm.all_reduce(torch.cat([g[a:z] for a, z in ranges]), self.grid.tp_group)
                offset = 0
                for a, z in ranges:
                    g[a:z].copy_(flat[offset: offset + z - a])
                    offset += z - a
            if getattr(b.params[0], "tied_embedding", False) and comm.group_size(self.grid.embedding_group) > 1 \
                    and not local_tied:
                comm.all_reduce(self.sync.shard_grad(b), self.grid.embedding_group)

    def grad_norm(self, loss_scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        """Unscale the gradient shards and return the global L2 norm (fp32). Each element is
        counted once: dense shards are disjoint over DP (stages >= 1) and TP-replicated ones
        are counted on TP rank 0; expert shards are disjoint over expert-data-parallel ranks
        and the experts over the expert-parallel group, which gives the stage's experts on
        every rank of the stage, so TP rank 0 adds them before the sum over TP x PP."""
        dense = torch.zeros((), dtype=torch.float32, device=self.device)
        experts = torch.zeros((), dtype=torch.float32, device=self.device)
        for b, ranges in zip(self.sync.buckets, self.norm_ranges):
            g = self.sync.shard_grad(b)
            if isinstance(loss_scale, torch.Tensor) or loss_scale != 1.0:  # a device scale: no host test
                g.div_(loss_scale)
            total = experts if b.expert else dense
            for a, z in ranges:
                total += g[a:z].float().pow(2).sum()
        if self.grid is None:
            return (dense + experts).sqrt()
        if self.stage >= 1:
            comm.all_reduce(dense, self.group)  # disjoint shards across DP
            comm.all_reduce(experts, self.expert_group)
        if any(b.expert for b in self.sync.buckets):
            comm.all_reduce(experts, self.grid.ep_group)
            if self.grid.tp_rank != 0:
                experts.zero_()
        total = comm.all_reduce(dense + experts, self.grid.mp_group)
        return total.sqrt()

    @torch.no_grad()
    @category("optimizer state")
    def step(self, lr: float, clip_coeff: torch.Tensor | float = 1.0, found_inf: torch.Tensor | None = None) -> None:
        """AdamW (decoupled weight decay) on the master shards, then publish the weights.

        ``clip_coeff`` (a device scalar, or 1.0) scales the gradients; ``found_inf`` (a device
        scalar) skips the update where nonzero: decided on the device, no host sync
        (:mod:`megalite.data_parallel.adamw`). The weights are published either way (a
        skipped step publishes the unchanged masters)."""
        grads = self._host_grads() if self.offload else [self.sync.shard_grad(b) for b in self.sync.buckets]
        for event in self._update_waits:  # an asynchronous save still copying the states
            torch.cuda.current_stream(self.device).wait_event(event)
        self._update_waits.clear()
        grad_scale = 1.0 / clip_coeff if isinstance(clip_coeff, torch.Tensor) else (
            None if clip_coeff == 1.0 else torch.full((), 1.0 / clip_coeff, device=self.state_device))  # no H2D copy
        self.update.step(grads, lr, grad_scale, found_inf)
        self.param_groups[0]["lr"] = lr
        self.publish()

    def wait_before_next_update(self, event) -> None:
        """Make the next :meth:`step`, the first thing that changes the master weights and
        the moments, wait on the device for ``event``: an asynchronous save copying those states
        on a side stream (:mod:`megalite.checkpoint.async_save`). The forward and backward before
        that step do not wait, and the host never does."""
        self._update_waits.append(event)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (skipped ones not counted): a device value, read on demand."""
        return self.update.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.update.step_count = value

    def _host_grads(self) -> list[torch.Tensor]:
        """Offload: every gradient shard copied into its pinned host buffer. The copies are
        queued without blocking the host and waited for once, together."""
        for b, host in zip(self.sync.buckets, self._host_grad):
            host.copy_(self.sync.shard_grad(b), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self._host_grad

    def _weight_shard(self, i: int) -> torch.Tensor:
        """Master shard i in the model dtype, on the model's device (where the collectives
        run); offloaded masters travel through a pinned buffer."""
        if not self.offload:
            return self.master[i].to(self.model_dtype)
        host = self._host_weight[i]
        host.copy_(self.master[i])
        return host.to(self.device, non_blocking=True)

    @torch.no_grad()
    def publish(self, buckets=None) -> None:
        """Make the model's weights equal to the master weights (cast to the model dtype): every
        bucket, or only the indices in ``buckets`` (QK-clip's republish, :meth:`scale_rows`), so
        that under ZeRO 1-2 the all-gather carries those buckets' bytes alone. Stage 3 keeps only
        the shards, so it copies them all, locally, either way."""
        if self.stage == 3:
            self.sharded.load_shards([self._weight_shard(i) for i in range(len(self.master))])
            return
        for i in range(len(self.sync.buckets)) if buckets is None else buckets:
            b = self.sync.buckets[i]
            shard = self._weight_shard(i)
            if self.stage == 0 or b.size == 1:
                full = shard
            else:
                with category("communication"):
                    full = torch.empty(b.numel, dtype=self.model_dtype, device=self.device)
                comm.all_gather_async(full, shard.contiguous(), b.group).wait()
            for p, (start, numel) in zip(b.params, b.offsets):
                p.copy_(full[start: start + numel].view_as(p))

    @contextlib.contextmanager
    def full_weights(self):
        """Weights gathered for use outside a train step (evaluation, saving); no-op below stage 3."""
        if self.sharded is None:
            yield
            return
        self.sharded.gather_all()
        try:
            yield
        finally:
            self.sharded.release_all()

    # -- accounting ---------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by kind, between steps."""
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts)

        if self.sharded is not None:
            weights = self.sharded.shard_bytes()
        else:
            weights = sum(p.numel() * p.element_size() for c in self.chunks for p in c.parameters())
        grads = nbytes([b.grad if b.grad is not None else b.grad_shard for b in self.sync.buckets])
        return {"weights": weights, "gradients": grads, "master_weights": nbytes(self.master),
                "optimizer_state": sum(nbytes(shards) for shards in self.state.values())}

    def shards_by_kind(self) -> dict[str, list[torch.Tensor]]:
        """The fp32 shards a checkpoint stores, by the rule's checkpoint kinds: the master
        weights, then each state tensor."""
        return {MASTER_KIND: self.master, **self.state}

    @torch.no_grad()
    def scale_rows(self, factors: dict) -> None:
        """QK-clip (megalite.model.qk_clip): multiply each given parameter's rows (dim 0) by its
        (rows,) device ``factors`` in the fp32 masters, wherever ZeRO put them, then publish the
        buckets holding those parameters, and only them (:meth:`buckets_holding`): under ZeRO 1-2
        one all-gather of those buckets' weights (model dtype), not of the whole model's. The
        factors stay on the device, so the host does not know whether anything was clipped:
        those buckets are published every step."""
        for place in self.places:  # each parameter's piece of each shard
            rows = factors.get(place.param)
            if rows is not None:
                per_row = rows[:, None].expand(-1, place.param.numel() // rows.numel()).reshape(-1)
                self.master[place.shard][place.start: place.stop].mul_(
                    per_row[place.first: place.first + place.stop - place.start])
        self.publish(self.buckets_holding(factors))

    def buckets_holding(self, params) -> list[int]:
        """The indices, ascending, of the buckets that hold any of ``params``."""
        wanted = {id(p) for p in params}
        return [i for i, b in enumerate(self.sync.buckets) if any(id(p) in wanted for p in b.params)]
