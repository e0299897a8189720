"""Run the parts of a timed check, each under a hard budget, and keep what each part did.

Standard library only, so it runs (and reports) even where ``import torch`` is broken.
``tools/gpu_check.py`` defines the GPU acceptance check's parts; this module knows nothing
about GPUs:

- A ``Part`` is a few ``Command``s started together (each its own process group, its own
  log) and a ``judge`` that reads their logs and files into (status, figures, one line).
- Parts of one stage run side by side, stages one after another. A part's budget is a hard
  limit: SIGINT to each of its process groups ``grace`` seconds before it (pytest then still
  writes its junit XML), SIGKILL to the groups at it. A failing or overrun part never stops
  the others.
- The whole run stops before ``limit_s`` (counted from ``started``): a part whose budget would
  pass the deadline gets what is left, or is skipped with a note when too little is.
  ``mode="stretch"`` (the last big part) may use the time earlier parts left unused;
  ``mode="extra"`` parts run only when the remaining required parts' budgets still fit after them.
- ``summary.json`` is rewritten atomically (temporary file + ``os.replace``) when the run starts
  (every part "pending") and after every part, so a run cut short still brings back what it
  did; each finished part also appends one line to ``summary.txt``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RESERVE_S = 5.0     # kept back from the limit: killing the last part and writing the summary
MIN_RUN_S = 5.0     # a part offered less than this is skipped, not started
POLL_S = 0.1


@dataclass
class Command:
    argv: list
    log: str                                  # file name in the output folder
    env: dict = field(default_factory=dict)   # added to the run's environment


@dataclass
class Outcome:
    """What one command did: exit status (None: did not start), seconds, whether it was killed."""
    command: Command
    log: Path
    rc: int | None = None
    seconds: float = 0.0
    killed: bool = False


@dataclass(eq=False)  # a part is itself: hashable by identity
class Part:
    key: str                                  # "a", "c-torch", ...
    title: str
    budget_s: float
    commands: Callable[[Path], list] = None   # output folder -> [Command]
    judge: Callable = None                    # (out, [Outcome]) -> (passed, figures, line)
    why: str = ""                             # the budget's arithmetic, for the plan
    mode: str = "required"                    # "required", "stretch" or "extra"
    unavailable: str | None = None            # why it cannot run here (reported as skipped)


def stage_budget(stage: list) -> float:
    """A stage's planned seconds: its parts run side by side (extras do not count)."""
    return max((p.budget_s for p in stage if p.mode != "extra" and not p.unavailable), default=0.0)


def plan_total(stages: list) -> float:
    return sum(stage_budget(s) for s in stages)


