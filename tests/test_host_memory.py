"""The asynchronous saves' host buffer (megalite/host_memory.py), its page-locking
recorded through tests/fake_cuda.py (no GPU needed: the order and sizes are the point)."""
import torch

from megalite.host_memory import HostBuffer
from tests.fake_cuda import FakeCuda

LAYOUT = [("a", (3, 5), torch.float32), ("b", (7,), torch.float32), ("c", (3,), torch.int16)]
BYTES = 15 * 4 + 7 * 4 + 3 * 2


def test_one_exact_registration_reused_until_the_layout_changes(monkeypatch):
    fake = FakeCuda.install(monkeypatch)
    host = HostBuffer()
    views = host.views(LAYOUT, pinned=True)
    assert [tuple(v.shape) for v in views.values()] == [(3, 5), (7,), (3,)] and views["c"].dtype == torch.int16
    first = host.flat.data_ptr()
    assert fake.log == [("cudaHostRegister", first, BYTES, 1)]  # exactly the bytes: no power-of-two block
    assert host.views(list(LAYOUT), pinned=True) is views and len(fake.log) == 1  # reused
    views["a"].fill_(1.0)
    assert host.flat[:60].view(torch.float32).eq(1.0).all()  # views of the one buffer
    host.views(LAYOUT[:2], pinned=True)
    assert fake.log[1] == ("cudaHostUnregister", first) and fake.log[2][0] == "cudaHostRegister"
    host.free()
    assert fake.log[-1][0] == "cudaHostUnregister" and host.flat is None and not host.pinned
    host.free()  # twice is harmless
    assert len(fake.log) == 4


def test_host_training_never_registers(monkeypatch):
    fake = FakeCuda.install(monkeypatch)
    host = HostBuffer()
    host.views(LAYOUT, pinned=False)
    host.free()
    assert fake.log == []


def _dcp_staging(rank, world):
    """A torch_dcp asynchronous save's staging on a 'GPU' run (the optimizer says cuda;
    tensors stay on the host): every box of the state in one registered buffer, reused."""
    import pytest
    from megalite.checkpoint.core import _coords
    from megalite.checkpoint.dcp_state import dcp_state_dict
    from megalite.train.pretrain import build_training_state, setup
    monkeypatch = pytest.MonkeyPatch()
    fake = FakeCuda.install(monkeypatch)
    _, config, _, grid, device = setup(["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size",
                                        "16", "--num-attention-heads", "2", "--seq-length", "8",
                                        "--micro-batch-size", "1", "--global-batch-size", "1"])
    _, optimizer, _ = build_training_state(config, grid, device)
    optimizer.device = torch.device("cuda", 0)
    host = HostBuffer()
    state = dcp_state_dict(optimizer, _coords(grid), config.model.vocab_size, None, host)
    boxes = sum(s.numel() * 4 for k, v in state.items() if "/" in k and not k.startswith(("rng/", "fp8/"))
                for s in (shard.tensor for shard in v.local_shards()))
    dcp_state_dict(optimizer, _coords(grid), config.model.vocab_size, None, host)
    monkeypatch.undo()
    return fake.log, boxes, host.flat.numel()


def test_dcp_staging_uses_one_exact_registered_buffer():
    from megalite.testing import run_world
    log, boxes, flat = run_world(_dcp_staging, 1)[0]
    assert [e[0] for e in log] == ["cudaHostRegister"] and log[0][2] == boxes == flat
