"""Failing before the work: unusable --save locations and out-of-vocabulary data caught at
startup, before any process group, model or step (one message per failure under torchrun:
tests/test_single_message.py)."""
import os
import shlex
import sys

import numpy as np
import pytest

from megalite.data import IndexedDatasetBuilder
from megalite.train.pretrain import main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
SMALL = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2"]


@pytest.mark.parametrize("where", ["under-a-file", "read-only"])
def test_unusable_save_location_fails_at_startup(tmp_path, capsys, where):
    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        save = str(tmp_path / "file" / "ckpt")
        why = "a part of the path is a file"
    else:
        save = "/sys/megalite-checkpoint-test"  # sysfs: not writable, even for root
        if os.access("/sys", os.W_OK) and not os.path.exists(save):
            try:
                os.mkdir(save)
                os.rmdir(save)
                pytest.skip("/sys is writable here: no read-only filesystem to test with")
            except OSError:
                pass
        why = "cannot create and write checkpoints there"
    assert main(SMALL + ["--save", save, "--save-interval", "1"]) == 2
    captured = capsys.readouterr()
    assert f"megalite: input error: --save {save}: cannot create and write checkpoints there" in captured.err
    assert why in captured.err and "Fix:" in captured.err
    assert "iter " not in captured.out and "grid:" not in captured.out  # nothing ran


def test_full_filesystem_fails_at_startup_with_the_estimate(tmp_path, capsys, monkeypatch):
    import shutil

    import megalite.train.preflight as preflight

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    assert main(SMALL + ["--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "0.00 GiB free on that filesystem, but one checkpoint needs about" in err
    assert "parameters x 12 bytes" in err and "Fix: free space there, or point --save elsewhere" in err


def test_out_of_vocabulary_data_fails_at_startup(tmp_path, capsys):
    prefix = str(tmp_path / "data")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for doc in range(20):
            builder.add_document(np.arange(doc, doc + 40) % 250 + (300 if doc == 7 else 0))
        builder.finalize()
    argv = [a for a in SMALL if a != "--mock-data"] + ["--data-path", prefix, "--tokenizer-type", "NullTokenizer"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "megalite: input error: Dataset" in captured.err and "contains token id" in captured.err
    assert "the vocabulary size is 300" in captured.err
    assert "grid:" not in captured.out  # before any group or model


def test_log_json_in_a_new_folder_is_created_at_startup(tmp_path, capsys):
    log = tmp_path / "new" / "dir" / "x.jsonl"
    assert main(SMALL + ["--log-json", str(log)]) == 0
    assert log.exists() and len(log.read_text().splitlines()) == 2


@pytest.mark.parametrize("flag,tail,why", [
    ("--log-json", "file/x.jsonl", "its folder"),
    ("--log-json", "adir", "it is a directory, not a file"),
    ("--tensorboard-dir", "file/tb", "a part of the path is a file, not a directory"),
    ("--pipeline-trace", "file/sub/trace", "a part of the path is a file, not a directory"),
])
def test_unusable_output_path_is_refused_by_flag_before_the_model(tmp_path, capsys, flag, tail, why):
    (tmp_path / "file").write_text("x")
    (tmp_path / "adir").mkdir()
    path = str(tmp_path / tail)
    assert main(SMALL + [flag, path]) == 2
    captured = capsys.readouterr()
    assert f"megalite: configuration error: {flag} {path}: cannot" in captured.err, captured.err
    assert why in captured.err and "Fix: choose a writable" in captured.err
    assert "model:" not in captured.out and "grid:" not in captured.out  # before any group or model


def test_output_directory_on_a_read_only_filesystem_is_refused(capsys):
    path = "/sys/megalite-output-test/tb"  # sysfs: not writable, even for root
    try:
        os.mkdir("/sys/megalite-output-test")
        os.rmdir("/sys/megalite-output-test")
        pytest.skip("/sys is writable here: no read-only filesystem to test with")
    except OSError:
        pass
    assert main(SMALL + ["--tensorboard-dir", path]) == 2
    captured = capsys.readouterr()
    assert f"megalite: configuration error: --tensorboard-dir {path}: cannot create and write" in captured.err
    assert "model:" not in captured.out


def test_every_unusable_output_path_gets_its_own_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    argv = SMALL + ["--log-json", str(tmp_path / "file" / "x.jsonl"), "--profile",
                    "--profile-dir", str(tmp_path / "file" / "prof"), "--tensorboard-dir", str(tmp_path / "tb")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("megalite: configuration error: --log-json ") and err[1].startswith("--profile-dir ")
    assert len(err) == 2 and (tmp_path / "tb").is_dir()  # the usable one was created


def test_data_path_with_bin_extension_is_refused_at_startup_with_the_prefix(tmp_path, capsys):
    prefix = str(tmp_path / "data")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_document(np.arange(40))
        builder.finalize()
    argv = [a for a in SMALL if a != "--mock-data"] + ["--data-path", prefix + ".bin", "--tokenizer-type",
                                                       "NullTokenizer"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert f"megalite: input error: Dataset file '{prefix}.bin.idx' does not exist" in captured.err
    assert captured.err.strip().endswith(f"Fix: --data-path {prefix}") and "grid:" not in captured.out


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_hugging_face_folder_given_to_load_names_the_conversion_and_it_works(tmp_path, capsys, weights):
    """--load at a Hugging Face model folder (config.json and its weights, no megalite metadata):
    one input error naming the folder and the command that converts it; run as printed (the
    safetensors folder: convert_hf reads no pickled .bin), the conversion loads."""
    import convert_hf  # tools/

    assert main(SMALL + ["--train-iters", "1", "--save", str(tmp_path / "run")]) == 0
    hf = tmp_path / "hf"
    assert convert_hf.main(["--direction", "export", "--load", str(tmp_path / "run"), "--hf-dir", str(hf)]) == 0
    if weights != "model.safetensors":
        (hf / "model.safetensors").rename(hf / weights)
    capsys.readouterr()
    assert main(SMALL + ["--load", str(hf)]) == 2
    err = capsys.readouterr().err
    before = sorted(p.name for p in hf.iterdir())
    # --save the same folder (an elastic job's --load D --save D) is no fresh start here: refused alike
    assert main(SMALL + ["--load", str(hf), "--save", str(hf)]) == 2
    assert capsys.readouterr().err == err and sorted(p.name for p in hf.iterdir()) == before
    assert err.startswith(f"megalite: input error: '{hf}' is a Hugging Face model folder") and len(err.splitlines()) == 1
    command = err[err.index("`") + 1: err.rindex("`")]
    assert command == f"python tools/convert_hf.py --direction import --hf-dir {hf} --save {hf}-megalite", err
    assert err.rstrip().endswith(f"then --load {hf}-megalite."), err
    if weights == "model.safetensors":
        assert convert_hf.main(shlex.split(command)[2:]) == 0
        assert main(SMALL + ["--load", f"{hf}-megalite", "--finetune"]) == 0
