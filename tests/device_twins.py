"""The CPU twins of the ``gpu`` tests: no gpu test runs for the first time on the GPU.

A ``gpu`` test takes its device as a parameter. Its ``cuda`` case carries the ``gpu`` mark
(skipped without a GPU; ``scripts/gpu_check.sh`` selects it with ``-m gpu``) and keeps the
GPU's shapes, dtypes and tolerances. Its ``cpu`` case runs the same test body here, so a
mistake in the test's own logic (an attribute read after ``close()`` set it to None, a wrong
device in an assert) fails on the CPU, not on the GPU machine. On the CPU the Triton kernels
run in the interpreter (conftest.py sets ``TRITON_INTERPRET=1``), in fp16 or fp32 where the GPU
case uses bf16 (the interpreter stores bf16 as raw uint16: silently wrong), on the smallest
shapes that still take the same paths (ragged tiles, several tiles), and the CUDA-only calls
are replaced by the small recording fakes below.

    @pytest.mark.parametrize("device", DEVICES)
    def test_something(device): ...
"""
from __future__ import annotations

import types

import pytest
import torch

CUDA = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)


def cpu(*marks, id: str = "cpu"):
    """The CPU case of a device parameter (``marks``: ``pytest.mark.slow`` for a long one)."""
    return pytest.param("cpu", id=id, marks=marks)


DEVICES = [cpu(), CUDA]


def kernel_device(name: str) -> torch.device:
    """Where a kernel test runs: ``cuda``, the current GPU with the kernels compiled (skipped
    when TRITON_INTERPRET=1 was set at import: the interpreter would run them on host copies of
    the CUDA tensors); ``cpu``, the CPU with the kernels in the interpreter."""
    from megalite.kernels._utils import INTERPRET

    if name == "cuda":
        if INTERPRET:
            pytest.skip("TRITON_INTERPRET=1 was set when megalite.kernels was imported: the kernels run in "
                        "the CPU interpreter. Run with TRITON_INTERPRET=0 (scripts/gpu_check.sh does).")
        return torch.device("cuda", torch.cuda.current_device())
    if not INTERPRET:
        pytest.skip("the CPU case runs the Triton kernels in the interpreter: TRITON_INTERPRET=1 "
                    "(conftest.py's default)")
    return torch.device("cpu")


class FakeSyncDebugMode:
    """``torch.cuda.set_sync_debug_mode`` and ``torch.cuda.synchronize`` for a CPU case.

    Mode ``"error"`` starts counting the host reads made from megalite's code
    (:func:`megalite.observe.host_syncs.count_host_syncs`: the reads that would synchronize a GPU,
    the synchronizing operators of torch's C++ code such as ``nonzero`` included); mode 0
    stops and raises ``RuntimeError`` naming them, where the real mode raises at the
    synchronizing call itself. What the counter cannot see on a CPU (its module docstring:
    an operator that syncs only in its CUDA code and is not on its list, a path taken on a
    GPU only) only the GPU case sees. ``modes`` and ``synchronized`` record the calls."""

    def __init__(self):
        self.modes: list = []
        self.synchronized = 0
        self.reads: list[str] = []
        self._counting = None

    def set_sync_debug_mode(self, mode) -> None:
        from megalite.observe.host_syncs import count_host_syncs

        self.modes.append(mode)
        if mode in ("error", 2, "warn", 1):
            if self._counting is None:
                self._counting = count_host_syncs()
                self.reads = self._counting.__enter__()
            return
        if self._counting is not None:
            counting, self._counting = self._counting, None
            counting.__exit__(None, None, None)
            if self.reads:
                raise RuntimeError(f"called a synchronizing CUDA operation: {self.reads} (host reads "
                                   f"made from megalite's code under sync debug mode)")

    def synchronize(self, device=None) -> None:
        self.synchronized += 1

    @classmethod
    def install(cls, monkeypatch) -> "FakeSyncDebugMode":
        fake = cls()
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", fake.set_sync_debug_mode)
        monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
        return fake


