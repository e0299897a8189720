"""An expected failure under torchrun is one message: rank 0 prints it, torchrun's failure summary
shows it as the root cause (from rank 0's error file, without traceback lines), and the other
ranks add no copy (the agent stops them: SIGTERM). Failures every rank meets alike: a
configuration error and a missing data file, each with a real torchrun of 2 ranks on CPU (gloo).
A corrupt checkpoint under torchrun is held to the same checks (:func:`_check_one_message`) by
tests/test_corrupt_checkpoint.py, in the harder case where only rank 1 reads the bad file.

The message occurs exactly twice in the combined output: once as megalite's own line (printed
by rank 0 on its stderr, which torchrun may redirect to a per-rank log) and once in the
"Root Cause" entry of the summary torchrun's agent prints. The summary holds the only
``Traceback`` line: torchrun's own (the launcher raising ChildFailedError through its frames
in torch/distributed), never one from megalite's files.
"""
import os
import re
import subprocess
import sys

import pytest

import megalite.train.pretrain
from megalite.train.pretrain import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SMALL = ["--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2"]


def _torchrun(tmp_path, *flags):
    run = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", os.path.join(ROOT, "pretrain_gpt.py"),
                          *flags], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return run.returncode, run.stdout + run.stderr


def _check_one_message(code, text, message):
    assert code != 0, text
    printed = [line for line in text.splitlines() if line.startswith("megalite: ")]
    assert len(printed) == 1 and message in printed[0], text  # rank 0's line, no copy from rank 1
    assert text.count(message) == 2, text  # the line above + the summary's root cause
    summary = text[text.index("ChildFailedError"):]
    root = summary[summary.index("Root Cause (first observed failure):"):]
    assert "rank      : 0 (local_rank: 0)" in root and f"traceback : {printed[0]}" in root, text
    others = summary[:summary.index("Root Cause")]
    assert message not in others and "(SIGTERM)" in others, text  # rank 1: stopped by the agent
    assert "Traceback" not in summary, text
    assert len(re.findall(r"^Traceback", text, re.M)) == 1, text  # torchrun's own, through torch's frames
    assert not re.search(r"megalite/[\w/]*\.py", text), text  # no frame, no path of megalite's files


def test_configuration_error_is_one_message(tmp_path):
    code, text = _torchrun(tmp_path, "--mock-data", *SMALL, "--tensor-model-parallel-size", "3")
    _check_one_message(code, text, "world size (2) must be divisible by TP*CP*PP = 3*1*1 = 3")


@pytest.mark.slow  # the same path as the configuration error's (fast tier), another failure
def test_missing_data_file_is_one_message(tmp_path):
    code, text = _torchrun(tmp_path, "--data-path", str(tmp_path / "corpus"), "--tokenizer-type", "NullTokenizer",
                           *SMALL)
    _check_one_message(code, text, f"Dataset file '{tmp_path / 'corpus'}.idx' does not exist")


def test_plain_python_prints_one_line(tmp_path):
    """pretrain_gpt.py as __main__ (its record wrapper and sys.exit) in a fork of this process
    (tests/forked_commands.py); a new interpreter starts the script in the torchrun test above."""
    from tests.forked_commands import start_script, wait

    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    code = wait(start_script(os.path.join(ROOT, "pretrain_gpt.py"), ["--mock-data", *SMALL,
                                                                      "--tensor-model-parallel-size", "3"],
                             tmp_path, dict(os.environ, OMP_NUM_THREADS="1"), str(out), str(err)), 120)
    assert code == 2
    assert out.read_text() == "" and err.read_text().splitlines() == [
        "megalite: configuration error: world size (1) must be divisible by TP*CP*PP = 3*1*1 = 3; the data-parallel "
        "size is world/(TP*CP*PP). Fix: launch a multiple of 3 processes, or choose sizes whose product divides 1."]


def test_input_errors_are_one_line_in_one_process(tmp_path, capsys):
    """The fast tier's check of the two torchrun cases above (slow): the same errors reach
    main's handler as one "megalite: input error" line and exit status 2."""
    assert main(["--data-path", str(tmp_path / "corpus"), "--tokenizer-type", "NullTokenizer", *SMALL]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(
        f"megalite: input error: Dataset file '{tmp_path / 'corpus'}.idx' does not exist"), err
    save = tmp_path / "ckpt"
    assert main(["--mock-data", *SMALL, "--save", str(save)]) == 0
    capsys.readouterr()
    shard = save / "iter_0000002" / "rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64] + b"\0" * 64)
    assert main(["--mock-data", *SMALL, "--train-iters", "3", "--load", str(save)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("megalite: input error: ") \
        and f"{shard}: checksum mismatch" in err, err


def test_a_bug_keeps_its_traceback(monkeypatch):
    def bug(argv=None):
        raise ZeroDivisionError("a bug, not an expected failure")

    monkeypatch.setattr(megalite.train.pretrain, "pretrain", bug)
    with pytest.raises(ZeroDivisionError):
        main(["--mock-data", *SMALL])


def test_a_rank_that_does_not_print_waits_for_the_agent_then_reports(tmp_path, monkeypatch, capsys):
    """Rank 0 did not fail (the agent never stops this rank): after the wait, it reports itself."""
    from megalite.resilience.faults import report_failure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("LOCAL_RANK", "1")  # waits twice as long as local rank 0
    assert report_failure("input error", ValueError("only here"), 2, printer=False, wait_s=0.01) == 2
    assert capsys.readouterr().err == "megalite: input error: only here\n"
    import json
    assert json.loads(error_file.read_text())["message"]["message"] == "megalite: input error: only here"
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert report_failure("input error", ValueError("x"), 2, printer=False) == 2  # no torchrun: quiet at once
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flags,message", [
    (["--num-layers", "x"], "argument --num-layers: invalid int value: 'x'"),
    (["--no-such-flag", "3"], "unrecognized arguments: --no-such-flag 3"),
])
def test_a_bad_flag_is_one_line(flags, message, capsys):
    assert main(["--mock-data", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        f"megalite: configuration error: {message}. (python pretrain_gpt.py --help lists the flags.)"]


def test_slurm_tasks_without_torchrun_print_once(monkeypatch, capsys):
    """srun without torchrun: SLURM_PROCID names the printing task before megalite sets RANK."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    for task, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("SLURM_PROCID", task)
        assert main(["--mock-data", "--num-layers", "x"]) == 2
        assert len(capsys.readouterr().err.splitlines()) == lines
