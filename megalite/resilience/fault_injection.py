"""Injected faults, for tests and for an operator's recovery drills (``--inject-fault``).

A fault is written ``KIND@ITER[:RANK][=VALUE]``: it strikes iteration ``ITER`` (1-based, as
the log numbers iterations) on global rank ``RANK`` (every rank when omitted). The kinds:

==================  ===============================================================  ==========
kind                what happens                                                     VALUE
==================  ===============================================================  ==========
``nan``             the first micro-batch's loss mask becomes NaN: loss and          -
                    gradients are NaN (a flipped bit, a bad kernel)
``spike``           the first micro-batch's loss, and so its gradients, are          factor,
                    multiplied by VALUE (a bad batch)                                1000
``slow``            the rank sleeps VALUE seconds at the start of the step's         seconds,
                    compute (on a GPU the device sleeps): a straggler                1.0
``hang``            the rank sleeps VALUE seconds before the step: its peers wait    seconds,
                    in their next collective (a hung rank)                           3600
``kill``            the rank ends with SIGKILL after the step (a dead node)          -
``kill-during-save`` the rank ends with SIGKILL after writing its files of the       -
                    checkpoint saved at ITER, before the commit
==================  ===============================================================  ==========

``nan`` and ``spike`` act where the loss is computed: on the last pipeline stage (a rank of
another stage reads the loss mask but never uses it). Each fault strikes once per process: a rollback that replays its iteration does not meet
it again (as a bad batch, skipped, is not met again). Under torchrun faults strike only in
the job's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so the restarted job can finish.
"""
from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import torch

from megalite.errors import ConfigError

KINDS = ("nan", "spike", "slow", "hang", "kill", "kill-during-save")
DEFAULT_VALUE = {"spike": 1000.0, "slow": 1.0, "hang": 3600.0}
_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<iteration>\d+)(?::(?P<rank>\d+))?(?:=(?P<value>[0-9.eE+-]+))?$")

# The batch key that carries a spike's factor to the loss (megalite.train.step.stage_loss).
LOSS_FACTOR = "injected_loss_factor"


@dataclass(frozen=True)
class Fault:
    kind: str
    iteration: int
    rank: int | None = None
    value: float | None = None

    def __str__(self) -> str:
        rank = "" if self.rank is None else f":{self.rank}"
        value = "" if self.value is None else f"={self.value:g}"
        return f"{self.kind}@{self.iteration}{rank}{value}"


def parse_fault(text: str) -> Fault:
    """One ``KIND@ITER[:RANK][=VALUE]`` spec; a :class:`ConfigError` naming the rule otherwise."""
    match = _SPEC.match(text.strip())
    rule = (f"--inject-fault {text!r}: expected KIND@ITER[:RANK][=VALUE] with KIND one of "
            f"{', '.join(KINDS)}, ITER >= 1 (e.g. nan@7, slow@3:1=0.5, kill@10:2)")
    if match is None:
        raise ConfigError(rule)
    kind, iteration = match["kind"], int(match["iteration"])
    if kind not in KINDS:
        raise ConfigError(f"{rule}; {kind!r} is not a fault kind")
    if iteration < 1:
        raise ConfigError(f"{rule}; iterations count from 1")
    value = None
    if match["value"] is not None:
        if kind not in DEFAULT_VALUE:
            raise ConfigError(f"{rule}; {kind} takes no =VALUE (only {', '.join(DEFAULT_VALUE)} do)")
        try:
            value = float(match["value"])
        except ValueError:
            raise ConfigError(f"{rule}; {match['value']!r} is not a number") from None
        if not value > 0:
            raise ConfigError(f"{rule}; =VALUE must be positive")
    return Fault(kind, iteration, None if match["rank"] is None else int(match["rank"]), value)


def parse_faults(texts) -> list[Fault]:
    return [parse_fault(t) for t in texts or ()]


def check_fault_ranks(faults: list[Fault], world_size: int) -> None:
    for f in faults:
        if f.rank is not None and f.rank >= world_size:
            raise ConfigError(f"--inject-fault {f}: rank {f.rank} does not exist in a world of {world_size} "
                              f"ranks (ranks 0..{world_size - 1}).")


