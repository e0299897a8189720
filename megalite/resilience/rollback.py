"""Finding a bad step (a non-finite loss or gradient norm, a loss spike) and agreeing on it.

:class:`LossSentinel` reads the records of a flushed log window in order and returns the
first bad one:

* **non-finite**: loss or gradient norm NaN/inf in bf16/fp32 (fp16's loss scaler skips
  such steps itself);
* **spike** (``--check-for-spiky-loss``): ``loss > factor x median(last W good losses)``.
  The median, not the mean, so one earlier spike does not hide the next; the window holds
  good losses only. The warm-up rule: the check is armed as soon as ``min(W, 3)`` good
  losses are known (fewer than W: the median of those), so a fresh run is checked from
  iteration 4 on, not from W+1 on. A resumed run starts with the losses its checkpoint
  recorded (``recent_losses`` in metadata.json, written at every save): it is checked from
  its first iteration. A median of fewer than 3 losses would let one noisy early loss set
  the bar.

Every rank must take the same decision (a rank that rolls back alone leaves its peers in a
collective): :func:`agree` takes the earliest bad iteration over all ranks with one
all-reduce (MIN) of one value on the gloo control group, once per flush.

What happens then (``megalite.train.loop``): with rollbacks left (``--max-rollbacks``), the
run goes back to the latest checkpoint, skips the faulty iteration's batch and the N-1 before
it (``--rollback-skip-batches``), and goes on; else it stops with :class:`TrainingDiverged`.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.resilience.faults import TrainingDiverged

KIND_CODES = ("non-finite", "spike")  # an earlier iteration wins; at the same one, non-finite
WARMUP_LOSSES = 3  # good losses known before the spike check is armed (or W, when W is smaller)


@dataclass(frozen=True)
class BadStep:
    iteration: int
    kind: str           # "non-finite" or "spike"
    loss: float | None = None
    grad_norm: float | None = None
    median: float | None = None   # spike: the median it was compared with
    count: int | None = None      # spike: over how many losses (fewer than the window in the warm-up)

    def describe(self, factor: float | None = None, window: int | None = None) -> str:
        if self.kind == "spike" and self.median is not None:
            return (f"loss spike at iteration {self.iteration}: loss {self.loss:.4f} > {factor:g} x the median "
                    f"{self.median:.4f} of the last {self.count or window} losses")
        if self.kind == "spike":
            return f"loss spike at iteration {self.iteration}"
        if self.loss is None:
            return f"non-finite loss or gradient norm at iteration {self.iteration}"
        return (f"non-finite values at iteration {self.iteration}: loss {self.loss}, gradient norm "
                f"{self.grad_norm}")


class LossSentinel:
    def __init__(self, fp16: bool, spiky: bool, factor: float, window: int, history: dict[int, float] | None = None):
        self.fp16, self.spiky, self.factor, self.window = fp16, spiky, factor, window
        self.history: dict[int, float] = dict(history or {})   # iteration -> good loss (a resume: the checkpoint's)

    @property
    def needed(self) -> int:
        """Good losses known before a loss is compared with their median (the warm-up rule)."""
        return min(self.window, WARMUP_LOSSES)

    def armed_from(self, start_iteration: int) -> int:
        """The first iteration after ``start_iteration`` that is checked for a spike, when the
        losses between come out good."""
        return start_iteration + 1 + max(0, self.needed - len(self.history))

    def describe_arming(self, start_iteration: int) -> str:
        """The startup line of ``--check-for-spiky-loss``: from which iteration, against what."""
        first = self.armed_from(start_iteration)
        rule = (f"a loss above {self.factor:g} x the median of the last {self.window} good losses "
                f"(fewer in the warm-up: at least {self.needed}) is a spike")
        if self.history:
            return (f"spike check: armed from iteration {first} ({len(self.history)} loss(es) recorded by the "
                    f"checkpoint); {rule}")
        return f"spike check: armed from iteration {first} (once {self.needed} losses are known); {rule}"

    def first_bad(self, records: list[dict]) -> BadStep | None:
        """The first bad record of a window, in order; the good ones before it join the history."""
        for r in records:
            loss, norm = r.get("loss"), r.get("grad_norm")
            if loss is None:  # a meta run: nothing computed
                continue
            if not self.fp16 and (not math.isfinite(loss) or (norm is not None and not math.isfinite(norm))):
                return BadStep(r["iteration"], "non-finite", loss, norm)
            recent = [self.history[i] for i in sorted(self.history)[-self.window:]]
            if self.spiky and math.isfinite(loss) and len(recent) >= self.needed:
                median = statistics.median(recent)
                if loss > self.factor * median:
                    return BadStep(r["iteration"], "spike", loss, norm, median, len(recent))
            if math.isfinite(loss):
                self.history[r["iteration"]] = loss
        return None

    def forget_after(self, iteration: int) -> None:
        """A rollback to ``iteration``: later losses were undone."""
        self.history = {i: v for i, v in self.history.items() if i <= iteration}


def recent_good_losses(loaded: dict[int, float], records: list[dict], upto: int, count: int) -> list[list]:
    """``[[iteration, loss], ...]``: the last ``count`` finite losses of iterations up to ``upto``,
    from the losses the loaded checkpoint recorded and then this run's log records (a replayed
    iteration's latest record wins). What a checkpoint records for the spike check of a run
    that resumes from it."""
    latest = dict(loaded)
    latest.update({r["iteration"]: r.get("loss") for r in records if r["iteration"] <= upto})
    good = [[i, v] for i, v in sorted(latest.items()) if v is not None and math.isfinite(v)]
    return good[-count:]


def checkpoint_losses(directory: str | None) -> dict[int, float]:
    """The losses recorded in checkpoint ``directory``'s metadata.json (none: an older
    checkpoint, or one written by a tool)."""
    if not directory:
        return {}
    try:
        with open(os.path.join(directory, "metadata.json")) as f:
            recorded = json.load(f).get("recent_losses") or []
    except (OSError, ValueError):
        return {}
    return {int(i): float(v) for i, v in recorded}


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
