"""Turning distributed faults into clear errors: collective timeouts and divergence.

A collective that times out (``--distributed-timeout-minutes``) raises on the ranks that
did arrive. :func:`hang_report` then names the operation and the group this rank was in
(from the last collective it started) and finds the ranks that did not arrive: every
surviving rank marks itself alive in the job's rendezvous store and, after a short grace
period, reads which ranks of the group never did.

Expected failures (a configuration error, missing or corrupt input, a bad checkpoint,
divergence) end with one ``megalite:`` line and an exit code (:func:`report_failure`), also
under torchrun: one rank prints it and records it as the message of torchrun's root cause.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.grid import GROUP_ORDER


class CollectiveTimeout(RuntimeError):
    """A collective did not complete: names the operation, the group and the missing ranks."""


class TrainingDiverged(RuntimeError):
    """The loss or the gradients became NaN/inf in bf16/fp32 training."""


def looks_like_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return any(w in text for w in ("timed out", "timeout", "connection closed", "connection reset",
                                   "broken pipe", "peer"))


def group_name(grid, group) -> tuple[str, list[int]]:
    if group is None:
        return "world", list(range(dist.get_world_size()))
    for kind in GROUP_ORDER:
        if getattr(grid, f"{kind}_group", None) is group:
            return kind, list(getattr(grid, f"{kind}_ranks"))
    try:
        return "custom", dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - a group we cannot name
        return "unknown", []


def hang_report(grid, timeout_s: float, grace_s: float = 3.0) -> CollectiveTimeout:
    kind, group = comm.LAST_COLLECTIVE or ("unknown operation", None)
    name, ranks = group_name(grid, group)
    missing: list[int] = []
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"megalite/alive/{grid.rank}", "1")
        time.sleep(grace_s)
        missing = [r for r in ranks if not store.check([f"megalite/alive/{r}"])]
        store.set(f"megalite/reported/{grid.rank}", "1")
        if grid.rank == 0:  # rank 0 hosts the store: keep it up until the others have read it
            deadline = time.monotonic() + 2 * grace_s
            others = [f"megalite/reported/{r}" for r in ranks if r not in missing]
            while not store.check(others) and time.monotonic() < deadline:
                time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store may be gone with the failed ranks
        missing = []
    who = f"rank(s) {missing} did not arrive" if missing else "the missing ranks could not be determined"
    return CollectiveTimeout(
        f"rank {grid.rank}: {kind} on the {name} group (ranks {ranks}) did not complete within "
        f"{timeout_s:.0f} s: {who}. A rank that does not arrive is usually slow (data loading, a "
        f"checkpoint), crashed, or running a different collective; check its log. "
        f"(--distributed-timeout-minutes sets the limit.)")


class HangWatchdog:
    """Under NCCL a collective that never completes is found by NCCL's own watchdog, which
    dumps its flight recorder and tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING):
    no Python exception reaches :func:`hang_report`. This thread prints megalite's message
    first: when the loop has not called :meth:`beat` for ``timeout_s`` (a little under the
    collective timeout), it names the last collective this rank started and its group, and
    where the flight recorder dump goes. It only prints; NCCL decides about the process."""

    def __init__(self, grid, timeout_s: float, stream=None, poll_s: float = 1.0):
        self.grid, self.timeout_s, self.poll_s = grid, timeout_s, poll_s
        self.stream = stream or sys.stderr
        self.reported = False
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megalite-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()
        self.reported = False

    def message(self, waited_s: float) -> str:
        kind, group = comm.LAST_COLLECTIVE or ("no collective yet", None)
        name, ranks = group_name(self.grid, group)
        dump = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")
        return (f"megalite: rank {self.grid.rank}: no progress for {waited_s:.0f} s; the last collective "
                f"it started was {kind} on the {name} group (ranks {ranks}). A rank of that group is "
                f"probably slow, crashed, or in a different collective. When NCCL's watchdog times "
                f"out it dumps its flight recorder to {dump}<rank> (read them with "
                f"`python -m torch.distributed.flight_recorder.fr_trace`).")

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = time.monotonic() - self._last
            if waited > self.timeout_s and not self.reported:
                self.reported = True
                print(self.message(waited), file=self.stream, flush=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s)


def check_finite(result, iteration: int, fp16: bool) -> None:
    """bf16/fp32: a non-finite loss or gradient stops the run; fp16: the loss scaler skips it."""
    if fp16:
        return
    if not math.isfinite(result.loss) or not math.isfinite(result.grad_norm):
        raise TrainingDiverged(
            f"iteration {iteration}: loss {result.loss}, gradient norm {result.grad_norm}: the run "
            f"diverged (bf16/fp32 training has no loss scaler to skip the step). Fix: resume from the "
            f"last checkpoint with a lower --lr or more --lr-warmup-iters, check the data, or "
            f"use --clip-grad.")


# How long a rank that does not print waits, under torchrun, to be stopped by the agent after
# rank 0's failure; a rank still running then saw the error first and reports it itself.
QUIET_RANK_WAIT_S = 20.0


def write_error_file(path: str, message: str) -> None:
    """torchrun's per-rank error file holding ``message`` alone: the agent's failure summary
    shows an entry's ``py_callstack`` when there is one, else its ``message``; with none
    written, no traceback lines appear there. The timestamp orders the failures (the earliest
    is the summary's root cause)."""
    import json

    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the message was printed; the summary then says <N/A>


def report_failure(kind: str, error: BaseException, code: int, printer: bool,
                   wait_s: float | None = None) -> int:
    """One ``megalite: <kind>: <message>`` line for an expected failure; returns ``code``.

    The printing rank (rank 0 for the errors every rank meets alike) prints it on stderr and,
    under torchrun, writes it into its error file (``TORCHELASTIC_ERROR_FILE``), so torchrun's
    failure summary shows the message as the root cause, without a traceback. Another rank
    prints nothing: without torchrun it returns at once; under torchrun it waits (up to
    ``wait_s``) for the agent, which stops the remaining ranks (SIGTERM) once rank 0 has
    failed, so the summary lists it as a signalled rank without another copy of the message.
    A rank still running after the wait met an error rank 0 did not (or rank 0 is on another
    node, whose agent does not stop this one): it reports it itself. The other local ranks
    wait twice as long as local rank 0, so on such a node local rank 0 reports and the agent
    stops the rest."""
    message = f"megalite: {kind}: {error}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not printer:
        if not error_file:
            return code
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's stop ends the process at once
        wait_s = QUIET_RANK_WAIT_S if wait_s is None else wait_s
        time.sleep(wait_s if os.environ.get("LOCAL_RANK", "0") == "0" else 2 * wait_s)
    print(message, file=sys.stderr, flush=True)
    if error_file:
        write_error_file(error_file, message)
    return code


def bytes_by_group(grid, traffic) -> dict[str, int]:
    """Bytes handed to collectives per group kind (tp, dp, pp, ...), from the comm counter."""
    out: dict[str, int] = {}
    for group, size in traffic.by_group.items():
        name = "world" if group is None else group_name(grid, group)[0]
        out[name] = out.get(name, 0) + size
    return out
