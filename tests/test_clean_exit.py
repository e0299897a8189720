"""A finished run leaves nothing running behind it, and its process exits 0.

Issue 42: about 1 in 75 torchrun runs printed ``done: ...`` and then died at exit (``terminate
called without an active exception``, SIGABRT on rank 1): the mark of a C++ thread still alive
while the interpreter shut down. What was alive: the gloo groups outlived ``main()``.
``destroy_process_group`` only shuts a group down; its worker and socket threads end when the C++
object is freed, and the objects were still referenced (the grid's group cache, and the model and
optimizer, kept alive by the gradient hooks that autograd holds), so they were freed, if at all,
during interpreter teardown.

- The fast check runs ``main()`` on a real 2-rank gloo world (context parallel, all-to-all, the
  reported case) and looks at the process afterwards: no default group and no gloo thread
  (``/proc/self/task``: C++ threads, which ``threading`` does not list).
- The slow check runs the shortest torchrun training again and again, two at a time, for about
  30 s, and requires every exit status to be 0 with the ``done:`` line printed.
"""
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megalite.train.pretrain import main  # imported once, before the workers fork
from megalite.testing import free_port, run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--mock-data", "--vocab-size", "128", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
        "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--attention-dropout", "0", "--log-interval", "1"]
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")  # the native names of gloo's socket and worker threads


def _native_threads() -> list[str]:
    """The names of this process's OS threads (Linux): C++ threads too, which ``threading`` misses."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names


def _main_then_look(rank, world_size, argv):
    code = main(argv)
    return {"code": code, "initialized": dist.is_initialized(), "native": _native_threads()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the OS threads from /proc (Linux)")
def test_main_leaves_no_group_and_no_thread_behind():
    """After ``main()`` returns 0 on each rank of a CP 2 (a2a) world: the default group is
    destroyed and no gloo thread is still alive (so no gloo group object either): nothing is left
    for interpreter teardown to free."""
    for rank, seen in enumerate(run_world(_main_then_look, 2, TINY, timeout=120)):
        assert seen["code"] == 0, (rank, seen)
        assert not seen["initialized"], f"rank {rank}: the default process group is still there"
        alive = [name for name in seen["native"] if name in GLOO_THREADS]
        assert not alive, f"rank {rank}: gloo threads still alive after main() returned: {alive}"


def _start_torchrun(tmp_path, index: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the torch paths on the CPU: the interpreter is not needed
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               os.path.join(ROOT, "pretrain_gpt.py"), *TINY]
    log = open(tmp_path / f"run_{index}.txt", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


@pytest.mark.slow
def test_repeated_torchrun_runs_all_exit_zero(tmp_path):
    """The shortest torchrun training (2 ranks, CP 2 a2a, one iteration), two at a time for about
    16 s (some six runs): every run prints ``done:`` and exits 0 (torchrun's status: FAILED if a rank aborts)."""
    budget_s, side_by_side = 10.0, 2  # new runs start for 10 s; the last ones end by about 16 s
    deadline = time.monotonic() + budget_s
    running, finished, index = [], [], 0
    while running or (time.monotonic() < deadline and index < 100):
        while len(running) < side_by_side and time.monotonic() < deadline:
            running.append((index, _start_torchrun(tmp_path, index)))
            index += 1
        number, proc = running.pop(0)
        finished.append((number, proc.wait(timeout=180)))
    assert len(finished) >= 2, finished
    for number, code in finished:
        text = (tmp_path / f"run_{number}.txt").read_text()
        assert code == 0 and "done: 1 iterations" in text, (
            f"run {number} of {len(finished)}: exit {code}\n{text[-3000:]}")
        assert "terminate called" not in text and "Fatal Python error" not in text, text[-3000:]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the OS threads from /proc (Linux)")
def test_an_error_after_the_model_is_built_leaves_no_thread_behind(tmp_path):
    """main() stops with an input error after the model, the optimizer and its gradient hooks
    exist (a checkpoint whose file is corrupt): it returns 2 and, as after a finished run, no
    gloo thread is left (the hooks hold the gradient synchroniser weakly, so nothing keeps the
    groups alive for interpreter teardown)."""
    save = str(tmp_path / "ckpt")
    assert all(seen["code"] == 0 for seen in run_world(_main_then_look, 2, TINY + ["--save", save], timeout=120))
    shard = next(os.path.join(root, name) for root, _, names in os.walk(save) for name in names
                 if name.endswith(".safetensors"))
    with open(shard, "r+b") as f:  # a flipped byte: the checksum check refuses it on load
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    argv = TINY[:TINY.index("--train-iters")] + ["--train-iters", "2"] + TINY[TINY.index("--train-iters") + 2:]
    for rank, seen in enumerate(run_world(_main_then_look, 2, argv + ["--load", save], timeout=120)):
        assert seen["code"] == 2, (rank, seen)
        assert not seen["initialized"], f"rank {rank}: the default process group is still there"
        alive = [name for name in seen["native"] if name in GLOO_THREADS]
        assert not alive, f"rank {rank}: gloo threads still alive after main() returned 2: {alive}"
