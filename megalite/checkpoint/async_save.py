"""Asynchronous checkpoints (``--async-save``): the training thread only copies the state.

A save has two steps (:mod:`megalite.checkpoint.core`):

1. staging, on the training thread: wait for the previous write (at most one in flight),
   empty ``iter_N.tmp`` (rank 0, then a host barrier: every rank is at the same save point,
   so this is an ordinary collective on the main thread), then copy this rank's tensors
   (:func:`~megalite.checkpoint.core.rank_state`: fp32 master weights and update-rule state of its
   shard, FP8 state, RNG streams) into a host buffer and take metadata.json's values. The
   buffer is allocated at the first save and reused by every later one (one allocation, laid
   out as the file's bytes: :mod:`~megalite.host_memory`). On a GPU the buffer is
   page-locked and filled on a side stream that first waits for the training stream (the
   states as of the end of the step). Only the
   optimizer states are read there (the RNG and FP8 states are host copies already), and only
   the optimizer step changes them, so the training stream waits for the copy just before its
   next optimizer step (:meth:`DistributedOptimizer.wait_before_next_update`), not before the
   next forward: the copy (about 12 bytes per parameter) runs beside the next forward and
   backward. The host waits for nothing;
2. writing and committing, on a writer thread: this rank's safetensors file and description
   (:func:`~megalite.checkpoint.format.write_rank_files`), then, once every rank's files are
   there, rank 0 commits (:func:`~megalite.checkpoint.core.commit_checkpoint`: metadata.json,
   rename, ``latest``, pruning). Both steps are the synchronous save's own functions, so the
   files are the same bytes.

Why a thread, not a process: the staged buffers are plain tensors the thread reads in place
(a process would need them in shared memory, or a second copy of the whole state through a
pipe, and a start-up of its own); the work is file I/O and hashing, whose calls release the
GIL (the safetensors writer is megalite's own for that reason,
:func:`~megalite.checkpoint.format.write_safetensors`), so the training thread keeps running
Python while the thread writes. A crash of the process ends the thread with it, which is what
a checkpoint wants: nothing is committed unless every rank's files were written.

The ranks' writers must agree on when all files are written, but no collective may run
off the main thread (it would interleave with training's collectives on the same groups).
They meet in the rendezvous store instead (``torch.distributed``'s default TCPStore): each
writer adds 1 to a counter when its files are on disk; rank 0's writer polls it, commits,
and sets a ``committed`` key that every other writer polls, so a save is done on every rank
only once it is committed (a rollback that follows :meth:`AsyncCheckpointSaver.wait` reads
the same ``latest`` everywhere). A writer that fails sets a ``failed`` key: the others stop
waiting and fail too. Errors are raised on the training thread, at the next ``poll``,
``wait`` or ``save``.
"""
from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from megalite.checkpoint.core import _coords, checkpoint_metadata, commit_checkpoint, prepare_save, rank_state
from megalite.checkpoint.format import CheckpointError, safetensors_order, write_rank_files
from megalite.host_memory import HostBuffer
from megalite.resilience.fault_injection import active as active_faults

_PREFIX = "megalite/async_ckpt"


def _copy_json(value):
    """A deep copy of JSON-like data (the loop may change its dicts while the write runs)."""
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy_json(v) for v in value]
    return value