def tail(path: Path, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode("utf-8", "replace")[-chars:]
    except OSError:
        return ""


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _child_setup():
    """In each started command, before it runs: SIGINT back to its default (a shell's background
    job inherits it ignored, and pytest must see it), and SIGKILL should this runner die
    (Linux PR_SET_PDEATHSIG; best effort), so no part outlives a killed check."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


try:  # looked up here, in the runner, not in the forked child
    import ctypes

    _PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError, ImportError):
    _PRCTL = None


def _signal_groups(procs, sig) -> None:
    """Send ``sig`` to the process group of each started process (each leads its own group)."""
    for proc in procs:
        if proc is None or proc.pid <= 0:
            continue
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class _Running:
    """One started command: its process (None if it could not start), start and end times, and
    whether it was still running when the part overran (``hit``)."""

    def __init__(self, command: Command, log: Path, proc):
        self.command, self.log, self.proc = command, log, proc
        self.t0, self.t1, self.hit = time.monotonic(), None, False

    def alive(self) -> bool:
        if self.proc is None or self.t1 is not None:
            return False
        if self.proc.poll() is None:
            return True
        self.t1 = time.monotonic()
        return False

    def outcome(self) -> Outcome:
        rc = None if self.proc is None else self.proc.returncode
        end = self.t1 or time.monotonic()
        return Outcome(self.command, self.log, rc, round(end - self.t0, 1), self.hit)


class _Interrupted(Exception):
    pass


class Run:
    """One run of ``stages`` writing to ``out``; ``say`` prints a line (and logs it)."""

    def __init__(self, stages: list, out: Path, limit_s: float, started: float, say: Callable,
                 header: dict | None = None, env: dict | None = None, grace_s: float = 5.0,
                 reserve_s: float = RESERVE_S, min_run_s: float = MIN_RUN_S):
        self.stages, self.out, self.limit_s, self.started, self.say = stages, out, limit_s, started, say
        self.deadline = started + limit_s - reserve_s
        self.min_run_s = min_run_s
        self.env = dict(os.environ if env is None else env)
        self.grace_s = grace_s
        self.running: dict = {}   # part -> its started commands, start, budget, note
        self.summary = dict(header or {}, limit_s=limit_s, plan_total_s=plan_total(stages), finished=False,
                            parts=[dict(part=p.key, title=p.title, budget_s=p.budget_s, mode=p.mode,
                                        status="pending") for s in stages for p in s])

    # -- summary -----------------------------------------------------------------------------
    def _entry(self, part: Part) -> dict:
        return next(e for e in self.summary["parts"] if e["part"] == part.key)

    def record(self, part: Part, status: str, line: str, **fields) -> None:
        entry = self._entry(part)
        entry.update(status=status, summary=line, **fields)
        self.write()
        self.say(f"({part.key}) {part.title}: {status.upper()} {line}".rstrip())

    def write(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.started, 1)
        done = self.summary["finished"]
        bad = [e["part"] for e in self.summary["parts"]
               if e["status"] in ("fail", "timeout", "interrupted") or (done and e["status"] in ("pending", "running"))
               or (e["status"] == "skipped" and e["mode"] != "extra" and not e.get("unavailable"))]
        self.summary["failed_parts"] = bad
        self.summary["overall"] = "fail" if bad else ("pass" if done else "running")
        write_json_atomic(self.out / "summary.json", self.summary)

    # -- running -----------------------------------------------------------------------------
    def budget_for(self, part: Part, later: list) -> tuple[float, str]:
        """(seconds, "") to run ``part`` now, or (0, why not)."""
        left = self.deadline - time.monotonic()
        if part.mode == "extra":
            spare = left - sum(stage_budget(s) for s in later)
            if spare < part.budget_s:
                return 0.0, f"only {spare:.0f} s to spare before the {self.limit_s:.0f} s limit"
            return part.budget_s, ""
        budget = left if part.mode == "stretch" else min(part.budget_s, left)
        if budget < self.min_run_s:
            return 0.0, f"only {max(left, 0):.0f} s left of the {self.limit_s:.0f} s limit"
        note = "" if budget >= part.budget_s or part.mode == "stretch" else \
            f"budget cut from {part.budget_s:.0f} to {budget:.0f} s by the {self.limit_s:.0f} s limit"
        return budget, note

    def run(self) -> bool:
        """Run every stage; True when no required part failed, overran or was skipped."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.write()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            for i, stage in enumerate(self.stages):
                self.run_stage(stage, self.stages[i + 1:])
        except (_Interrupted, KeyboardInterrupt):
            for part, run in list(self.running.items()):
                _signal_groups([c.proc for c in run["commands"]], signal.SIGKILL)
                del self.running[part]
                self.record(part, "interrupted", "(the check itself was stopped)")
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        self.summary["finished"] = True
        self.write()
        return not self.summary["failed_parts"]

    def _on_signal(self, signum, frame):
        raise _Interrupted(signum)

    def run_stage(self, stage: list, later: list) -> None:
        for part in stage:
            if part.unavailable:
                self.record(part, "skipped", f"({part.unavailable})", unavailable=True)
                continue
            budget, note = self.budget_for(part, later)
            if not budget:
                self.record(part, "skipped", f"({note})", note=note)
                continue
            self.start(part, budget, note)
        while self.running:
            now = time.monotonic()
            for part, run in list(self.running.items()):
                alive = [c for c in run["commands"] if c.alive()]
                if not alive:
                    self.finish(part)
                    continue
                end = run["t0"] + run["budget"]
                if now >= end - min(self.grace_s, run["budget"] / 10) and not run["signalled"]:
                    run["signalled"] = True  # SIGINT first: pytest writes its XML, scripts unwind
                    for c in alive:
                        c.hit = True
                    _signal_groups([c.proc for c in alive], signal.SIGINT)
                if now >= end:
                    for c in alive:
                        c.hit = True
                    _signal_groups([c.proc for c in alive], signal.SIGKILL)
                    for c in alive:
                        c.proc.wait()
                        c.alive()
                    self.finish(part)
            time.sleep(POLL_S)

    def start(self, part: Part, budget: float, note: str) -> None:
        # On disk as running before its processes start: a part that reads summary.json (or a
        # person watching it) never sees itself pending (a race under load, seen in a test run).
        self._entry(part).update(status="running", budget_run_s=round(budget, 1))
        self.write()
        commands = []
        for cmd in part.commands(self.out):
            log = self.out / cmd.log
            with open(log, "w") as f:
                f.write(f"$ {' '.join(map(str, cmd.argv))}\n")
                f.flush()
                try:
                    proc = subprocess.Popen([str(a) for a in cmd.argv], stdout=f, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env={**self.env, **cmd.env},
                                            start_new_session=True, preexec_fn=_child_setup)
                except OSError as e:
                    f.write(f"could not start: {e}\n")
                    proc = None
            commands.append(_Running(cmd, log, proc))
        self.running[part] = dict(commands=commands, t0=time.monotonic(), budget=budget, note=note,
                                  signalled=False)

    def finish(self, part: Part) -> None:
        run = self.running.pop(part)
        _signal_groups([c.proc for c in run["commands"]], signal.SIGKILL)  # anything left in their groups
        outcomes = [c.outcome() for c in run["commands"]]
        timed_out = any(o.killed for o in outcomes)
        try:
            passed, figures, line = part.judge(self.out, outcomes)
        except Exception as e:  # a judge must not stop the run: say what broke
            passed, figures, line = False, {"judge_error": f"{type(e).__name__}: {e}"}, f"(results unreadable: {e})"
        status = "timeout" if timed_out else ("pass" if passed else "fail")
        if timed_out:
            line = f"after {run['budget']:.0f} s, killed; {line}"
        problems = [o for o in outcomes if o.rc != 0 or o.killed] or outcomes[-1:]
        share = max(400, 6000 // max(1, len(problems)))
        fields = dict(seconds=round(time.monotonic() - run["t0"], 1), budget_run_s=round(run["budget"], 1),
                      figures=figures,
                      commands=[dict(argv=" ".join(map(str, o.command.argv)), log=o.command.log, rc=o.rc,
                                     seconds=o.seconds, killed=o.killed) for o in outcomes],
                      log_tail="\n".join(f"== {o.command.log} ==\n{tail(o.log, share)}" for o in problems))
        if run["note"]:
            fields["note"] = run["note"]
        self.record(part, status, line, **fields)
