"""Checkpoints: exact resume after kill -9, atomic saves, resharding, errors, SIGTERM."""
import json
import os
import signal
import sys
import time

import pytest
import torch

from megalite.checkpoint import CheckpointError, PieceReader, load_serial_model
from megalite.testing import WorldError, run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from reshard_checkpoint import reshard  # noqa: E402

BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100",
        "--adam-eps", "1e-5"]


def _run(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in pretrain(argv)]


@pytest.mark.parametrize("world,layout", [(4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
                                          (2, ["--zero-stage", "2", "--overlap-grad-reduce"])])
@pytest.mark.slow
def test_resume_after_kill_is_bit_identical(tmp_path, world, layout):
    # 10 iterations, saved at 5, killed at 8: 5 resumed iterations (dropout on: the RNG streams
    # resume too), compared bit for bit
    argv = BASE + layout + ["--train-iters", "10", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = run_world(_run, world, argv + ["--save", str(tmp_path / "a"), "--save-interval", "5"])[0]
    with pytest.raises(WorldError, match="died"):
        run_world(_run, world, argv + ["--save", str(tmp_path / "b"), "--save-interval", "5",
                                       "--inject-fault", "kill@8"])
    assert (tmp_path / "b" / "latest").read_text() == "5"
    resumed = run_world(_run, world, argv + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")])[0]
    assert [r[0] for r in resumed] == list(range(6, 11))
    assert resumed == full[5:]  # losses and gradient norms, bit for bit


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    argv = BASE + ["--train-iters", "4", "--save", str(tmp_path), "--save-interval", "2"]
    with pytest.raises(WorldError, match="died"):
        run_world(_run, 2, argv + ["--inject-fault", "kill-during-save@4"])
    assert (tmp_path / "latest").read_text() == "2"
    assert (tmp_path / "iter_0000004.tmp").exists() and not (tmp_path / "iter_0000004").exists()
    model = load_serial_model(str(tmp_path))
    assert model(torch.randint(0, 300, (1, 16))).shape == (1, 16, 300)
    resumed = run_world(_run, 2, BASE + ["--train-iters", "4", "--load", str(tmp_path)])[0]
    assert [r[0] for r in resumed] == [3, 4]


LAYOUTS = {(1, 1): [], (2, 2): ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
           (4, 1): ["--tensor-model-parallel-size", "4"], (1, 4): ["--pipeline-model-parallel-size", "4"]}


def _logits(path):
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return load_serial_model(path)(tokens)


NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]  # RNG streams differ across layouts


@pytest.mark.slow
def test_reshard_matrix_same_logits_and_training_continues(tmp_path):
    sources = {}
    for (tp, pp), flags in LAYOUTS.items():
        src = tmp_path / f"src_{tp}_{pp}"
        run_world(_run, tp * pp, BASE + NO_DROPOUT + flags + ["--train-iters", "3", "--save", str(src)])
        sources[(tp, pp)] = src
    for (tp, pp), src in sources.items():
        ref = _logits(str(src))
        for (ttp, tpp), tflags in LAYOUTS.items():
            if (ttp, tpp) == (tp, pp):
                continue
            dst = tmp_path / f"dst_{tp}_{pp}_to_{ttp}_{tpp}"
            reshard(str(src), str(dst), ttp, tpp, None, 1, 0)
            assert torch.allclose(_logits(str(dst)), ref, rtol=1e-6, atol=1e-6)
            meta = json.loads((dst / "iter_0000003" / "metadata.json").read_text())
            assert meta["layout"] == {"tp": ttp, "cp": 1, "dp": 1, "pp": tpp, "ep": 1, "experts": False}
    # Training continues after resharding as it would have without a layout change.
    src = sources[(2, 2)]
    same = run_world(_run, 4, BASE + NO_DROPOUT + LAYOUTS[(2, 2)] + ["--train-iters", "6", "--load", str(src)])[0]
    for target in [(1, 1), (1, 4)]:
        dst = tmp_path / f"dst_2_2_to_{target[0]}_{target[1]}"
        moved = run_world(_run, target[0] * target[1],
                          BASE + NO_DROPOUT + LAYOUTS[target] + ["--train-iters", "6", "--load", str(dst)])[0]
        for a, b in zip(moved, same):
            assert a[0] == b[0] and abs(a[1] - b[1]) / b[1] < 1e-5 and abs(a[2] - b[2]) / b[2] < 1e-5


@pytest.mark.slow
def test_zero1_dp4_to_dp2(tmp_path):
    src, dst = tmp_path / "dp4", tmp_path / "dp2"
    run_world(_run, 4, BASE + NO_DROPOUT + ["--use-distributed-optimizer", "--train-iters", "3", "--save", str(src)])
    assert len(json.loads((src / "iter_0000003" / "metadata.json").read_text())["files"]) == 4
    reshard(str(src), str(dst), 1, 1, None, 2, 1)
    assert torch.allclose(_logits(str(dst)), _logits(str(src)), rtol=1e-6, atol=1e-6)
    args = BASE + NO_DROPOUT + ["--train-iters", "6"]
    same = run_world(_run, 4, args + ["--use-distributed-optimizer", "--load", str(src)])[0]
    moved = run_world(_run, 2, args + ["--use-distributed-optimizer", "--load", str(dst)])[0]
    direct = run_world(_run, 2, args + ["--zero-stage", "2", "--load", str(src)])[0]  # re-sliced at load
    for a, b, c in zip(moved, same, direct):
        assert abs(a[1] - b[1]) / b[1] < 1e-5 and abs(c[1] - b[1]) / b[1] < 1e-5


def _save_small(tmp_path):
    run_world(_run, 1, BASE + ["--train-iters", "2", "--save", str(tmp_path)])
    return tmp_path / "iter_0000002" / "rank00000.safetensors"


def test_corrupt_truncated_and_mismatched_checkpoints_are_refused(tmp_path):
    shard = _save_small(tmp_path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank00000.safetensors: checksum mismatch"):
        load_serial_model(str(tmp_path))
    shard.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_serial_model(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        PieceReader(str(tmp_path / "iter_0000099"))


def test_mismatched_config_lists_the_fields(tmp_path, capsys):
    from megalite.train.pretrain import main
    _save_small(tmp_path)
    argv = [a for a in BASE if a not in ()]
    argv[argv.index("--hidden-size") + 1] = "64"
    argv[argv.index("--num-layers") + 1] = "2"
    assert main(argv + ["--train-iters", "3", "--load", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--num-layers: the checkpoint has 4, the command line gives 2" in err
    assert "--hidden-size: the checkpoint has 32, the command line gives 64" in err
    assert main(BASE + ["--train-iters", "3", "--load", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    """SIGTERM mid-run saves the iteration reached and exits 0; that checkpoint resumes exactly:
    the resumed iterations equal an uninterrupted run's (losses and gradient norms, bit for bit).
    The run is pretrain_gpt.py as __main__ in a fork of this process (tests/forked_commands.py:
    no new interpreter importing torch; the script's own process gets the signal)."""
    from tests.forked_commands import start_script, wait

    sched = ["--lr-decay-iters", "200"]  # the schedule must not follow --train-iters, which differs below
    log, output = tmp_path / "log.jsonl", tmp_path / "output.txt"
    # --log-interval 1: the JSON lines are written at each log line; at BASE's 100 the signal came
    # after iteration 100, and the uninterrupted reference below trained 100 iterations more.
    pid = start_script(os.path.join(ROOT, "pretrain_gpt.py"),
                       [*BASE, *sched, "--train-iters", "100000", "--save", str(tmp_path / "ckpt"),
                        "--log-json", str(log), "--log-interval", "1"],
                       tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"}, str(output))
    deadline = time.time() + 60
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.kill(pid, signal.SIGTERM)
    code = wait(pid, 60)
    out = output.read_text()
    assert code == 0, out[-2000:]
    assert "SIGTERM: saved iteration" in out
    saved = int((tmp_path / "ckpt" / "latest").read_text())
    assert saved >= 3 and (tmp_path / "ckpt" / f"iter_{saved:07d}" / "metadata.json").exists()
    argv = BASE + sched + ["--train-iters", str(saved + 2)]
    full = run_world(_run, 1, argv)[0]
    assert [r[0] for r in full] == list(range(1, saved + 3))
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in logged][:saved] == list(range(1, saved + 1))
    assert [r["loss"] for r in logged][:saved] == pytest.approx([r[1] for r in full[:saved]], rel=1e-6)
    resumed = run_world(_run, 1, argv + ["--load", str(tmp_path / "ckpt")])[0]
    assert [r[0] for r in resumed] == [saved + 1, saved + 2]
    assert resumed == full[saved:]


@pytest.mark.slow
def test_zero3_checkpoint_resumes_exactly(tmp_path):
    argv = BASE + ["--zero-stage", "3", "--train-iters", "6"]
    full = run_world(_run, 2, argv + ["--save", str(tmp_path / "a"), "--save-interval", "3"])[0]
    # 'latest' is 6 (saved at the end): resuming a finished run trains nothing, without error.
    assert run_world(_run, 2, argv + ["--load", str(tmp_path / "a")])[0] == []
    import shutil
    shutil.copytree(tmp_path / "a" / "iter_0000003", tmp_path / "b" / "iter_0000003")
    (tmp_path / "b" / "latest").write_text("3")
    resumed = run_world(_run, 2, argv + ["--load", str(tmp_path / "b")])[0]
    assert resumed == full[3:]


@pytest.mark.slow
def test_load_a_chosen_iteration_resumes_exactly(tmp_path, capsys):
    from megalite.train.pretrain import main
    argv = BASE + ["--train-iters", "3", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = run_world(_run, 1, argv + ["--save", str(tmp_path), "--save-interval", "1"])[0]
    # --load DIR/iter_N (and --save to the same root: training goes on from there as usual)
    resumed = run_world(_run, 1, argv + ["--load", str(tmp_path / "iter_0000001"), "--save", str(tmp_path)])[0]
    assert [r[0] for r in resumed] == [2, 3] and resumed == full[1:]
    assert (tmp_path / "latest").read_text() == "3"
    # Megatron's --ckpt-step N with --load DIR
    assert run_world(_run, 1, argv + ["--load", str(tmp_path), "--ckpt-step", "2"])[0] == full[2:]
    # A missing or incomplete iteration names the ones there are.
    os.remove(tmp_path / "iter_0000002" / "metadata.json")
    for flags in (["--ckpt-step", "7"], ["--ckpt-step", "2"]):
        assert main(argv + ["--load", str(tmp_path), *flags]) == 2
        err = capsys.readouterr().err
        assert "complete iterations in" in err and "1, 3" in err, err
    assert main(argv + ["--load", str(tmp_path / "iter_0000009")]) == 2
    assert "1, 3" in capsys.readouterr().err


def test_no_latest_but_complete_iterations_is_not_a_fresh_start(tmp_path, capsys):
    """--load D --save D with no 'latest' starts fresh (an elastic job's first start), unless D
    holds complete iterations: then the fresh run's saves would overwrite them."""
    from megalite.train.pretrain import main
    argv = BASE + ["--train-iters", "2"]
    run_world(_run, 1, argv + ["--save", str(tmp_path), "--save-interval", "1"])
    os.remove(tmp_path / "latest")
    before = (tmp_path / "iter_0000002" / "metadata.json").read_bytes()
    assert main(argv + ["--load", str(tmp_path), "--save", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no 'latest' file" in err and "(1, 2)" in err and "--ckpt-step 2" in err, err
    assert (tmp_path / "iter_0000002" / "metadata.json").read_bytes() == before


def test_finetune_loads_the_weights_only(tmp_path, capfd):
    """Megatron's --finetune: the weights, not the optimizer's moments nor the RNG streams, so it
    trains exactly as --no-load-optim --no-load-rng does from the same checkpoint."""
    argv = BASE + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    run_world(_run, 1, argv + ["--train-iters", "3", "--save", str(tmp_path / "a")])
    capfd.readouterr()
    tuned = run_world(_run, 1, argv + ["--train-iters", "3", "--load", str(tmp_path / "a"), "--finetune"])[0]
    assert "RNG: reseeded (--finetune)" in capfd.readouterr().out
    fresh = run_world(_run, 1, argv + ["--train-iters", "3", "--load", str(tmp_path / "a"), "--finetune",
                                       "--no-load-optim", "--no-load-rng"])[0]
    assert len(tuned) == 3 and tuned == fresh


@pytest.mark.slow
def test_rng_message_says_what_happened(tmp_path, capfd):
    from megalite.checkpoint.core import rng_note
    argv = BASE + ["--train-iters", "3"]
    run_world(_run, 1, BASE + ["--train-iters", "2", "--save", str(tmp_path / "a")])
    run_world(_run, 1, argv + ["--load", str(tmp_path / "a")])
    assert "RNG: restored" in capfd.readouterr().out
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), 1, 1, None, 1, 0)  # the same layout, no RNG state
    run_world(_run, 1, argv + ["--load", str(tmp_path / "b")])
    out = capfd.readouterr().out
    assert "RNG: reseeded (the checkpoint carries no RNG state: written by reshard_checkpoint)" in out
    assert "different layout" not in out
    one = {"tp": 1, "cp": 1, "dp": 1, "pp": 1}
    meta = {"layout": one}
    assert rng_note(meta, {**one, "tp": 2}, True, False) == "RNG: reseeded: layout changed from TP1 DP1 PP1 to TP2 DP1 PP1"
    assert rng_note(meta, one, False, False) == "RNG: reseeded (--no-load-rng)"
    assert "imported from Hugging Face" in rng_note({"layout": one, "weights_only": True,
                                                     "source": {"format": "huggingface"}}, one, True, False)
