"""tools/reshard_checkpoint.py never harms a checkpoint: it refuses (before writing anything)
the layouts training refuses, never writes into its source, defaults to the source's sizes,
and answers bad input with one line and exit code 2."""
import hashlib
import json
import os
import shutil
import sys

import pytest

from megalite.testing import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "reshard_checkpoint.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import reshard_checkpoint  # noqa: E402

BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "100"]


def _train(rank, world, argv):
    from megalite.train.pretrain import pretrain
    pretrain(argv)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    run_world(_train, 1, BASE + ["--train-iters", "1", "--save", str(root)])
    return root


def _digest(directory) -> dict:
    return {os.path.relpath(os.path.join(d, f), directory): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(directory) for f in files}


def _cli(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        reshard_checkpoint.main(list(argv))
        raise SystemExit(0)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--target-pipeline-model-parallel-size", "3"],
     "--num-layers (4) must be divisible by --pipeline-model-parallel-size (3)"),
    (["--target-tensor-model-parallel-size", "3"],
     "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (3)"),
    (["--target-pipeline-model-parallel-size", "2", "--target-data-parallel-size", "2", "--target-zero-stage", "3"],
     "--zero-stage 3 with --pipeline-model-parallel-size 2"),
    (["--target-pipeline-model-parallel-size", "2", "--target-num-layers-per-virtual-pipeline-stage", "2"],
     "gives 1 virtual stage per rank"),
    (["--target-expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 without --num-experts"),
])
def test_refuses_what_training_refuses_before_writing(src, tmp_path, capsys, flags, message):
    before = _digest(src)
    code, err = _cli(capsys, "--load", str(src), "--save", str(tmp_path / "dst"), *flags)
    assert code == 2
    assert err.startswith("reshard_checkpoint: ") and message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "dst").exists()  # nothing written
    assert _digest(src) == before


def test_never_writes_into_its_source(src, tmp_path, capsys):
    before = _digest(src)
    it = src / "iter_0000001"
    for load, save in [(src, src), (it, src), (src, it), (it, it), (src, it / "sub")]:
        code, err = _cli(capsys, "--load", str(load), "--save", str(save), "--target-tensor-model-parallel-size", "2")
        assert code == 2 and "reshard_checkpoint: " in err and "source" in err, (load, save, err)
    assert _digest(src) == before and not (it / "sub").exists()
    # An existing iteration at the destination is not overwritten either.
    dst = tmp_path / "dst"
    assert _cli(capsys, "--load", str(src), "--save", str(dst), "--target-tensor-model-parallel-size", "2")[0] == 0
    written = _digest(dst)
    code, err = _cli(capsys, "--load", str(src), "--save", str(dst), "--target-tensor-model-parallel-size", "4")
    assert code == 2 and "already exists" in err
    assert _digest(dst) == written
    assert not [n for n in os.listdir(dst) if n.endswith(".tmp")]  # written through iter_N.tmp + rename


def test_unspecified_sizes_default_to_the_source(src, tmp_path, capsys):
    tp2, both = tmp_path / "tp2", tmp_path / "tp2pp2"
    reshard_checkpoint.reshard(str(src), str(tp2), tp=2, dp=2, zero=1)
    reshard_checkpoint.reshard(str(tp2), str(both), pp=2)  # TP 2, DP 2, ZeRO 1 kept
    meta = json.loads((both / "iter_0000001" / "metadata.json").read_text())
    assert (meta["layout"]["tp"], meta["layout"]["pp"], meta["layout"]["dp"], meta["zero_stage"]) == (2, 2, 2, 1)
    with pytest.raises(SystemExit):
        reshard_checkpoint.main(["--help"])
    assert " ".join(capsys.readouterr().out.split()).count("default: the source's") >= 5


