"""AdamW on flat fp32 master shards, with torch's fused kernel, decided on the device.

For each element of a shard, with gradient ``g`` (divided by ``grad_scale`` when one is
given), step count ``t``, learning rate ``lr`` and decay ``wd`` (0 outside the decayed
ranges: biases and norm weights are not decayed)::

    w <- w (1 - lr wd)                                  decoupled weight decay
    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

``torch._fused_adamw_`` (the kernel behind ``torch.optim.AdamW(fused=True)``, on CUDA and
on the CPU) does all of it in one pass over each tensor of a list, instead of the eight or so
elementwise passes (each reading and writing the whole shard) that the same math costs as
separate torch ops. Its two device-side inputs keep the step free of host syncs:

- ``grad_scale``: the gradients are divided by it; here ``1 / clip coefficient``, so clipping
  by the global norm needs no host value of the norm;
- ``found_inf``: a nonzero value skips the whole update (weights, moments); the step count
  is incremented before and decremented by ``found_inf`` after, so a skipped step does not
  count, as a host-side ``if`` would have it. The kernel skips only on *exactly* 1.0 (any
  other nonzero value would update, and move the count by a fraction), so ``found_inf`` is
  made 0.0 or 1.0 on the device first: a caller's inf count or a 2.0 from a summed flag skips
  too, as this docstring promises.

The decayed and the undecayed ranges of a shard go to two calls (the decay is one scalar per
call), as lists of views of the flat shards: no copies. 16-bit gradients (training without
``--accumulate-allreduce-grads-in-fp32``) are cast to fp32 in slices of at most
``STEP_CHUNK`` elements, so the temporaries stay small. The step count is a device tensor
(:class:`megalite.data_parallel.step_counter.DeviceStepCount`, which every rule's stepper shares);
``step_count`` reads it (one sync, at checkpoint time).
"""
from __future__ import annotations

import torch

from megalite.data_parallel.step_counter import DeviceStepCount

STEP_CHUNK = 1 << 24  # elements per slice of 16-bit gradients cast to fp32 (64 MiB of fp32)


def segments(decay_ranges: list[tuple[int, int]], numel: int, max_len: int = STEP_CHUNK):
    """[0, numel) cut into (start, end, decayed) runs: the decayed ranges and the gaps between
    them, each at most ``max_len`` long."""
    marks, position = [], 0
    for a, z in sorted(decay_ranges):
        if a > position:
            marks.append((position, a, False))
        marks.append((a, z, True))
        position = z
    if position < numel:
        marks.append((position, numel, False))
    out = []
    for a, z, decayed in marks:
        out += [(lo, min(lo + max_len, z), decayed) for lo in range(a, z, max_len)]
    return out


class FlatAdamW(DeviceStepCount):
    """The update of the module docstring over lists of flat shards (master weights and both
    moments, fp32, on one device) whose decayed elements are given as index ranges. The step
    count (``steps``, which the kernel reads on the device) comes from :class:`DeviceStepCount`."""

    def __init__(self, masters, exp_avgs, exp_avg_sqs, decay_ranges, *, betas, eps: float, weight_decay: float):
        super().__init__(masters)
        self.masters, self.exp_avgs, self.exp_avg_sqs = masters, exp_avgs, exp_avg_sqs
        self.segments = [segments(r, m.numel()) for r, m in zip(decay_ranges, masters)]
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay

    @torch.no_grad()
    def step(self, grads, lr: float, grad_scale: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None) -> None:
        """One update from the flat gradient shards ``grads`` (one per master shard)."""
        device = self.steps.device
        grad_scale = None if grad_scale is None else grad_scale.to(device, torch.float32)
        found_inf = None if found_inf is None else (found_inf != 0).to(device, torch.float32)  # exactly 0 or 1
        for i, grad in enumerate(grads):  # the fused kernel's meta version does not check this
            if grad.device != self.masters[i].device:
                raise RuntimeError(f"AdamW: gradient shard {i} on device {grad.device} is not on the expected "
                                   f"device {self.masters[i].device} (where its master weights are)")
        self.steps += 1
        for i, grad in enumerate(grads):
            batch, size = [], 0
            for a, z, decayed in self.segments[i]:
                batch.append((a, z, decayed))
                size += z - a
                if grad.dtype != torch.float32 and size >= STEP_CHUNK:  # bound the fp32 casts
                    self._apply(i, grad, batch, lr, grad_scale, found_inf)
                    batch, size = [], 0
            if batch:
                self._apply(i, grad, batch, lr, grad_scale, found_inf)
        if found_inf is not None:
            self.steps -= found_inf

    def _apply(self, i, grad, batch, lr, grad_scale, found_inf) -> None:
        b1, b2 = self.betas
        for decayed in (True, False):
            runs = [(a, z) for a, z, d in batch if d == decayed]
            if not runs:
                continue
            torch._fused_adamw_(
                [self.masters[i][a:z] for a, z in runs], [grad[a:z].float() for a, z in runs],
                [self.exp_avgs[i][a:z] for a, z in runs], [self.exp_avg_sqs[i][a:z] for a, z in runs],
                [], [self.steps] * len(runs), lr=lr, beta1=b1, beta2=b2,
                weight_decay=self.weight_decay if decayed else 0.0, eps=self.eps, amsgrad=False,
                maximize=False, grad_scale=grad_scale, found_inf=found_inf)
