"""A file's independent one-process checks, two at a time, in forks of the test process.

The suite runs one test at a time on a 2-core machine: a test whose work runs in the pytest
process itself (a meta dry run of a recipe, for example: one core for 1-25 s) leaves the other
core idle. :class:`SideBySide` starts, when a module's fixture asks for it, every case of one test
function that this session selected (``-m``, ``-k`` and node ids respected) on a pool of forked
workers, one per core up to ``MAX_WORKERS``; each test then waits for its own case's result and
makes its assertions on it, as it did on the value the same function returned in the test process.
The work and the assertions are the same; only their order in time changes.

A worker is a fork of the test process (its imports done; no new interpreter): it runs its cases one
after another, as the test process ran them, with the process group and environment each case sets
up and tears down itself. An exception in a case comes back with its traceback and fails that
case's test, and only that one.
"""
from __future__ import annotations

import multiprocessing
import os
import traceback

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


def _run_case(fn, case):
    try:
        return "ok", fn(*case)
    except BaseException:  # noqa: BLE001 - the test that asked for this case reports it
        return "error", traceback.format_exc()


class SideBySide:
    """``fn(*case)`` for every case, started at once on the pool; :meth:`result` waits for one."""

    def __init__(self, fn, cases: list[tuple]):
        self.fn = fn
        workers = max(1, min(MAX_WORKERS, len(cases), len(os.sched_getaffinity(0))))
        self.pool = multiprocessing.get_context("fork").Pool(workers) if cases else None
        self.pending = {case: self.pool.apply_async(_run_case, (fn, case)) for case in cases}

    def result(self, *case):
        """The case's value; a case nobody started (not selected at setup) runs here."""
        if case not in self.pending:
            return self.fn(*case)
        status, value = self.pending[case].get(timeout=RESULT_TIMEOUT_S)
        if status == "error":
            raise AssertionError(f"{self.fn.__name__}{case} failed in its worker process:\n{value}")
        return value

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