def test_bad_input_is_one_line_and_exit_2(src, tmp_path, capsys):
    code, err = _cli(capsys, "--load", str(tmp_path / "nowhere"), "--save", str(tmp_path / "d1"))
    assert code == 2 and err.startswith("reshard_checkpoint: ") and "does not exist" in err
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "iter_0000001" / "metadata.json").write_text("{not json")
    code, err = _cli(capsys, "--load", str(bad), "--save", str(tmp_path / "d2"))
    assert code == 2 and err.startswith("reshard_checkpoint: ") and "metadata.json" in err, err
    for meta in ({"format_version": 1}, {"format_version": 1, "iteration": 1, "config": {}, "layout": [], "files": []}):
        (bad / "iter_0000001" / "metadata.json").write_text(json.dumps(meta))
        code, err = _cli(capsys, "--load", str(bad), "--save", str(tmp_path / "d3"))
        assert code == 2 and err.startswith("reshard_checkpoint: ") and "metadata.json" in err, err
    # The command as run: the script as __main__ (its own exit status) in a fork of this process
    # (tests/forked_commands.py; in a new interpreter: tests/test_tools_reporting.py's own-process
    # cases, slow): an impossible layout, one line on stderr, no traceback.
    from tests.forked_commands import start_script, wait

    output = tmp_path / "d4.txt"
    code = wait(start_script(TOOL, ["--load", str(src), "--save", str(tmp_path / "d4"),
                                    "--target-tensor-model-parallel-size", "3"], tmp_path,
                             {**os.environ, "OMP_NUM_THREADS": "1"}, str(output)), 120)
    stderr = output.read_text()  # stdout and stderr together: nothing but the line
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard_checkpoint: "), stderr
    assert not (tmp_path / "d4").exists()


def _files(directory) -> dict:
    """Each file's bytes, by relative path (metadata.json aside: it names its source)."""
    return {rel: digest for rel, digest in _digest(directory).items() if not rel.endswith("metadata.json")}


def test_format_round_trip_megalite_dcp_megalite_is_bit_identical(src, tmp_path, capsys):
    """megalite -> torch_dcp -> megalite gives the files megalite -> megalite gives, byte for
    byte (every tensor, every piece description), here at another layout than the source's."""
    from megalite.checkpoint import is_dcp_checkpoint

    for sizes in ({"tp": 2, "dp": 2, "zero": 1},):
        tag = "_".join(f"{k}{v}" for k, v in sizes.items()) or "same"
        direct, dcp, back = (tmp_path / f"{tag}_{n}" for n in ("direct", "dcp", "back"))
        reshard_checkpoint.reshard(str(src), str(direct), **sizes)
        reshard_checkpoint.reshard(str(src), str(dcp), to_format="torch_dcp", **sizes)
        assert is_dcp_checkpoint(str(dcp / "iter_0000001")) and ".metadata" in os.listdir(dcp / "iter_0000001")
        assert not [n for n in os.listdir(dcp / "iter_0000001") if n.endswith(".safetensors")]
        reshard_checkpoint.reshard(str(dcp), str(back), to_format="megalite")
        assert _files(back / "iter_0000001") == _files(direct / "iter_0000001"), tag
        meta = json.loads((back / "iter_0000001" / "metadata.json").read_text())
        assert "ckpt_format" not in meta and meta["layout"]["tp"] == sizes.get("tp", 1)
    # The command line: --to-format, and a bad value is one line (argparse's choices).
    assert _cli(capsys, "--load", str(src), "--save", str(tmp_path / "cli"), "--to-format", "torch_dcp")[0] == 0
    assert is_dcp_checkpoint(str(tmp_path / "cli" / "iter_0000001"))
    code, err = _cli(capsys, "--load", str(src), "--save", str(tmp_path / "bad"), "--to-format", "zarr")
    assert code == 2 and "invalid choice: 'zarr'" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("case", ["save inside the root", "save inside the root, load an iteration",
                                  "save is the root", "load inside save"])
def test_refuses_a_save_that_overlaps_the_load_root(src, tmp_path, capsys, case):
    """--save inside the --load checkpoint root (even when --load names one of its iterations),
    equal to it, or holding it, is refused before anything is read or written: one line that
    names both paths, the rule and the fix, exit code 2. Writing there would put a second
    layout's iter_N and 'latest' into (or around) the source run's checkpoints."""
    outer = tmp_path / "outer"
    shutil.copytree(src, outer / "ckpt")
    root = outer / "ckpt"
    load, save = {"save inside the root": (root, root / "resharded"),
                  "save inside the root, load an iteration": (root / "iter_0000001", root / "resharded"),
                  "save is the root": (root, root),
                  "load inside save": (root, outer)}[case]
    before = _digest(outer)
    code, err = _cli(capsys, "--load", str(load), "--save", str(save), "--target-tensor-model-parallel-size", "2")
    assert code == 2, (case, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard_checkpoint: "), err
    assert f"--save {save}" in err and f"--load {load}" in err, err
    assert "outside the source checkpoint" in err and "Fix: --save" in err, err
    assert _digest(outer) == before and sorted(os.listdir(outer)) == ["ckpt"]
