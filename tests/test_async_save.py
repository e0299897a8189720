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
    from megalite.train.pretrain import build_training_state, setup
    _, config, tokenizer, grid, device = setup(argv)
    _, optimizer, scaler = build_training_state(config, grid, device)
    for i, m in enumerate(optimizer.exp_avg):  # moments that differ from the weights
        m.copy_(torch.randn(m.shape, generator=torch.Generator().manual_seed(i)))
    return config, tokenizer, grid, optimizer, scaler


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
    from megalite.checkpoint.format import _byte_runs, safetensors_order
    runs = len(list(_byte_runs(saver.buffers, safetensors_order(saver.buffers))))  # one buffer, one write
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
    return reused and runs == 1, str(e.value), open(os.path.join(b, "latest")).read()


@pytest.mark.parametrize("world,flags", [
    (2, ["--zero-stage", "2"]),
    pytest.param(4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                 marks=pytest.mark.slow)])
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


def test_a_second_save_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    """Two saves back to back, nobody waiting in between: the first write is held until someone
    waits for its thread (or 5 s), so a save() that stages the next state into the shared host
    buffer without waiting always overwrites it before it is written (no race left to chance).
    Both checkpoints must commit, in order, with the bytes of a synchronous save of their state."""
    import threading

    import megalite.checkpoint.async_save as async_save
    from megalite.checkpoint.core import save_checkpoint
    release = threading.Event()

    class ReleasedByJoin(threading.Thread):
        def join(self, timeout=None):
            release.set()  # someone waits for a write: the held one may go on
            return super().join(timeout)

    class Threading:  # async_save's view of the threading module
        Thread = ReleasedByJoin

        def __getattr__(self, name):
            return getattr(threading, name)

    original = async_save.write_rank_files

    def first_write_held(directory, rank, tensors, pieces):
        if directory.endswith("iter_0000001.tmp"):
            release.wait(timeout=5)
        return original(directory, rank, tensors, pieces)

    monkeypatch.setattr(async_save, "threading", Threading())
    monkeypatch.setattr(async_save, "write_rank_files", first_write_held)
    config, _, grid, optimizer, scaler = _build(BASE + ["--train-iters", "2", "--save", str(tmp_path)])
    saver = async_save.AsyncCheckpointSaver(grid)
    for iteration in (1, 2):
        save_checkpoint(str(tmp_path / "sync"), iteration, optimizer, scaler, config, grid, 8 * iteration)
        saver.save(str(tmp_path / "async"), iteration, optimizer, scaler, config, grid, 8 * iteration)
        for state in optimizer.master + optimizer.exp_avg + optimizer.exp_avg_sq:
            state.add_(1.0)  # the next save's state differs in every tensor
    committed = saver.wait()
    saver.close()
    assert committed == [str(tmp_path / "async" / f"iter_000000{i}") for i in (1, 2)]
    assert (tmp_path / "async" / "latest").read_text() == "2"
    assert _same_files(tmp_path / "sync", tmp_path / "async") == []


def _serial(rank, world, tmp):
    from megalite.checkpoint.async_save import AsyncCheckpointSaver
    config, _, grid, optimizer, scaler = _build(BASE + ["--train-iters", "2", "--save", tmp])
    saver = AsyncCheckpointSaver(grid)
    saver.save(tmp, 2, optimizer, scaler, config, grid, 16)
    return saver.wait()


# -- through pretrain (--async-save) ---------------------------------------------------------
def _run(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in pretrain(argv)]


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # the RNG streams matter


@pytest.mark.slow
def test_async_checkpoints_equal_sync_ones_and_resume_exactly(tmp_path):
    """An --async-save run trains as a synchronous one and writes the same bytes (every file of
    every checkpoint); resumed from its middle checkpoint it repeats the uninterrupted losses."""
    argv = BASE + DROPOUT + ["--zero-stage", "2", "--train-iters", "8", "--save-interval", "4"]
    sync = run_world(_run, 2, argv + ["--save", str(tmp_path / "sync")])[0]
    full = run_world(_run, 2, argv + ["--save", str(tmp_path / "async"), "--async-save"])[0]
    assert full == sync
    assert sorted(os.listdir(tmp_path / "async")) == ["iter_0000004", "iter_0000008", "latest"]
    for it in ("iter_0000004", "iter_0000008"):
        assert _same_files(tmp_path / "sync" / it, tmp_path / "async" / it) == []
    resumed = run_world(_run, 2, argv + ["--load", str(tmp_path / "async"), "--ckpt-step", "4", "--async-save",
                                         "--save", str(tmp_path / "resumed")])[0]
    assert [r[0] for r in resumed] == [5, 6, 7, 8] and resumed == full[4:]  # bit for bit