class FakeCudaClock:
    """One simulated CUDA stream with a clock, for code that times the GPU with events.

    ``torch.cuda._sleep(cycles)`` advances the stream's clock by ``cycles / clock_rate``;
    ``torch.cuda.Event(enable_timing=True).record()`` stamps the stream's time;
    ``elapsed_time`` gives milliseconds between two stamps, and, as CUDA does, raises while
    either event is unrecorded or not yet known complete (an event is complete once it, or
    one recorded after it, was synchronized or queried). ``get_device_properties`` reports
    ``clock_rate`` in kHz. ``synchronizations`` counts the host waits."""

    CLOCK_KHZ = 1_980_000  # an H200's 1980 MHz

    def __init__(self):
        self.now_s = 0.0
        self.recorded = 0      # events recorded so far (their order on the stream)
        self.completed = 0     # events known complete (the first ``completed`` recorded ones)
        self.synchronizations = 0
        self.events: list["FakeCudaClock.Event"] = []

    def sleep(self, cycles: int) -> None:
        self.now_s += int(cycles) / (self.CLOCK_KHZ * 1e3)

    def device_properties(self, device=None):
        return types.SimpleNamespace(clock_rate=self.CLOCK_KHZ, name="fake CUDA clock")

    def synchronize(self, device=None) -> None:
        self.synchronizations += 1
        self.completed = self.recorded

    def event_class(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        event = FakeCudaClock.Event(self, enable_timing)
        self.events.append(event)
        return event

    class Event:
        def __init__(self, clock: "FakeCudaClock", enable_timing: bool):
            self.clock, self.enable_timing = clock, enable_timing
            self.order, self.time_s = None, None

        def record(self, stream=None) -> None:
            self.clock.recorded += 1
            self.order, self.time_s = self.clock.recorded, self.clock.now_s

        def _done(self) -> bool:
            return self.order is not None and self.order <= self.clock.completed

        def synchronize(self) -> None:
            if self.order is None:
                return
            self.clock.synchronizations += 1
            self.clock.completed = max(self.clock.completed, self.order)

        def query(self) -> bool:  # the simulated stream has run everything queued: done
            if self.order is not None:
                self.clock.completed = max(self.clock.completed, self.order)
            return True

        def elapsed_time(self, end: "FakeCudaClock.Event") -> float:
            if not (self.enable_timing and end.enable_timing):
                raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
            if self.order is None or end.order is None:
                raise RuntimeError("Both events must be recorded before calculating elapsed time.")
            if not (self._done() and end._done()):
                raise RuntimeError("CUDA error: device not ready (an event read before it completed)")
            return (end.time_s - self.time_s) * 1e3

    @classmethod
    def install(cls, monkeypatch) -> "FakeCudaClock":
        clock = cls()
        monkeypatch.setattr(torch.cuda, "Event", clock.event_class)
        monkeypatch.setattr(torch.cuda, "_sleep", clock.sleep)
        monkeypatch.setattr(torch.cuda, "get_device_properties", clock.device_properties)
        monkeypatch.setattr(torch.cuda, "synchronize", clock.synchronize)
        return clock


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: ``torch.cuda.synchronize`` on a GPU, nothing on the
    CPU (where every op has finished when it returns)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_cases(cpu_cases, cuda_cases, ids) -> list:
    """Parameters ``(device, *case)``: each of ``cpu_cases`` on "cpu", each of ``cuda_cases`` on
    "cuda" with the ``gpu`` mark; ``ids(case)`` names a case (the device is put in front). A
    case may be a ``pytest.param`` already (its marks are kept: ``slow`` on a long CPU case)."""
    out = []
    for device, cases in (("cpu", cpu_cases), ("cuda", cuda_cases)):
        for case in cases:
            is_param = hasattr(case, "values") and hasattr(case, "marks")  # a pytest.param
            marks = list(case.marks) if is_param else []
            values = tuple(case.values) if is_param else tuple(case)
            if device == "cuda":
                marks.append(pytest.mark.gpu)
            out.append(pytest.param(device, *values, id=f"{device}-{ids(values)}", marks=marks))
    return out
