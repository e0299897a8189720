"""A file's independent one-process checks, two at a time, in forks of the test process.

The suite runs one test at a time on a 2-core machine: a test whose work runs in the pytest
process itself (a meta dry run of a recipe, the planner's search, for example: one core for 1-25 s)
leaves the other core idle. :class:`SideBySide`, started by a module's fixture, hands every case of
one test function that this session selected (``-m``, ``-k`` and node ids respected) to forked
workers, one per core up to ``MAX_WORKERS``, which take the cases in order as they come free; each
test then waits for its own case's value and makes its assertions on it, as it did on the value the
same function returned in the test process. The work and the assertions are the same; only their
order in time changes.

A worker is a fork of the test process (its imports done; no new interpreter) and an ordinary
(non-daemonic) process, so a case may start processes of its own (a forked world, a tool's pool).
It runs its cases one after another, as the test process ran them, each setting up and tearing down
its own process group and environment, and each starting from the process-wide torch state the
test process had (tests/process_state.py, what tests/conftest.py restores around every test). An exception in a case comes back with its traceback and
fails that case's test, and only that one; a worker that dies fails the tests still waiting on it.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback

from tests import process_state

MAX_WORKERS = 2  # the CI machine's cores (README: a 2-core machine)
RESULT_TIMEOUT_S = 900.0


def selected_cases(request, function_name: str, names: tuple[str, ...]) -> list[tuple]:
    """The parameter tuples (``names`` of its parametrize) of the items of ``function_name`` in this
    module that the session will run, in the order it runs them."""
    cases = []
    for item in request.session.items:
        if getattr(item, "originalname", None) == function_name and getattr(item, "module", None) is request.module:
            case = tuple(item.callspec.params[n] for n in names)
            if case not in cases:
                cases.append(case)
    return cases


def _serve(fn, tasks, results):
    """A worker: run each (index, case) it is handed until None; send back (index, status, value)."""
    for index, case in iter(tasks.get, None):
        saved = process_state.save()  # each case starts from the state the test process had, as a test does
        try:
            outcome = ("ok", pickle.dumps(fn(*case)))
        except BaseException:  # noqa: BLE001 - the test that asked for this case reports it
            outcome = ("error", traceback.format_exc())
        finally:
            process_state.restore(saved)
        results.put((index, *outcome))
    results.close()
    results.join_thread()
    os._exit(0)  # no atexit handler inherited from the test process (pytest's) runs here


class SideBySide:
    """``fn(*case)`` for every case, handed at once to the workers; :meth:`result` waits for one."""

    def __init__(self, fn, cases: list[tuple]):
        self.fn, self.cases, self.done = fn, list(cases), {}
        ctx = multiprocessing.get_context("fork")
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        workers = min(MAX_WORKERS, len(self.cases), len(os.sched_getaffinity(0)))
        for index, case in enumerate(self.cases):
            self.tasks.put((index, case))
        for _ in range(workers):
            self.tasks.put(None)
        self.workers = [ctx.Process(target=_serve, args=(fn, self.tasks, self.results)) for _ in range(workers)]
        for worker in self.workers:
            worker.start()

    def result(self, *case):
        """The case's value; a case nobody started (not selected at setup) runs here."""
        if case not in self.cases:
            return self.fn(*case)
        index = self.cases.index(case)
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while index not in self.done:
            try:
                got, status, value = self.results.get(timeout=1.0)
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in self.workers) and self.results.empty():
                    raise AssertionError(f"{self.fn.__name__}{case}: a worker process died (exit codes "
                                         f"{[w.exitcode for w in self.workers]}) before this case's result "
                                         f"reached the test: the case that killed it fails the same way; "
                                         f"run this test alone to see whether it is the one") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.fn.__name__}{case}: no result within {RESULT_TIMEOUT_S:.0f} s") from None
                continue
            self.done[got] = (status, value)
        status, value = self.done[index]
        if status == "error":
            raise AssertionError(f"{self.fn.__name__}{case} failed in its worker process:\n{value}")
        return pickle.loads(value)

    def close(self) -> None:
        for worker in self.workers:
            worker.join(timeout=0.5)
            if worker.is_alive():
                worker.kill()
                worker.join()
