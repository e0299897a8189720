"""The memory tracker: storages counted once and freed with their last reference, categories,
and the oracle that matters: a meta dry-run rank measures the same memory and traffic as the
same rank really running on the CPU."""
import os

import pytest
import torch
import torch.distributed as dist

from megalite.memory_tracker import MemoryTracker, category, resized
from megalite.testing import run_world

FLAGS = ["--mock-data", "--vocab-size", "300", "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "2", "--track-memory", "--log-interval", "100"]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_storages_counted_once_freed_with_the_last_view(device):
    with MemoryTracker() as m:
        a = torch.ones(1000, device=device)  # 4000 bytes
        view = a[10:]
        del a
        assert m.live == 4000  # the view keeps the storage
        del view
        assert m.live == 0 and m.peak == 4000
        with category("communication"):
            buf = torch.empty(250, device=device)
        assert m.by_category["communication"] == 1000
        buf.untyped_storage().resize_(0)
        resized(buf.untyped_storage())
        assert m.live == 0
    assert m.peak_by_category == {"activations": 4000}


def _real(rank, world, flags):
    from megalite.pretrain import pretrain
    record = pretrain(FLAGS + flags)[-1]
    return record["memory_tracked"], record["comm_bytes_by_group"]


def _meta(monkeypatch, world, rank, flags):
    from megalite.pretrain import pretrain
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    try:
        record = pretrain(["--fake-process-group", "--device", "meta"] + FLAGS + flags)[-1]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return record["memory_tracked"], record["comm_bytes_by_group"]


@pytest.mark.parametrize("world,flags", [
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]),
    (2, ["--zero-stage", "3"]),
    (2, ["--zero-stage", "2", "--recompute-granularity", "full"]),
], ids=["tp2-pp2-sp", "dp2-zero3", "dp2-zero2-recompute"])
def test_meta_rank_measures_what_the_real_rank_allocates(monkeypatch, world, flags):
    real = run_world(_real, world, flags)
    for rank in range(world):
        (memory, comm), (real_memory, real_comm) = _meta(monkeypatch, world, rank, flags), real[rank]
        assert abs(memory["peak"] - real_memory["peak"]) <= 0.05 * real_memory["peak"], (rank, memory, real_memory)
        assert memory["peak_by_category"] == real_memory["peak_by_category"]  # in fact: equal
        assert comm == real_comm, rank  # bytes handed to each group's collectives
        assert memory["peak_by_category"]["activations"] > 0 and memory["peak"] > memory["live"]
