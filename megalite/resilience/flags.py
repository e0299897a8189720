"""The flags of long runs (asynchronous and DCP checkpoints, rollback, straggler reports,
fault injection) and their rules, checked before any process group or model exists."""
from __future__ import annotations

import argparse
import re

from megalite.data.batch_stream import merge_windows
from megalite.errors import ConfigError
from megalite.resilience.fault_injection import parse_faults

CKPT_FORMATS = ("megalite", "torch_dcp")


def add_resilience_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("long runs: asynchronous checkpoints, rollback, stragglers, fault drills")
    g.add_argument("--async-save", action="store_true",
                   help="save checkpoints in the background: the state is copied to reused host buffers "
                        "and a writer thread writes and commits it while training goes on (needs --save)")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="megalite",
                   help="megalite: safetensors + JSON; torch_dcp: torch.distributed.checkpoint "
                        "(readable by DCP's tools such as dcp_to_torch_save)")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="treat a loss above --spiky-loss-factor x the median of the last "
                        "--spiky-loss-window losses as a fault (rolled back with --max-rollbacks, else a stop); "
                        "armed once 3 losses are known (their median until the window fills), and from the "
                        "first iteration of a resume (the checkpoint records the losses before it)")
    g.add_argument("--spiky-loss-factor", type=float, default=3.0)
    g.add_argument("--spiky-loss-window", type=int, default=10,
                   help="losses the median is taken over (fewer while the run warms up: at least 3)")
    g.add_argument("--max-rollbacks", type=int, default=0,
                   help="on a NaN/inf loss or gradient norm (bf16/fp32) or a spike: go back to the latest "
                        "checkpoint, skip the batches that led to it and go on, at most this many times "
                        "(0: stop the run, as without the flag)")
    g.add_argument("--rollback-skip-batches", type=int, default=1,
                   help="global batches skipped at a rollback: the faulty iteration's and the N-1 before it")
    g.add_argument("--skip-batches", nargs="*", default=[], metavar="FIRST[-LAST]",
                   help="global batches (numbered from 1 like iterations) read and not trained on, e.g. "
                        "a window a rollback skipped in another run")
    g.add_argument("--straggler-report-interval", type=int, default=0,
                   help="every N iterations gather each rank's compute time and name the ranks slower "
                        "than the median by --straggler-threshold (0: off)")
    g.add_argument("--straggler-threshold", type=float, default=0.2,
                   help="a rank is named when its compute time exceeds the median by this fraction")
    g.add_argument("--inject-fault", action="append", default=[], metavar="KIND@ITER[:RANK][=VALUE]",
                   help="drills and tests: nan, spike, slow, hang, kill or kill-during-save at iteration "
                        "ITER on RANK (every rank if omitted); see docs/resilience.md")


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


def check_resilience_args(args: argparse.Namespace) -> None:
    """One message per rule, naming the value and the fix. Sets ``args.faults`` and
    ``args.skip_windows``."""
    if args.save and getattr(args, "fake_process_group", False):
        raise ConfigError(f"--save {args.save} with --fake-process-group: a dry run plays one rank of the world, "
                          f"and a checkpoint needs every rank's files and rank 0's commit. Fix: drop --save "
                          f"(the dry run measures memory and traffic; a real run saves).")
    if args.async_save and not args.save:
        raise ConfigError("--async-save is set without --save: there is nothing to save. Fix: add --save DIR "
                          "(with --save-interval N), or drop --async-save.")
    if args.max_rollbacks < 0:
        raise ConfigError(f"--max-rollbacks {args.max_rollbacks}: must be >= 0 (0: a fault stops the run).")
    if args.max_rollbacks > 0 and not args.save:
        raise ConfigError(f"--max-rollbacks {args.max_rollbacks} needs --save DIR: a rollback goes back to the "
                          f"latest checkpoint saved there. Fix: add --save DIR --save-interval N.")
    if args.rollback_skip_batches < 0:
        raise ConfigError(f"--rollback-skip-batches {args.rollback_skip_batches}: must be >= 0.")
    if args.spiky_loss_factor <= 1.0:
        raise ConfigError(f"--spiky-loss-factor {args.spiky_loss_factor}: must be > 1 (a loss above factor x "
                          f"the recent median is a spike).")
    if args.spiky_loss_window < 1:
        raise ConfigError(f"--spiky-loss-window {args.spiky_loss_window}: must be >= 1.")
    if args.straggler_report_interval < 0:
        raise ConfigError(f"--straggler-report-interval {args.straggler_report_interval}: must be >= 0 (0: off).")
    if args.straggler_threshold <= 0:
        raise ConfigError(f"--straggler-threshold {args.straggler_threshold}: must be > 0 (a fraction above "
                          f"the median, e.g. 0.2).")
    args.faults = parse_faults(args.inject_fault)
    args.skip_windows = parse_skip_batches(args.skip_batches)
