"""Finding a bad step (a non-finite loss or gradient norm, a loss spike) and agreeing on it.

:class:`LossSentinel` reads the records of a flushed log window in order and returns the
first bad one:

* **non-finite**: loss or gradient norm NaN/inf in bf16/fp32 (fp16's loss scaler skips
  such steps itself);
* **spike** (``--check-for-spiky-loss``): ``loss > factor x median(last W good losses)``,
  once W losses are known. The median, not the mean, so one earlier spike does not hide
  the next; the window holds good losses only.

Every rank must take the same decision (a rank that rolls back alone leaves its peers in a
collective): :func:`agree` takes the earliest bad iteration over all ranks with one
all-reduce (MIN) of one value on the gloo control group, once per flush.

What happens then (``megalite.train_loop``): with rollbacks left (``--max-rollbacks``), the
run goes back to the latest checkpoint, skips the faulty iteration's batch and the N-1 before
it (``--rollback-skip-batches``), and goes on; else it stops with :class:`TrainingDiverged`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.faults import TrainingDiverged

KIND_CODES = ("non-finite", "spike")  # an earlier iteration wins; at the same one, non-finite


@dataclass(frozen=True)
class BadStep:
    iteration: int
    kind: str           # "non-finite" or "spike"
    loss: float | None = None
    grad_norm: float | None = None
    median: float | None = None   # spike: the median it was compared with

    def describe(self, factor: float | None = None, window: int | None = None) -> str:
        if self.kind == "spike" and self.median is not None:
            return (f"loss spike at iteration {self.iteration}: loss {self.loss:.4f} > {factor:g} x the median "
                    f"{self.median:.4f} of the last {window} losses")
        if self.kind == "spike":
            return f"loss spike at iteration {self.iteration}"
        if self.loss is None:
            return f"non-finite loss or gradient norm at iteration {self.iteration}"
        return (f"non-finite values at iteration {self.iteration}: loss {self.loss}, gradient norm "
                f"{self.grad_norm}")


class LossSentinel:
    def __init__(self, fp16: bool, spiky: bool, factor: float, window: int):
        self.fp16, self.spiky, self.factor, self.window = fp16, spiky, factor, window
        self.history: dict[int, float] = {}   # iteration -> good loss

    def first_bad(self, records: list[dict]) -> BadStep | None:
        """The first bad record of a window, in order; the good ones before it join the history."""
        for r in records:
            loss, norm = r.get("loss"), r.get("grad_norm")
            if loss is None:  # a meta run: nothing computed
                continue
            if not self.fp16 and (not math.isfinite(loss) or (norm is not None and not math.isfinite(norm))):
                return BadStep(r["iteration"], "non-finite", loss, norm)
            recent = [self.history[i] for i in sorted(self.history)[-self.window:]]
            if self.spiky and math.isfinite(loss) and len(recent) == self.window:
                median = statistics.median(recent)
                if loss > self.factor * median:
                    return BadStep(r["iteration"], "spike", loss, norm, median)
            if math.isfinite(loss):
                self.history[r["iteration"]] = loss
        return None

    def forget_after(self, iteration: int) -> None:
        """A rollback to ``iteration``: later losses were undone."""
        self.history = {i: v for i, v in self.history.items() if i <= iteration}


def agree(bad: BadStep | None, grid) -> BadStep | None:
    """The earliest bad step over all ranks (one all-reduce MIN on the gloo control group)."""
    if grid is None or not dist.is_initialized() or grid.layout.world_size == 1:
        return bad
    never = 2 ** 52
    code = never if bad is None else bad.iteration * len(KIND_CODES) + KIND_CODES.index(bad.kind)
    value = torch.tensor([float(code)], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=grid.control_group)
    agreed = int(value.item())
    if agreed == never:
        return None
    iteration, kind = divmod(agreed, len(KIND_CODES))
    if bad is not None and bad.iteration == iteration and bad.kind == KIND_CODES[kind]:
        return bad  # this rank saw it: keep its values for the message
    return BadStep(iteration, KIND_CODES[kind])


def exhausted(bad: BadStep, max_rollbacks: int, factor: float, window: int) -> TrainingDiverged:
    what = bad.describe(factor, window)
    if max_rollbacks == 0:
        fix = ("Fix: add --max-rollbacks K (with --save DIR --save-interval N) to roll back to the latest "
               "checkpoint and skip the batch, or resume from the last checkpoint with a lower --lr, more "
               "--lr-warmup-iters, or --clip-grad.")
        return TrainingDiverged(f"{what}; the run stopped (--max-rollbacks 0). {fix}")
    return TrainingDiverged(
        f"{what}; {max_rollbacks} rollback(s) already taken (--max-rollbacks {max_rollbacks}), so the run "
        f"stops. The faults keep coming after skipping data: check the data around these batches, lower "
        f"--lr or add --clip-grad, then resume from the latest checkpoint (raise --max-rollbacks to "
        f"allow more).")


def no_checkpoint(bad: BadStep, save_dir: str, factor: float, window: int) -> TrainingDiverged:
    return TrainingDiverged(
        f"{bad.describe(factor, window)}; there is no checkpoint to roll back to yet (none saved under --save "
        f"{save_dir}, no --load). Fix: save earlier (a smaller --save-interval), or restart with a lower --lr "
        f"or more --lr-warmup-iters.")