@pytest.mark.slow
def test_kill_during_background_write_keeps_previous_checkpoint(tmp_path):
    """Both ranks die in the writer thread of iteration 8's save (files written, not committed)
    while training goes on: 'latest' stays 4, the partial iter_8.tmp is ignored by --load, a
    resumed run saves over it, and its losses and gradient norms are the uninterrupted run's,
    bit for bit (the state at 4 was whole: weights, moments, step count, data position)."""
    ckpt = tmp_path / "ckpt"
    argv = BASE + ["--train-iters", "12", "--save-interval", "4", "--async-save"]
    with pytest.raises(WorldError, match="died"):
        run_world(_run, 2, argv + ["--save", str(ckpt), "--inject-fault", "kill-during-save@8"])
    assert (ckpt / "latest").read_text() == "4"
    assert (ckpt / "iter_0000008.tmp").exists() and not (ckpt / "iter_0000008").exists()
    resumed = run_world(_run, 2, argv + ["--save", str(ckpt), "--load", str(ckpt)])[0]
    full = run_world(_run, 2, argv + ["--save", str(tmp_path / "full")])[0]
    assert [r[0] for r in resumed] == list(range(5, 13)) and resumed == full[4:]
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "iter_0000008", "iter_0000012", "latest"]
    assert (ckpt / "latest").read_text() == "12"


@pytest.mark.slow
def test_sigterm_during_a_background_write_finishes_it(tmp_path):
    """--save-interval 1: a write is in flight (or just done) at every step, so SIGTERM meets one;
    the run commits it and the stop's own save, exits 0, and leaves no partial directory. The
    stop's checkpoint resumes exactly. The run is pretrain_gpt.py as __main__ in a fork of this
    process (tests/forked_commands.py: no new interpreter importing torch)."""
    import json
    import signal

    from tests.forked_commands import start_script, wait
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sched = ["--lr-decay-iters", "200"]
    log, ckpt, output = tmp_path / "log.jsonl", tmp_path / "ckpt", tmp_path / "output.txt"
    pid = start_script(os.path.join(root, "pretrain_gpt.py"),
                       [*BASE, *sched, "--train-iters", "100000", "--save", str(ckpt), "--save-interval", "1",
                        "--async-save", "--log-json", str(log)], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"},
                       str(output))
    deadline = time.time() + 60
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.kill(pid, signal.SIGTERM)
    code = wait(pid, 60)
    out = output.read_text()  # stdout and stderr together
    assert code == 0, out[-2000:]
    saved = int((ckpt / "latest").read_text())
    assert f"SIGTERM: saving iteration {saved} and stopping" in out  # the commit follows, waited for at the end
    started = [line.split("iter_")[1][:7] for line in out.splitlines() if "written in the background" in line]
    committed = [line.split("iter_")[1][:7] for line in out.splitlines() if line.startswith("saved checkpoint")]
    assert started == committed and int(started[-1]) == saved  # every write started was committed
    assert not [d for d in os.listdir(ckpt) if d.endswith(".tmp")]
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in logged] == list(range(1, saved + 1))
    argv = BASE + sched + ["--train-iters", str(saved + 2)]
    full = run_world(_run, 1, argv)[0]
    resumed = run_world(_run, 1, argv + ["--load", str(ckpt)])[0]
    assert [r[0] for r in resumed] == [saved + 1, saved + 2] and resumed == full[saved:]


def test_async_save_without_save_is_one_clear_message(capsys):
    from megalite.train.pretrain import main
    assert main(BASE + ["--train-iters", "2", "--async-save"]) == 2
    err = capsys.readouterr().err
    assert "--async-save is set without --save: there is nothing to save. Fix: add --save DIR" in err


def test_safetensors_writer_writes_save_files_bytes(tmp_path):
    """megalite's writer (which releases the GIL and hashes as it writes) gives the bytes of
    safetensors' own save_file, for every dtype a checkpoint holds, and their SHA-256."""
    from safetensors.torch import save_file

    from megalite.checkpoint.format import sha256_file, write_safetensors
    g = torch.Generator().manual_seed(0)
    tensors = {"weight/b/tp0/0": torch.randn(7, 3, generator=g).t(),  # not contiguous
               "rng/default.cpu": torch.randint(0, 255, (40,), dtype=torch.uint8), "fp8/x": torch.tensor(2.5),
               "empty": torch.zeros(0), "i64": torch.arange(5), "bf16": torch.randn(4).bfloat16(),
               "flag": torch.tensor([True, False])}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "a"), metadata={"format": "x"})
    sha = write_safetensors(str(tmp_path / "b"), tensors, {"format": "x"})
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() and sha == sha256_file(str(tmp_path / "b"))


