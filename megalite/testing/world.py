"""A fast multi-process harness: run one function on every rank of a gloo world.

``run_world(fn, world_size, *args)`` forks ``world_size`` workers from the already
imported parent (8 ranks start in well under a second; spawning would re-import torch
in each), initializes a gloo process group on loopback in each, calls
``fn(rank, world_size, *args)`` and returns the list of per-rank results (rank order).

Failures never hang the caller:
- an exception in a worker is sent back with its traceback and re-raised here as
  :class:`WorldError` naming the rank;
- a worker that neither returns nor fails within ``timeout`` seconds (a rank stuck
  in a collective) is killed, with every other worker, and reported by rank.

Workers set ``torch.set_num_threads(1)`` before any torch op: forked children can
deadlock in OpenMP when the parent already used threads (see ENV_NOTES).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback


class WorldError(RuntimeError):
    """A worker of a test world failed or hung."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, kwargs, results, env, pg_timeout_s=None):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": env.get(
                           "LOCAL_WORLD_SIZE", str(world_size))})
    try:
        from datetime import timedelta

        extra = {"timeout": timedelta(seconds=pg_timeout_s)} if pg_timeout_s else {}
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, **extra)
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor bytes; the queue's own pickler would hand over
        # shared-memory handles that die with this process. (Trusted: our own child.)
        results.put((rank, "ok", pickle.dumps(value)))
        dist.barrier()  # nobody tears down the store while a peer still uses it
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # Flush the queue's feeder thread, then leave without running atexit handlers
        # inherited from the parent (pytest's, for example).
        results.close()
        results.join_thread()
        os._exit(0)


def run_world(fn, world_size: int, *args, timeout: float = 120.0, env: dict | None = None,
              pg_timeout_s: float | None = None, unawaited: tuple = (), **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on a fresh gloo world; return results.

    ``unawaited``: ranks whose outcome the caller does not need (a rank a test makes hang):
    once every other rank has reported, they are killed and their result is ``None``; an error
    they report before that still fails the world."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, kwargs, results, env, pg_timeout_s),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    awaited = set(range(world_size)) - set(unawaited)
    try:
        while not awaited <= set(outcomes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in outcomes]
                if dead:
                    raise WorldError(f"rank(s) {dead} died (exit codes "
                                     f"{[procs[r].exitcode for r in dead]}) without reporting")
                continue
            if rank in outcomes:
                continue  # a late error after this rank already returned (e.g. in teardown)
            outcomes[rank] = (status, value)
            if status == "error":
                break  # fail fast: peers may now be stuck waiting for this rank
    finally:
        for p in procs:  # an unawaited rank still out: the others' closing barrier cannot complete
            p.join(timeout=2.0 if len(outcomes) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        rank = min(errors)
        raise WorldError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    missing = sorted(awaited - set(outcomes))
    if missing:
        raise WorldError(f"rank(s) {missing} of {world_size} did not finish within {timeout:.0f} s "
                         f"(hung in a collective?); all workers were killed")
    return [pickle.loads(outcomes[r][1]) if r in outcomes else None for r in range(world_size)]
