"""--wandb-project / --wandb-exp-name / --wandb-save-dir: an offline W&B run, read back from disk.

The run is written with WANDB_MODE=offline (nothing touches the network, no login, no
~/.netrc: HOME and wandb's own directories point into tmp_path). The test reads the run's
transaction log (``run-<id>.wandb``) itself: a LevelDB-style log of ``wandb_internal_pb2.Record``
messages (a 7-byte header ``:W&B`` + magic + version, then 32 KiB blocks of records, each with a
7-byte header: checksum, length, type FULL/FIRST/MIDDLE/LAST). wandb 0.31 has no public reader
for offline runs and writes no ``files/wandb-summary.json`` offline, so the history, summary,
config and exit records come from that log.
"""
import glob
import json
import os
import struct
import time

import pytest

from megalite.train.pretrain import main, pretrain

SMALL = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--log-interval", "1"]

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_log(path: str) -> list:
    """The records of a ``.wandb`` transaction log, in order."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, data[:7]
    records, parts, pos = [], [], 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _value(item):
    if item.value_json:
        return json.loads(item.value_json)
    kind = item.WhichOneof("value") if "value" in item.DESCRIPTOR.oneofs_by_name else None
    return None if kind in (None, "none") else getattr(item, kind)


def _offline_wandb(monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                        "WANDB_DISABLE_CODE": "true", "WANDB_ERROR_REPORTING": "false", "HOME": str(home),
                        "NETRC": str(home / ".netrc"), "WANDB_CONFIG_DIR": str(home / "config"),
                        "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
                        "WANDB_ARTIFACT_DIR": str(home / "artifacts")}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)


def test_wandb_offline_run_logs_the_losses_pretrain_returned(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    _offline_wandb(monkeypatch, tmp_path)
    save_dir = tmp_path / "wb"
    start = time.perf_counter()
    log = pretrain(SMALL + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                            "--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", str(save_dir)])
    seconds = time.perf_counter() - start
    import wandb
    wandb.teardown()  # stop the wandb service process this test started
    runs = glob.glob(str(save_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs
    logs = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert len(logs) == 1, os.listdir(runs[0])
    records = read_wandb_log(logs[0])
    by_type = {}
    for record in records:
        by_type.setdefault(record.WhichOneof("record_type"), []).append(record)

    run = by_type["run"][0].run
    assert run.project == "p" and run.display_name == "e"
    config = {_key(item): _value(item) for item in run.config.update}
    assert config["model"]["vocab_size"] == 300 and config["model"]["hidden_size"] == 32
    assert config["train"]["train_iters"] == 4 and config["parallel"]["tensor_model_parallel_size"] == 1

    history = [{_key(item): _value(item) for item in r.history.item} for r in by_type["history"]]
    assert [h["_step"] for h in history] == [1, 2, 3, 4]
    assert [h["train/loss"] for h in history] == [r["loss"] for r in log]  # exactly the returned values
    assert [h["train/lr"] for h in history] == [r["lr"] for r in log]
    assert [h.get("train/valid_loss") for h in history] == [None, log[1]["valid_loss"], None, log[3]["valid_loss"]]
    for key in ("train/grad_norm", "train/loss_scale", "train/tokens_per_sec", "train/tflops_per_gpu",
                "time_ms/forward", "time_ms/backward", "time_ms/optimizer", "memory_bytes/weights"):
        assert key in history[0], (key, sorted(history[0]))
    assert history[2]["memory_bytes/weights"] == log[2]["memory_bytes"]["weights"]

    summary = {}
    for r in by_type["summary"]:
        summary.update({_key(item): _value(item) for item in r.summary.update})
    assert summary["train/loss"] == log[-1]["loss"] and summary["_step"] == 4
    summary_file = os.path.join(runs[0], "files", "wandb-summary.json")
    if os.path.exists(summary_file):  # written offline by some wandb versions
        assert json.load(open(summary_file))["train/loss"] == log[-1]["loss"]
    assert "exit" in by_type and by_type["exit"][0].exit.exit_code == 0  # finish() was called
    print(f"pretrain with an offline W&B run: {seconds:.1f} s; {len(records)} records read back")


def test_wandb_flags_fail_at_startup_without_the_package(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert main(SMALL + ["--train-iters", "1", "--wandb-project", "p"]) == 2
    captured = capsys.readouterr()
    assert "--wandb-project needs the wandb package" in captured.err and "pip install wandb" in captured.err
    assert "grid:" not in captured.out and "iter " not in captured.out  # before any group, model or step
    assert main(SMALL + ["--train-iters", "1", "--wandb-exp-name", "e"]) == 2
    assert "--wandb-exp-name is set without --wandb-project" in capsys.readouterr().err
