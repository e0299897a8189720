"""A corrupt checkpoint file that only a rank other than 0 reads: one message, at once.

Under PP2 the second stage's file (rank00001.safetensors) is read by rank 1 alone. Every rank
checks the files it will read (their SHA-256) before any rank reports "loaded", and the ranks
agree on the outcome with one collective: rank 0 prints the fault rank 1 found, naming the
file and the fix, and rank 1 prints nothing (under torchrun the agent stops it). Before,
rank 0 printed "loaded ... RNG: restored" and went on to train while rank 1 failed alone:
its message came only after its 20-40 s wait for the agent, twice with rank 0's own.
"""
import contextlib
import io
import os
import subprocess
import sys
import threading
import time

import pytest

from megalite.train.pretrain import main, pretrain
from megalite.testing import run_world
from tests.test_single_message import _check_one_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SMALL = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--pipeline-model-parallel-size", "2"]


def _train(rank, world, argv):
    pretrain(argv)


def _main_captured(rank, world, argv):
    """main() on this rank: (exit status, stdout, stderr, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def _checkpoint_with_a_corrupt_second_stage(tmp_path):
    """A PP2 checkpoint of iteration 2 whose rank00001.safetensors (stage 2, read by rank 1
    alone) has its last 64 bytes zeroed; returns (root, the corrupt file)."""
    save = tmp_path / "ckpt"
    run_world(_train, 2, SMALL + ["--train-iters", "2", "--save", str(save)])
    shard = save / "iter_0000002" / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64] + b"\0" * 64)
    return save, shard


def test_a_corrupt_file_read_by_rank_1_is_one_message_from_rank_0(tmp_path):
    save, shard = _checkpoint_with_a_corrupt_second_stage(tmp_path)
    results = run_world(_main_captured, 2, SMALL + ["--train-iters", "3", "--load", str(save)], pg_timeout_s=30)
    (code0, out0, err0, _), (code1, out1, err1, _) = results
    assert (code0, code1) == (2, 2), results
    assert "loaded" not in out0 + out1 and "iter " not in out0, out0  # nobody loaded, nobody trained
    assert err1 == "", err1  # rank 1 found the fault; rank 0 names it
    lines = err0.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megalite: input error: {shard}: checksum mismatch"), err0
    assert "Fix: load an earlier checkpoint" in lines[0] and "(found by rank 1)" in lines[0], err0


@pytest.mark.slow  # a real torchrun (~10 s); the fast test above runs the same load in a forked world
def test_under_torchrun_the_fault_is_one_message_within_seconds(tmp_path):
    """The whole path: torchrun's agent, rank 1 stopped by SIGTERM (it never prints), the
    message on the console once and in the failure summary once, seconds after start-up
    rather than after rank 1's 20 s wait; and, as for every expected failure under torchrun
    (tests/test_single_message.py), no traceback but torchrun's own, no path of megalite's files."""
    save, shard = _checkpoint_with_a_corrupt_second_stage(tmp_path)
    start = time.monotonic()
    proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node", "2", os.path.join(ROOT, "pretrain_gpt.py"),
                             *SMALL, "--train-iters", "3", "--load", str(save)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    lines = []  # (seconds since start, line)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic() - start, x) for x in proc.stdout))
    reader.start()
    code = proc.wait(timeout=180)
    reader.join()
    text = "".join(x for _, x in lines)
    message = f"{shard}: checksum mismatch"
    assert code != 0 and "loaded" not in text, text
    printed = [(t, x) for t, x in lines if x.startswith("megalite: ")]
    assert len(printed) == 1 and message in printed[0][1] and text.count(message) == 2, text
    started = next(t for t, x in lines if x.startswith("grid:"))
    assert printed[0][0] - started < 10, f"the message came {printed[0][0] - started:.1f} s after start-up:\n{text}"
    summary = text[text.index("ChildFailedError"):]
    root = summary[summary.index("Root Cause (first observed failure):"):]
    others = summary[:summary.index("Root Cause")]
    assert "rank      : 0 (local_rank: 0)" in root and message in root, text  # rank 0 reported it
    assert "rank      : 1 (local_rank: 1)" in others and "(SIGTERM)" in others and message not in others, text
    _check_one_message(code, text, message)
