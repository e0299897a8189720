"""The settings of long runs (rollback, spike checks, skipped batches, straggler reports, fault
injection) and their rules, checked before any process group or model exists. The checkpoint
flags these rules read (``--save``, ``--async-save``) belong to the run's checkpoint settings."""
from __future__ import annotations

import re
from dataclasses import dataclass

from megalite.data.batch_stream import merge_windows
from megalite.errors import ConfigError
from megalite.flag_spec import setting
from megalite.resilience.fault_injection import Fault, parse_faults

GROUP = "long runs: asynchronous checkpoints, rollback, stragglers, fault drills"


@dataclass
class ResilienceSettings:
    check_for_spiky_loss: bool = setting(
        False, "treat a loss above --spiky-loss-factor x the median of the last --spiky-loss-window losses as a "
        "fault (rolled back with --max-rollbacks, else a stop); armed once 3 losses are known (their median "
        "until the window fills), and from the first iteration of a resume (the checkpoint records the losses "
        "before it)")
    spiky_loss_factor: float = setting(3.0)
    spiky_loss_window: int = setting(10, "losses the median is taken over (fewer while the run warms up: at "
                                     "least 3)")
    max_rollbacks: int = setting(0, "on a NaN/inf loss or gradient norm (bf16/fp32) or a spike: go back to the "
                                 "latest checkpoint, skip the batches that led to it and go on, at most this many "
                                 "times (0: stop the run, as without the flag)")
    rollback_skip_batches: int = setting(1, "global batches skipped at a rollback: the faulty iteration's and "
                                         "the N-1 before it")
    skip_batches: list[str] = setting(default_factory=list, help="global batches (numbered from 1 like "
                                      "iterations) read and not trained on, e.g. a window a rollback skipped in "
                                      "another run", nargs="*", metavar="FIRST[-LAST]")
    straggler_report_interval: int = setting(0, "every N iterations gather each rank's compute time and name "
                                             "the ranks slower than the median by --straggler-threshold (0: off)")
    straggler_threshold: float = setting(0.2, "a rank is named when its compute time exceeds the median by this "
                                         "fraction")
    inject_fault: list[str] = setting(default_factory=list, help="drills and tests: nan, spike, slow, hang, kill "
                                      "or kill-during-save at iteration ITER on RANK (every rank if omitted); "
                                      "see docs/resilience.md", action="append", metavar="KIND@ITER[:RANK][=VALUE]")

    @property
    def checked(self) -> bool:
        """Whether the loop checks each step's records and agrees on faults (else StepLog stops on
        non-finite values)."""
        return self.check_for_spiky_loss or self.max_rollbacks > 0


def parse_skip_batches(texts) -> list[tuple[int, int]]:
    """``FIRST[-LAST]`` windows (1-based, inclusive), merged and sorted."""
    windows = []
    for text in texts or ():
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
        if m is None or int(m[1]) < 1 or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ConfigError(f"--skip-batches {text!r}: expected FIRST or FIRST-LAST with 1 <= FIRST <= LAST "
                              f"(global batch numbers, counted from 1 like iterations), e.g. 7 or 7-9.")
        windows.append((int(m[1]), int(m[2] or m[1])))
    return merge_windows(windows)


@dataclass
class ResiliencePlan:
    """What the resilience settings resolve to before the run: the faults to inject and the skip windows."""
    faults: list[Fault]
    skip_windows: list[tuple[int, int]]


def check_resilience(r: ResilienceSettings, save: str | None, async_save: bool,
                     fake_process_group: bool) -> ResiliencePlan:
    """One message per rule, naming the value and the fix; returns the parsed faults and windows."""
    if save and fake_process_group:
        raise ConfigError(f"--save {save} with --fake-process-group: a dry run plays one rank of the world, "
                          f"and a checkpoint needs every rank's files and rank 0's commit. Fix: drop --save "
                          f"(the dry run measures memory and traffic; a real run saves).")
    if async_save and not save:
        raise ConfigError("--async-save is set without --save: there is nothing to save. Fix: add --save DIR "
                          "(with --save-interval N), or drop --async-save.")
    if r.max_rollbacks < 0:
        raise ConfigError(f"--max-rollbacks {r.max_rollbacks}: must be >= 0 (0: a fault stops the run).")
    if r.max_rollbacks > 0 and not save:
        raise ConfigError(f"--max-rollbacks {r.max_rollbacks} needs --save DIR: a rollback goes back to the "
                          f"latest checkpoint saved there. Fix: add --save DIR --save-interval N.")
    if r.rollback_skip_batches < 0:
        raise ConfigError(f"--rollback-skip-batches {r.rollback_skip_batches}: must be >= 0.")
    if r.spiky_loss_factor <= 1.0:
        raise ConfigError(f"--spiky-loss-factor {r.spiky_loss_factor}: must be > 1 (a loss above factor x "
                          f"the recent median is a spike).")
    if r.spiky_loss_window < 1:
        raise ConfigError(f"--spiky-loss-window {r.spiky_loss_window}: must be >= 1.")
    if r.straggler_report_interval < 0:
        raise ConfigError(f"--straggler-report-interval {r.straggler_report_interval}: must be >= 0 (0: off).")
    if r.straggler_threshold <= 0:
        raise ConfigError(f"--straggler-threshold {r.straggler_threshold}: must be > 0 (a fraction above "
                          f"the median, e.g. 0.2).")
    return ResiliencePlan(parse_faults(r.inject_fault), parse_skip_batches(r.skip_batches))
