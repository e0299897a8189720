"""The memory tracker: storages counted once and freed with their last reference, categories,
and the oracle that matters: a meta dry-run rank measures the same memory and traffic as the
same rank really running on the CPU."""
import os

import pytest
import torch
import torch.distributed as dist

from megalite.observe.memory_tracker import MemoryTracker, category, resized
from megalite.testing import run_world

# The real runs use the Triton flash-attention kernel (interpreter): a meta run accounts
# attention as a flash kernel would run on a GPU (q, k, v, output and log-sum-exp kept, never
# the s x s probabilities), so this is the real backend to compare it with. Two layers (one per
# stage at PP 2) and 32 tokens: the interpreted kernel's time grows with both, the comparison
# does not need more (meta and real peaks within 2.4% here, against 4% at 4 layers and 64 tokens).
FLAGS = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "2", "--track-memory", "--log-interval", "100", "--attention-backend", "triton",
         "--attention-dropout", "0"]


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
    from megalite.train.pretrain import pretrain
    record = pretrain(FLAGS + flags)[-1]
    return record["memory_tracked"], record["comm_bytes_by_group"]


def _meta(monkeypatch, world, rank, flags):
    from megalite.train.pretrain import pretrain
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    try:
        record = pretrain(["--fake-process-group", "--device", "meta"] + FLAGS + flags)[-1]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return record["memory_tracked"], record["comm_bytes_by_group"]


# TP2 x PP2: 2 micro-batches per step (global batch 4), as many as 1F1B holds in flight at PP 2, so
# the peak is the one of any longer step; half the Triton-interpreter work of the default 4.
@pytest.mark.parametrize("world,flags", [
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
         "--global-batch-size", "4"]),
    (2, ["--zero-stage", "3"]),
    (2, ["--zero-stage", "2", "--recompute-granularity", "full"]),
], ids=["tp2-pp2-sp", "dp2-zero3", "dp2-zero2-recompute"])
@pytest.mark.slow
def test_meta_rank_measures_what_the_real_rank_allocates(monkeypatch, world, flags):
    real = run_world(_real, world, flags)
    for rank in range(world):
        (memory, comm), (real_memory, real_comm) = _meta(monkeypatch, world, rank, flags), real[rank]
        # The meta rank runs the schedule with no timing; a real gloo rank may still hold one more
        # in-flight pipeline buffer or activation when its peak falls (seen once: 6.2% below, on a
        # loaded machine). So the meta peak is at most 5% above the real one and 8% below it.
        gap = memory["peak"] - real_memory["peak"]
        assert -0.08 * real_memory["peak"] <= gap <= 0.05 * real_memory["peak"], (rank, memory, real_memory)
        for kind, size in real_memory["peak_by_category"].items():  # model state: equal; attention's
            # backward temporaries differ a little (the meta kernel stands in for Triton's)
            assert abs(memory["peak_by_category"].get(kind, 0) - size) <= 0.05 * real_memory["peak"], kind
        assert comm == real_comm, rank  # bytes handed to each group's collectives
        assert memory["peak_by_category"]["activations"] > 0 and memory["peak"] > memory["live"]


@pytest.mark.parametrize("overlap", [[], ["--overlap-grad-reduce"]], ids=["no-overlap", "overlap"])
@pytest.mark.slow
def test_zero2_gradient_memory_does_not_grow_with_micro_batches(monkeypatch, overlap):
    """ZeRO-2 keeps the reduced shard, plus per bucket at most one staging buffer: 8 micro-batches
    must not hold 8 copies of the gradients (the tracker found that they did)."""
    peaks = {}
    for global_batch in ("4", "32"):  # DP 2 x micro 2: 1 and 8 micro-batches per step
        # 4 layers of 64 tokens (meta only, cheap): the 10% allows a staging buffer of a model
        # this size; at 2 layers of 32 tokens the same buffers are 15% of its gradients.
        flags = ["--num-layers", "4", "--seq-length", "64", "--zero-stage", "2", "--global-batch-size", global_batch,
                 *overlap]
        memory, _ = _meta(monkeypatch, 2, 0, [f for f in flags])
        peaks[global_batch] = memory["peak_by_category"]["gradients"]
    assert peaks["32"] <= 1.1 * peaks["4"], peaks


@pytest.mark.slow
def test_dry_run_tool_reports_every_role(tmp_path, capsys):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import dry_run

    out = tmp_path / "plan.json"
    code = dry_run.main(["--world-size", "16", "--gpus-per-node", "8", "--gpu-memory-gb", "80", "--num-layers", "8",
                         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                         "--vocab-size", "500", "--micro-batch-size", "2", "--global-batch-size", "32",
                         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                         "--sequence-parallel", "--zero-stage", "1", "--bf16", "--json", str(out)])
    assert code == 0
    plan = json.load(open(out))
    assert [r["stage"] for r in plan["roles"]] == [0, 1, 2, 3]
    assert plan["roles"][0]["ranks"] == [0, 3] and plan["roles"][3]["ranks"] == [12, 15]
    for role in plan["roles"]:
        assert role["measured_bytes"] > 0 and role["planned_bytes"] > 0 and role["fits"]
        assert {"tp", "pp", "dp"} <= set(role["comm_bytes"])
        assert set(role["categories"]) >= {"parameters", "gradients", "optimizer state", "activations"}
    text = capsys.readouterr().out
    assert "stage 0 (embeddings)" in text and "stage 3 (output and loss)" in text and "bytes per step" in text
