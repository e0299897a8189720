"""``--profile``: a torch.profiler trace per rank over iterations [start, end], and a summary
of compute against communication time per rank.

The trace is Chrome trace format (open it in chrome://tracing or Perfetto), one file per
rank: ``PROFILE_DIR/trace_rankXXX.json``. Communication is every profiled operation whose
name belongs to a collective or point-to-point transfer (gloo, NCCL, c10d); compute is the
rest of the self time.
"""
from __future__ import annotations

import os

import torch

from megalite.run_settings import LoggingSettings

COMM_WORDS = ("gloo", "nccl", "c10d", "all_reduce", "allreduce", "all_gather", "allgather",
              "reduce_scatter", "broadcast", "send", "recv", "barrier")


def split_compute_comm(key_averages) -> tuple[float, float]:
    """(compute_ms, communication_ms) of self CPU (+CUDA) time."""
    compute = comm = 0.0
    for event in key_averages:
        t = event.self_cpu_time_total + getattr(event, "self_device_time_total", 0.0)
        if any(w in event.key.lower() for w in COMM_WORDS):
            comm += t
        else:
            compute += t
    return compute / 1e3, comm / 1e3


class Profiler:
    """One rank's profile of iterations [``log.profile_step_start``, ``log.profile_step_end``],
    written to ``log.profile_dir``."""

    def __init__(self, log: LoggingSettings, rank: int):
        self.start, self.end, self.rank = log.profile_step_start, log.profile_step_end, rank
        self.directory = log.profile_dir
        self.prof = None

    def step(self, iteration: int) -> None:
        """Call at the start of each iteration (1-based)."""
        if iteration == self.start and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=False)
            self.prof.__enter__()
        elif iteration == self.end + 1 and self.prof is not None:
            self.finish()

    def finish(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"trace_rank{self.rank:03d}.json")
        self.prof.export_chrome_trace(path)
        compute, comm = split_compute_comm(self.prof.key_averages())
        total = max(compute + comm, 1e-9)
        print(f"profile rank {self.rank} (iterations {self.start}-{self.end}): compute {compute:.1f} ms, "
              f"communication {comm:.1f} ms ({100 * comm / total:.1f}%); trace {path}", flush=True)
        self.prof = None
