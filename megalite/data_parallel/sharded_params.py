"""ZeRO stage 3: weights sharded over DP, gathered just in time, layer by layer.

Every gradient bucket (for stage 3 one bucket per transformer layer, plus one "root" bucket
with the embeddings, final norm and output layer) has a flat full-size buffer whose
parameters are views. Between uses the buffer's storage is resized to zero bytes, so the
rank holds only its shard (1/N of the bucket). A layer's forward pre-hook all-gathers its
bucket (and starts gathering the next layer's: prefetch); its forward hook frees it again.
Its backward pre-hook gathers it once more for backward (prefetching the layer before);
once all its gradients have arrived (and were handed to the reduce-scatter of
:mod:`megalite.data_parallel.ddp`), it is freed. The root bucket stays gathered for the
whole step (the tied embedding is used at both ends of the model).

Resizing the storage in place (rather than swapping tensors) keeps every view valid,
including the ones autograd saved for backward, and writing the gathered values through
``.data`` does not bump version counters, so autograd's in-place checks stay quiet.
"""
from __future__ import annotations

import torch

from megalite.observe.memory_tracker import category, resized
from megalite.parallel import comm


class ShardedParameters:
    def __init__(self, chunks, sync, group):
        self.sync, self.group = sync, group
        self.dp = comm.group_size(group)
        self.full, self.shards, self.inflight = [], [], {}
        self._unit_of_module, self._arrived = {}, {}
        self._bucket_of = {}
        for b in sync.buckets:
            dtype = b.params[0].dtype
            with category("parameters"):
                full = torch.zeros(b.numel, dtype=dtype, device=b.params[0].device)
            for p, (start, numel) in zip(b.params, b.offsets):
                full[start: start + numel] = p.detach().reshape(-1)
            self.shards.append(full[b.shard[0]: b.shard[1]].clone())
            for p, (start, numel) in zip(b.params, b.offsets):
                p.data = full[start: start + numel].view(p.shape)
                self._bucket_of[p] = b.index
            self.full.append(full)
            self._free(b.index)
        # Layer units: each transformer block's parameters form one bucket.
        self.layer_order: list[int] = []
        for chunk in chunks:
            for layer in chunk.layers.values():
                index = self._bucket_of[next(layer.parameters())]
                self.layer_order.append(index)
                self._unit_of_module[layer] = index
                layer.register_forward_pre_hook(self._before_forward)
                layer.register_forward_hook(self._after_forward)
                layer.register_full_backward_pre_hook(self._before_backward)
                for p in layer.parameters():
                    p.register_post_accumulate_grad_hook(self._grad_arrived)
        self.root = [b.index for b in sync.buckets if b.index not in set(self.layer_order)]

    # -- storage -----------------------------------------------------------------------------------
    def _free(self, i: int) -> None:
        storage = self.full[i].untyped_storage()
        storage.resize_(0)
        resized(storage)

    def _is_gathered(self, i: int) -> bool:
        return self.full[i].untyped_storage().size() > 0

    def _start_gather(self, i: int) -> None:
        if self._is_gathered(i) or i in self.inflight:
            return
        full = self.full[i]
        storage = full.untyped_storage()
        storage.resize_(full.numel() * full.element_size())
        resized(storage)
        if self.dp == 1:
            full.data.copy_(self.shards[i])
        else:
            self.inflight[i] = comm.all_gather_async(full.data, self.shards[i], self.group)

    def gather(self, i: int) -> None:
        self._start_gather(i)
        work = self.inflight.pop(i, None)
        if work is not None:
            work.wait()

    # -- hooks -------------------------------------------------------------------------------------
    def _neighbour(self, i: int, step: int) -> int | None:
        k = self.layer_order.index(i) + step
        return self.layer_order[k] if 0 <= k < len(self.layer_order) else None

    def _before_forward(self, module, args):
        i = self._unit_of_module[module]
        self.gather(i)
        following = self._neighbour(i, +1)
        if following is not None:
            self._start_gather(following)  # prefetch the next layer

    def _after_forward(self, module, args, output):
        self._free(self._unit_of_module[module])

    def _before_backward(self, module, grad_output):
        i = self._unit_of_module[module]
        self.gather(i)
        previous = self._neighbour(i, -1)
        if previous is not None:
            self._start_gather(previous)  # prefetch the layer backward reaches next
        self._arrived[i] = 0

    def _grad_arrived(self, param) -> None:
        i = self._bucket_of[param]
        self._arrived[i] = self._arrived.get(i, 0) + 1
        if self._arrived[i] == len(self.sync.buckets[i].params):
            self._free(i)  # its gradients are in the reduce-scatter already

    # -- per step ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        for i in self.root:
            self.gather(i)

    def end_step(self) -> None:
        self.release_all()

    def gather_all(self) -> None:
        for i in range(len(self.full)):
            self.gather(i)

    def release_all(self) -> None:
        for i, work in list(self.inflight.items()):
            work.wait()
        self.inflight.clear()
        for i in range(len(self.full)):
            self._free(i)

    @torch.no_grad()
    def load_shards(self, shards: list[torch.Tensor]) -> None:
        for mine, new in zip(self.shards, shards):
            mine.copy_(new)

    def shard_bytes(self) -> int:
        gathered = sum(f.numel() * f.element_size() for i, f in enumerate(self.full) if self._is_gathered(i))
        return sum(s.numel() * s.element_size() for s in self.shards) + gathered