class FaultInjector:
    """This rank's faults; each method strikes the faults of its kind due at ``iteration``."""

    def __init__(self, faults: list[Fault], rank: int, first_attempt: bool | None = None):
        if first_attempt is None:
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.pending = [f for f in faults if f.rank in (None, rank)] if first_attempt else []
        self.struck: list[Fault] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def take(self, kind: str, iteration: int) -> Fault | None:
        """The fault of ``kind`` due at ``iteration``, removed (it strikes once), or None."""
        for f in list(self.pending):  # a copy: the checkpoint writer's thread takes its kind concurrently
            if f.kind == kind and f.iteration == iteration:
                self.pending.remove(f)
                self.struck.append(f)
                return f
        return None

    def due(self, kind: str, iteration: int) -> bool:
        """Whether a fault of ``kind`` will strike at ``iteration`` (not taken)."""
        return any(f.kind == kind and f.iteration == iteration for f in self.pending)

    def value(self, fault: Fault) -> float:
        return fault.value if fault.value is not None else DEFAULT_VALUE[fault.kind]

    def before_step(self, iteration: int) -> None:
        """``hang``: sleep before the step (the data included), so peers wait in a collective."""
        fault = self.take("hang", iteration)
        if fault is not None:
            time.sleep(self.value(fault))

    def slow_compute(self, iteration: int, device: torch.device) -> None:
        """``slow``: this rank's compute takes VALUE seconds longer. On a GPU the device sleeps
        (``torch.cuda._sleep``), so CUDA-event timings see it; on a CPU the host does."""
        fault = self.take("slow", iteration)
        if fault is None:
            return
        seconds = self.value(fault)
        if device.type == "cuda":
            torch.cuda._sleep(int(seconds * _cycles_per_second(device)))
        else:
            time.sleep(seconds)

    def corrupt(self, iteration: int, micro_batches: list[dict]) -> list[dict]:
        """``nan`` and ``spike``: the first micro-batch's loss goes NaN or is multiplied."""
        if not micro_batches:
            return micro_batches
        first = micro_batches[0]
        if self.take("nan", iteration) is not None:
            first = {**first, "loss_mask": first["loss_mask"] * float("nan")}
        fault = self.take("spike", iteration)
        if fault is not None:
            first = {**first, LOSS_FACTOR: torch.tensor(self.value(fault), device=first["loss_mask"].device)}
        return [first, *micro_batches[1:]]

    def after_step(self, iteration: int) -> None:
        if self.take("kill", iteration) is not None:
            os.kill(os.getpid(), signal.SIGKILL)

    def during_save(self, iteration: int) -> None:
        """``kill-during-save``: called by the checkpoint writer between this rank's files and
        the commit of iteration ``iteration``'s checkpoint."""
        if self.take("kill-during-save", iteration) is not None:
            os.kill(os.getpid(), signal.SIGKILL)


_CLOCKS: dict[int, float] = {}  # cycles per second, per GPU index: calibrated once per process


def _cycles_per_second(device: torch.device) -> float:
    """The GPU's clock, measured once per device: ``torch.cuda._sleep`` counts cycles, and torch
    exposes no clock rate without pynvml. Two sleeps, of 2x10^6 and 10^7 cycles, each between
    CUDA events: each timed window also holds the sleep kernel's launch (microseconds, which a
    single short window would count as sleep), so the rate is the *difference* in cycles over
    the difference in time, in which the fixed launch cost cancels. One host sync, at the first
    ``slow`` fault only (later faults reuse the rate)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CLOCKS:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        for k, cycles in enumerate((2_000_000, 10_000_000)):
            events[2 * k].record()
            torch.cuda._sleep(cycles)
            events[2 * k + 1].record()
        events[3].synchronize()
        short, long = events[0].elapsed_time(events[1]), events[2].elapsed_time(events[3])  # ms
        _CLOCKS[index] = 8_000_000 / max((long - short) / 1e3, 1e-6)
    return _CLOCKS[index]


# The process's injector, set by pretrain (the checkpoint writer reaches it from here).
_ACTIVE = FaultInjector([], 0)


def set_active(injector: FaultInjector) -> None:
    global _ACTIVE
    _ACTIVE = injector


def active() -> FaultInjector:
    return _ACTIVE
