"""Asynchronous checkpoints (--async-save): the saver alone, then through pretrain."""
import filecmp
import os
import time

import pytest
import torch

from megalite.testing import WorldError, run_world

BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100",
        "--adam-eps", "1e-5"]


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _same_files(a, b):
    names = _tree(a)
    assert names == _tree(b)
    return [n for n in names if not filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)]


def _build(argv):
    """A model and its optimizer as pretrain builds them (no training)."""
    from megalite.parallel.random import model_parallel_seed
    from megalite.pipeline.partition import build_model_chunks
    from megalite.pretrain import setup
    from megalite.training import LossScaler, build_data_parallel_optimizer
    args, config, tokenizer, grid, device = setup(argv)
    t = config.train
    model_parallel_seed(t.seed, grid, device)
    model = build_model_chunks(config, grid, device)
    for chunk in model:
        chunk.init_weights(t.seed)
    optimizer = build_data_parallel_optimizer(model, t, grid)
    for i, m in enumerate(optimizer.exp_avg):  # moments that differ from the weights
        m.copy_(torch.randn(m.shape, generator=torch.Generator().manual_seed(i)))
    return config, tokenizer, grid, optimizer, LossScaler(t.fp16, t.initial_loss_scale, t.loss_scale)


def _saver_unit(rank, world, tmp, flags):
    from megalite.checkpoint.async_save import AsyncCheckpointSaver
    from megalite.checkpoint.core import save_checkpoint
    from megalite.checkpoint.format import CheckpointError
    config, tokenizer, grid, optimizer, scaler = _build(BASE + flags + ["--train-iters", "4", "--save", tmp])
    extra = {"skipped_batches": [[7, 7]], "data_batches": 12}
    a, b = os.path.join(tmp, "sync"), os.path.join(tmp, "async")
    save_checkpoint(a, 3, optimizer, scaler, config, grid, 24, None, tokenizer, extra)
    saver = AsyncCheckpointSaver(grid)
    final = saver.save(b, 3, optimizer, scaler, config, grid, 24, None, tokenizer, extra)
    buffers = {k: v.data_ptr() for k, v in saver.buffers.items()}
    extra["skipped_batches"].append([9, 9])  # the caller's dict and the states change during the write
    for m in optimizer.master:
        m.add_(1.0)
    assert saver.wait() == [final] and not saver.in_flight and saver.poll() == []
    # A second save reuses the host buffers (no reallocation).
    saver.save(b, 4, optimizer, scaler, config, grid, 32, 2, tokenizer, extra)
    reused = all(saver.buffers[k].data_ptr() == p for k, p in buffers.items())
    done = []
    while not done:
        time.sleep(0.01)
        done = saver.poll()
    assert done == [os.path.join(b, "iter_0000004")]
    # An error in one rank's writer: raised on its training thread, the peers fail too, nothing committed.
    import megalite.checkpoint.async_save as mod
    original = mod.write_rank_files

    def broken(directory, r, tensors, pieces):
        if r == world - 1:
            raise OSError("No space left on device")
        return original(directory, r, tensors, pieces)
    mod.write_rank_files = broken
    saver.save(b, 5, optimizer, scaler, config, grid, 40, None, tokenizer, extra)
    with pytest.raises(CheckpointError, match="failed on rank") as e:
        saver.wait()
    mod.write_rank_files = original
    saver.close()
    return reused, str(e.value), open(os.path.join(b, "latest")).read()


@pytest.mark.parametrize("world,flags", [
    (2, ["--zero-stage", "2"]),
    pytest.param(4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow)])
def test_saver_writes_the_sync_bytes_reuses_buffers_and_reports_errors(tmp_path, world, flags):
    out = run_world(_saver_unit, world, str(tmp_path), flags)
    a, b = tmp_path / "sync" / "iter_0000003", tmp_path / "async" / "iter_0000003"
    assert (a / "metadata.json").exists() and _same_files(a, b) == []
    assert sorted(os.listdir(tmp_path / "async")) == ["iter_0000003", "iter_0000004", "iter_0000005.tmp", "latest"]
    for reused, error, latest in out:
        assert reused and latest == "4"
    assert "No space left on device" in out[-1][1]
    assert "a peer's write failed (rank" in out[0][1]


def test_saver_single_rank(tmp_path):
    """One rank (no store needed): the writer commits alone."""
    import json
    out = run_world(_serial, 1, str(tmp_path))[0]
    assert out == [str(tmp_path / "iter_0000002")]
    assert json.loads((tmp_path / "iter_0000002" / "metadata.json").read_text())["optimizer_step"] == 0


def _serial(rank, world, tmp):
    from megalite.checkpoint.async_save import AsyncCheckpointSaver
    config, tokenizer, grid, optimizer, scaler = _build(BASE + ["--train-iters", "2", "--save", tmp])
    saver = AsyncCheckpointSaver(grid)
    saver.save(tmp, 2, optimizer, scaler, config, grid, 16)
    return saver.wait()