@pytest.mark.slow
def test_bench_checkpoint_figures_show_the_async_save_in_the_background():
    """tools/bench_checkpoint.py on a 0.46M-parameter model (a 5.6 MB checkpoint: its write
    takes tens of milliseconds, its staging copy a few), sync and async side by side in one
    run: the async save blocks training for under half the sync save's time, training steps
    ran while its write was in flight, and the checkpoint is 12 bytes (fp32 weight and two
    Adam moments) per parameter. A save that waited for its own write blocks as long as the
    sync one, with no step during the write."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools.bench_checkpoint import main
    res = run_world(lambda rank, world: main(["--hidden", "128", "--layers", "2", "--vocab", "512", "--seq", "8",
                                              "--rounds", "3"]), 1)[0]
    assert res["checkpoint_bytes"] == 12 * res["parameters"]
    assert 0 < res["blocked_s_async"] < 0.5 * res["blocked_s_sync"], res
    assert res["steps_per_write"] >= 1 and res["step_s_during_write"] is not None, res


def test_an_exception_waits_for_the_write_in_flight(tmp_path, capsys):
    """A run that stops on an error (a NaN, no --max-rollbacks) commits the checkpoint still
    being written before the error goes on; nothing partial is left."""
    from megalite.train.pretrain import main
    assert main(BASE + ["--train-iters", "8", "--save", str(tmp_path), "--save-interval", "2", "--async-save",
                        "--inject-fault", "nan@5"]) == 3
    out, err = capsys.readouterr()
    assert "training stopped: iteration 5: loss nan" in err
    assert f"saved checkpoint {tmp_path / 'iter_0000004'}" in out
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000004", "latest"]
    assert (tmp_path / "latest").read_text() == "4"


def _stage_then_update(tmp_path, device: str):
    """Save asynchronously, then take the next optimizer step at once; returns the saver and the
    optimizer's update, after checking the files equal a synchronous save of the state before
    the update, byte for byte."""
    from megalite.checkpoint import save_checkpoint
    from megalite.checkpoint.async_save import AsyncCheckpointSaver
    config, _, grid, optimizer, scaler = _build(BASE + ["--train-iters", "2", "--save", str(tmp_path),
                                                        "--device", device])
    save_checkpoint(str(tmp_path / "sync"), 2, optimizer, scaler, config, grid, 16)
    saver = AsyncCheckpointSaver(grid, device=torch.device("cuda", 1) if device == "cpu" else None)
    saver.save(str(tmp_path / "async"), 2, optimizer, scaler, config, grid, 16)
    before = [s.clone() for s in optimizer.exp_avg]
    optimizer.step(1e-2)  # queued on the training stream right after save() returned
    assert not all(torch.equal(a, b) for a, b in zip(before, optimizer.exp_avg))  # the update changed them
    optimizer.step(1e-2)  # the step after it has nothing to wait for
    assert saver.wait() == [str(tmp_path / "async" / "iter_0000002")]
    assert saver._host.flat is not None and saver._host.pinned  # page-locked, until close() frees it
    size = saver._host.flat.numel()
    saver.close()
    assert saver._host.flat is None and not saver._host.pinned
    assert _same_files(tmp_path / "sync", tmp_path / "async") == []
    return size


def test_staging_order_on_a_gpu_with_cuda_recorded(tmp_path, monkeypatch):
    """The GPU branch of the staging, with torch.cuda's stream, event, device and page-locking
    calls recorded (tests/fake_cuda.py; tensors stay on the host): the side stream waits for
    the training stream before it copies; the training stream does not wait for the copy when
    save() returns (the next forward and backward run beside it), only the next optimizer update
    does, and only once; the writer thread sets the training device before it waits for the copy
    (else a rank > 0 opens a context on GPU 0); the host buffer is page-locked at its exact size
    (not torch's power-of-two pinned blocks), once, and unregistered at close()."""
    from tests.fake_cuda import FakeCuda
    fake = FakeCuda.install(monkeypatch)
    import megalite.data_parallel.adamw as adamw
    original = adamw.FlatAdamW.step
    monkeypatch.setattr(adamw.FlatAdamW, "step", lambda self, *a, **k: (fake.record("update"), original(self, *a, **k)))
    size = _stage_then_update(tmp_path, "cpu")
    log = fake.log
    ready = next(e[1] for e in log if e[0] == "event" and e[2] == "recorded on")
    assert fake.index(("side", "wait_stream", "main")) < fake.index(("enter", "side"))
    assert ("event", ready, "recorded on", "side") in log and not any(e[:2] == ("main", "wait_stream") for e in log)
    assert fake.index(("main", "wait_event", ready)) < fake.index(("update",))
    assert [e for e in log if e[0] == "main"] == [("main", "wait_event", ready)]  # once
    waits = [e for e in log if e[:3] == ("event", ready, "synchronize")]
    assert waits == [("event", ready, "synchronize", "other-thread", "cuda:1")]
    assert fake.index(("set_device", "cuda:1", "other-thread")) < fake.index(waits[0])
    registered = [e for e in log if e[0] == "cudaHostRegister"]
    assert len(registered) == 1 and registered[0][2] == size and size & (size - 1) != 0  # exact, not 2**k
    assert ("cudaHostUnregister", registered[0][1]) in log


@pytest.mark.gpu
def test_cuda_staging_copies_the_state_before_the_next_update_changes_it(tmp_path):
    """On a GPU the state goes to the page-locked buffer on a side stream and save() returns at
    once; the optimizer update queued right after it must not reach the files: they equal a
    synchronous save of the same state, byte for byte. CPU twin: test_staging_order_on_a_gpu_with_cuda_recorded
    (the same steps, _stage_then_update, with torch.cuda's calls recorded)."""
    _stage_then_update(tmp_path, "cuda")
