"""A recording stand-in for the ``torch.cuda`` calls whose *order* is the point of a test.

On a CPU machine the code under test still takes its GPU branch (it is told its device is
``cuda``), while every tensor stays on the host: copies run at once, and each stream, event,
device and page-locking call is appended to ``log`` as a tuple, with the name of the thread that
made it. A test then asserts what waited for what, on which thread, before what. It checks
ordering only: what the device would compute is checked on a GPU (the ``gpu``-marked twin).

    fake = FakeCuda.install(monkeypatch)
    ... run the code ...
    assert fake.index(("main", "wait_event", 1)) < fake.index(("update",))
"""
from __future__ import annotations

import contextlib
import itertools
import threading

import torch


def _thread() -> str:
    return "main-thread" if threading.current_thread() is threading.main_thread() else "other-thread"


class FakeStream:
    def __init__(self, fake: "FakeCuda", name: str):
        self.fake, self.name = fake, name

    def wait_stream(self, other: "FakeStream") -> None:
        self.fake.record(self.name, "wait_stream", other.name)

    def wait_event(self, event: "FakeEvent") -> None:
        self.fake.record(self.name, "wait_event", event.id)

    def synchronize(self) -> None:
        self.fake.record(self.name, "synchronize", _thread())


class FakeEvent:
    def __init__(self, fake: "FakeCuda", *args, **kwargs):
        self.fake, self.id = fake, next(fake.ids)

    def record(self, stream: FakeStream | None = None) -> None:
        self.fake.record("event", self.id, "recorded on", (stream or self.fake.current).name)

    def synchronize(self) -> None:
        self.fake.record("event", self.id, "synchronize", _thread(), self.fake.device_of_thread())

    def query(self) -> bool:
        return True


class FakeCudart:
    def __init__(self, fake: "FakeCuda"):
        self.fake = fake

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.fake.record("cudaHostRegister", ptr, size, flags)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - CUDA's name
        self.fake.record("cudaHostUnregister", ptr)
        return 0


class FakeCuda:
    """The fake's state: the log, the streams, each thread's current device."""

    def __init__(self):
        self.log: list[tuple] = []
        self.ids = itertools.count(1)
        self.main = FakeStream(self, "main")
        self.current = self.main
        self.side_streams = 0
        self._devices: dict[str, object] = {}
        self._lock = threading.Lock()

    def record(self, *entry) -> None:
        with self._lock:
            self.log.append(entry)

    def index(self, entry: tuple) -> int:
        """Position of ``entry`` in the log (ValueError names the log when it is missing)."""
        try:
            return self.log.index(entry)
        except ValueError:
            raise AssertionError(f"{entry} not in the log: {self.log}") from None

    def device_of_thread(self):
        return self._devices.get(_thread(), "cuda:0 (the default of a new thread)")

    # -- what replaces torch.cuda's attributes ---------------------------------------------------
    def stream_class(self, device=None, priority: int = 0) -> FakeStream:
        self.side_streams += 1
        return FakeStream(self, "side" if self.side_streams == 1 else f"side{self.side_streams}")

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous, self.current = self.current, stream
        self.record("enter", stream.name)
        try:
            yield
        finally:
            self.current = previous
            self.record("exit", stream.name)

    def set_device(self, device) -> None:
        device = torch.device(device)
        self._devices[_thread()] = str(device)
        self.record("set_device", str(device), _thread())

    @classmethod
    def install(cls, monkeypatch) -> "FakeCuda":
        fake = cls()
        monkeypatch.setattr(torch.cuda, "Stream", fake.stream_class)
        monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
        monkeypatch.setattr(torch.cuda, "stream", fake.stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(fake, *a, **k))
        monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
        cudart = FakeCudart(fake)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        return fake