def _lower_priority(niceness: int = 10) -> None:
    """Run this (writer) thread at a lower CPU priority: where the host's cores are busy
    (training on the CPU, data workers), the scheduler gives them to the training thread first,
    and the write takes what is left. Linux sets niceness per thread; elsewhere, nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


class AsyncCheckpointSaver:
    """Saves checkpoints in the background, one write at a time (see the module docstring).

    ``save`` returns the directory it will commit; ``poll`` (non-blocking) and ``wait``
    (blocking) return the directories committed since the last call; ``in_flight`` says
    whether a write is running. Host memory: one buffer the size of this rank's checkpoint file
    (12 bytes per parameter element of its optimizer shard, plus RNG and FP8 state), held from
    the first save until ``close``.
    """

    def __init__(self, grid, timeout_s: float = 1800.0, poll_s: float = 0.01, device: torch.device | None = None):
        """``device``: the training device (None: the optimizer's, at the first save)."""
        self.grid, self.timeout_s, self.poll_s, self.device = grid, timeout_s, poll_s, device
        self.rank = _coords(grid)["rank"]
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._host = HostBuffer()  # the staged state, reused from save to save
        self.buffers: dict[str, torch.Tensor] = {}  # its views, by checkpoint key
        self._thread: threading.Thread | None = None
        self._error: tuple[dict, BaseException] | None = None
        self._committed: list[str] = []
        self._lock = threading.Lock()
        self._stream = None
        self._saves = 0
        self._store = None
        if self.world > 1:
            # Every rank adds 1 per saver it builds, so the ranks' n-th savers agree on a number
            # that no earlier saver (this job's, or an earlier attempt's on the same store) used.
            self._store = dist.distributed_c10d._get_default_store()
            self._id = (self._store.add(f"{_PREFIX}/savers", 1) - 1) // self.world
        else:
            self._id = 0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, root: str, iteration: int, optimizer, scaler, config, grid, consumed_samples: int,
             keep_last: int | None = None, tokenizer=None, extra_meta: dict | None = None) -> str:
        """Stage iteration ``iteration``'s checkpoint and start writing it; returns the
        directory it will be committed as. Waits for the write in flight first."""
        self._join()
        if self.device is None:
            self.device = optimizer.device
        final, tmp = prepare_save(root, iteration, grid)
        tensors, pieces = rank_state(optimizer, grid)
        ready = self._stage(tensors)
        if ready is not None:  # the next update changes the states: it waits for their copy (on the device)
            optimizer.wait_before_next_update(ready)
        meta = checkpoint_metadata(iteration, optimizer, scaler, config, grid, consumed_samples) \
            if self.rank == 0 else None
        job = dict(root=root, final=final, tmp=tmp, iteration=iteration, pieces=pieces, ready=ready, meta=meta,
                   config=config, tokenizer=tokenizer, keep_last=keep_last, extra=_copy_json(extra_meta),
                   key=f"{_PREFIX}/{self._id}/{self._saves}")
        self._saves += 1
        self._thread = threading.Thread(target=self._write, args=(job,), name=f"megalite-ckpt-{iteration}",
                                        daemon=True)
        self._thread.start()
        return final

    def poll(self) -> list[str]:
        """The directories committed since the last poll/wait (non-blocking)."""
        if self._thread is not None and not self._thread.is_alive():
            self._join()
        self._raise()
        return self._take()

    def wait(self) -> list[str]:
        """Block until no write is in flight; the directories committed since the last call."""
        self._join()
        return self._take()

    def close(self) -> None:
        """Wait for the write in flight, then free the host buffers."""
        try:
            self._join()
        finally:
            self._free()

    # -- the training thread -------------------------------------------------------------
    def _stage(self, tensors: dict[str, torch.Tensor]):
        """Copy ``tensors`` into the reused host buffer (``self.buffers``: views of one flat
        buffer, laid out in the order of the file's bytes, so the writer writes and hashes it in
        one run); return a CUDA event the writer (and the next optimizer step) waits for, or
        None (training on the host: copied here)."""
        on_gpu = self.device.type == "cuda"
        layout = [(k, tuple(tensors[k].shape), tensors[k].dtype) for k in safetensors_order(tensors)]
        self.buffers = self._host.views(layout, pinned=on_gpu)  # widest dtypes first: each view aligned
        if not on_gpu:
            for key, t in tensors.items():
                self.buffers[key].copy_(t)
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the states as of the end of the step
        with torch.cuda.stream(self._stream):
            for key, t in tensors.items():
                self.buffers[key].copy_(t, non_blocking=True)
                if t.is_cuda:
                    t.record_stream(self._stream)  # a temporary (a cast state) lives until its copy is done
            ready = torch.cuda.Event()
            ready.record(self._stream)
        # No wait of the training stream here: the next forward and backward run beside the copy.
        return ready

    def _free(self) -> None:
        self._host.free()
        self.buffers, self._stream = {}, None

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        failed, self._error = self._error, None
        if failed is not None:
            job, error = failed
            raise CheckpointError(
                f"the asynchronous save of iteration {job['iteration']} ({job['final']}) failed on rank {self.rank}: "
                f"{type(error).__name__}: {error}. Checkpoints committed before it are intact ('latest' names the "
                f"newest); fix the cause (space, permissions of --save) and resume with --load.") from error

    def _take(self) -> list[str]:
        with self._lock:
            done, self._committed = self._committed, []
        return done

    # -- the writer thread -----------------------------------------------------------------
    def _write(self, job: dict) -> None:
        try:
            _lower_priority()
            if job["ready"] is not None:
                # A new thread's current CUDA device is 0: without this, every rank > 0 of a node
                # would open a context (hundreds of MiB) on GPU 0 at its first CUDA call.
                torch.cuda.set_device(self.device)
                job["ready"].synchronize()
            write_rank_files(job["tmp"], self.rank, self.buffers, job["pieces"])
            active_faults().during_save(job["iteration"])  # kill-during-save: files written, not committed
            if self._store is not None:
                self._store.add(f"{job['key']}/written", 1)
            if self.rank == 0:
                self._await(job["key"], lambda: self._store.add(f"{job['key']}/written", 0) >= self.world,
                            "every rank's files")
                commit_checkpoint(job["root"], job["final"], job["meta"], job["config"], job["tokenizer"],
                                  job["keep_last"], job["extra"])
                if self._store is not None:
                    self._store.set(f"{job['key']}/committed", "1")
            else:
                self._await(job["key"], lambda: self._store.check([f"{job['key']}/committed"]), "rank 0's commit")
            with self._lock:
                self._committed.append(job["final"])
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._error = (job, e)
            if self._store is not None:
                try:
                    self._store.set(f"{job['key']}/failed", f"rank {self.rank}: {e}")
                except Exception:  # noqa: BLE001 - the store may be gone with a failed rank
                    pass

    def _await(self, key: str, done, what: str) -> None:
        """Poll the store until ``done()``; a peer's failure or the timeout raises."""
        if self._store is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if self._store.check([f"{key}/failed"]):
                raise CheckpointError(f"a peer's write failed ({self._store.get(f'{key}/failed').decode()}); "
                                      f"nothing committed")
            if time.monotonic() > deadline:
                raise CheckpointError(f"waited {self.timeout_s:.0f} s for {what}; nothing committed")
            time.sleep(self.poll_s)
