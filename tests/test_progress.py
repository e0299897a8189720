"""tqdm progress bars: training (and the meta dry run), preprocessing, Hugging Face conversion.

Each bar is drawn only on a terminal: these tests hand the code a stream that says it is one
(``Tty``), check the bar's text, and check that the lines printed meanwhile stay intact on
lines of their own. On a stream that is not a terminal nothing of a bar appears.
"""
import io
import json
import sys

import torch.distributed as dist

from megalite.checkpoint.convert import export_hf, import_hf
from megalite.data.preprocess import preprocess
from megalite.data.tokenizer import build_tokenizer
from megalite.observe.monitor import clock_time
from megalite.train.pretrain import pretrain

SMALL = ["--mock-data", "--vocab-size", "200", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--log-interval", "1"]


class Tty(io.StringIO):
    def isatty(self):
        return True


def screen_lines(out: str) -> list[str]:
    """What a terminal leaves on each line: a carriage return starts the line over."""
    return [segment.rstrip() for line in out.split("\n") for segment in line.split("\r")]


def test_training_on_a_terminal_keeps_the_bar_under_intact_log_lines(monkeypatch):
    stdout = Tty()
    monkeypatch.setattr(sys, "stdout", stdout)
    log = pretrain(SMALL + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1"])
    out = stdout.getvalue()
    assert "training: 100%|" in out and "| 4/4 [" in out  # the bar, finished
    lines = screen_lines(out)
    for record in log:
        clock = f"elapsed {clock_time(record['run_elapsed_s'])} ETA {clock_time(record['eta_s'])}"
        assert any(x.startswith(f"iter {record['iteration']:>5}/4 | {clock} | loss {record['loss']:.4f} |")
                   and x.endswith(" ms") for x in lines), record["iteration"]
    for iteration in (2, 4):  # lines printed by the driver between steps are not glued to the bar
        assert any(x.startswith(f"validation at iter {iteration}: loss") for x in lines)
    assert any(x.startswith("done: 4 iterations") for x in lines)
    assert not any("%|" in x and "iter " in x for x in lines)


def test_meta_dry_run_has_the_same_bar(monkeypatch):
    stdout = Tty()
    monkeypatch.setattr(sys, "stdout", stdout)
    for name, value in {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    try:
        log = pretrain(["--fake-process-group", "--device", "meta", *SMALL, "--train-iters", "3",
                        "--tensor-model-parallel-size", "2"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [r["iteration"] for r in log] == [1, 2, 3]
    out = stdout.getvalue()
    assert "training: 100%|" in out and "| 3/3 [" in out
    assert any(x.startswith("iter     2/3 | elapsed ") and "| loss n/a |" in x for x in screen_lines(out))


def test_training_off_a_terminal_prints_no_bar(capsys):
    pretrain(SMALL + ["--train-iters", "2"])
    out = capsys.readouterr().out
    assert "\r" not in out and "%|" not in out and "training:" not in out


def _corpus(tmp_path, n=300):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i} {i % 7} {i % 5}"}) + "\n" for i in range(n)))
    return str(path)


def test_preprocess_bar_counts_documents_on_a_terminal(tmp_path):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000)
    stream = Tty()
    summary = preprocess(_corpus(tmp_path), str(tmp_path / "d"), tokenizer, append_eod=True,
                         progress_stream=stream)
    out = stream.getvalue()
    assert summary["documents"] == 300 and summary["tokens"] == 1200
    assert "tokenizing: 300 docs [" in out and "1,200 tokens" in out and out.endswith("\n")
    quiet = io.StringIO()  # not a terminal: no bar (a plain line every 10 s on long runs)
    preprocess(_corpus(tmp_path), str(tmp_path / "e"), tokenizer, progress_stream=quiet)
    assert quiet.getvalue() == ""


def test_conversion_bars_count_the_layers_on_a_terminal(tmp_path, monkeypatch, capsys):
    pretrain(SMALL + ["--train-iters", "1", "--save", str(tmp_path / "ckpt")])
    capsys.readouterr()
    stderr = Tty()
    monkeypatch.setattr(sys, "stderr", stderr)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert "export gpt2: embeddings + 2 layers: 100%|" in stderr.getvalue() and "| 3/3 [" in stderr.getvalue()
    stderr.seek(0)
    stderr.truncate()
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    assert "import gpt2: embeddings + 2 layers: 100%|" in stderr.getvalue() and "| 3/3 [" in stderr.getvalue()
    stderr.seek(0)
    stderr.truncate()
    import_hf(str(tmp_path / "hf"), str(tmp_path / "quiet"), progress=False)
    assert stderr.getvalue() == ""
