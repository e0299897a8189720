"""Asynchronous torch_dcp checkpoints: ``--async-save --ckpt-format torch_dcp``.

:class:`AsyncDcpSaver` has :class:`megalite.checkpoint.async_save.AsyncCheckpointSaver`'s
interface (``save``/``poll``/``wait``/``close``/``in_flight``). ``save`` copies this rank's
state (its boxes of the global tensors, RNG, FP8) into one host buffer reused from save to save
(page-locked on CUDA at its exact size: :mod:`megalite.host_memory`), on the main thread, then hands the copy to ``dcp.async_save`` (DCP's
thread executor: the write is file I/O and pickling, which release the GIL, and a thread
shares the staged buffers without a copy into another process). Staging is ours, so DCP's
stager is told to pass the state through.

DCP's save coordinates ranks with collectives (plan gather, the final write-result
reduce). They run in the writer thread, so they must not share a communicator with
training's collectives on the main thread: the saver makes its own gloo group at
construction (a collective call: every rank constructs the saver at the same point). After
DCP's save returns (every rank's files and DCP's ``.metadata`` are on disk), the writer
thread calls the fault injector's ``during_save``, waits for every rank on that same group,
and rank 0 commits (metadata.json, rename, ``latest``, ``keep_last``); a second wait lets
every rank report the committed directory at the same poll. A failure in the thread (a
peer killed mid-write breaks the group's wait) is re-raised on the main thread at the next
``poll``/``wait``/``save``; the ``.tmp`` directory stays uncommitted and ``--load`` takes
the previous checkpoint.
"""
from __future__ import annotations

import threading

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megalite.checkpoint.core import _coords
from megalite.checkpoint.dcp_state import checkpoint_metadata, commit, dcp_state_dict, prepare_tmp
from megalite.checkpoint.format import iteration_dir
from megalite.host_memory import HostBuffer


class _PassThrough:
    """DCP's AsyncStager protocol for a state dict that is already a private host copy."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncDcpSaver:
    """At most one torch_dcp write in flight; ``save`` returns once the state is copied."""

    def __init__(self, grid):
        self.grid = grid
        distributed = grid is not None and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if distributed else None
        self._buffers = HostBuffer()  # reused host copies of this rank's boxes
        self._event: threading.Event | None = None
        self._final: str | None = None
        self._error: BaseException | None = None
        self._committed: list[str] = []  # committed, not yet reported by poll/wait

    @property
    def in_flight(self) -> bool:
        return self._event is not None and not self._event.is_set()

    def _settle(self) -> None:
        """Take in the finished write (its event is set): record its directory or re-raise its error."""
        final, error = self._final, self._error
        self._event, self._final, self._error = None, None, None
        if error is not None:
            raise error
        self._committed.append(final)

    def _report(self) -> list[str]:
        done, self._committed = self._committed, []
        return done

    def poll(self) -> list[str]:
        """Directories committed since the last poll/wait (no blocking)."""
        if self._event is not None and self._event.is_set():
            self._settle()
        return self._report()

    def wait(self) -> list[str]:
        """Block until nothing is in flight; the directories committed since the last poll."""
        if self._event is not None:
            self._event.wait()
            self._settle()
        return self._report()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._buffers.free()

    def save(self, root: str, iteration: int, optimizer, scaler, config, grid, consumed_samples: int,
             keep_last: int | None = None, tokenizer=None, extra_meta: dict | None = None) -> str:
        """Stage this rank's state and start writing it; returns the directory it will commit.
        Waits for the previous write first (its buffers are reused)."""
        from megalite.resilience.fault_injection import active

        if self._event is not None:
            self._event.wait()
            self._settle()  # its directory is reported at the next poll
        c = _coords(grid)
        final = iteration_dir(root, iteration)
        tmp = prepare_tmp(final, c["rank"], grid)
        state = dcp_state_dict(optimizer, c, config.model.vocab_size, self._group, self._buffers)
        meta = checkpoint_metadata(iteration, optimizer, scaler, config, c, consumed_samples, extra_meta)
        event, group = threading.Event(), self._group
        self._event, self._final = event, final

        def after_write(future) -> None:  # in DCP's writer thread
            try:
                future.result()
                active().during_save(iteration)
                if group is not None:
                    dist.barrier(group=group)  # every rank's files and DCP's .metadata are written
                if c["rank"] == 0:
                    commit(root, tmp, final, meta, config, tokenizer, keep_last)
                if group is not None:
                    dist.barrier(group=group)  # committed: every rank reports it at the same poll
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                self._error = e
            finally:
                event.set()

        future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=group,
                                async_stager=_PassThrough(), no_dist=group is None)
        future.add_done_callback(after_write)
        return final
