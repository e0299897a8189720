"""--check-for-spiky-loss from the first iterations: the warm-up rule and the resume.

The check is armed once min(W, 3) good losses are known (the median of those until W are),
and a resumed run starts with the losses its checkpoint recorded, so a spike early in a run
or right after a resume is rolled back like any other. The oracle is the rollback's: a run
that meets a spike at iteration k, rolls back and skips batch k trains exactly like a run
told ``--skip-batches k`` from the start (tests/test_rollback.py).
"""
import json

from megalite.train.pretrain import pretrain
from megalite.resilience.rollback import BadStep, LossSentinel

BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100",
        "--hidden-dropout", "0.1"]
SPIKY = ["--check-for-spiky-loss", "--max-rollbacks", "1", "--save-interval", "5"]  # window: the default 10


def _losses(records):
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in records]


def _events(log):
    return [json.loads(x) for x in log.read_text().splitlines() if '"event"' in x]


def _spike_and_its_reference(args, tmp_path, capsys, iteration):
    """Two runs of ``args``: one told --skip-batches ITERATION from the start, one that meets a
    spike at ITERATION (and must roll it back). Their losses, the second's output and its
    rollback events."""
    reference = _losses(pretrain(args + ["--save", str(tmp_path / "ref"), "--skip-batches", str(iteration)]))
    capsys.readouterr()
    log = tmp_path / "log.jsonl"
    rolled = _losses(pretrain(args + ["--save", str(tmp_path / "b"), "--inject-fault", f"spike@{iteration}",
                                      "--log-json", str(log)]))
    return reference, rolled, capsys.readouterr().out, _events(log)


def test_the_sentinel_is_armed_once_three_losses_are_known():
    """Fewer losses than the window: their median is the bar, from the third one on (a window
    smaller than 3: from the W-th); the checkpoint's losses count from the start."""
    rec = lambda i, loss: {"iteration": i, "loss": loss, "grad_norm": 1.0}  # noqa: E731
    s = LossSentinel(fp16=False, spiky=True, factor=3.0, window=10)
    assert s.armed_from(0) == 4
    assert s.first_bad([rec(1, 5.0), rec(2, 4.0), rec(3, 16.0)]) is None  # 2 losses known: not armed
    assert s.first_bad([rec(4, 15.0), rec(5, 49.0)]) == BadStep(5, "spike", 49.0, 1.0, 10.0, 4)
    assert LossSentinel(False, True, 3.0, window=1).armed_from(0) == 2
    resumed = LossSentinel(False, True, 3.0, window=10, history={8: 4.0, 9: 5.0, 10: 6.0})
    assert resumed.armed_from(10) == 11 and resumed.first_bad([rec(11, 15.5)]).median == 5.0
    assert "armed from iteration 11 (3 loss(es) recorded by the checkpoint)" in resumed.describe_arming(10)


def test_a_spike_before_the_window_is_full_is_rolled_back(tmp_path, capsys):
    """spike@8 with a window of 10: 7 good losses are known, the check is armed (before: the
    run trained on a loss of ~2900 and went on). The rolled-back run equals a run that skipped
    batch 8 from the start, and the startup line says from where the check is armed."""
    reference, rolled, out, events = _spike_and_its_reference(BASE + SPIKY + ["--train-iters", "10"], tmp_path,
                                                              capsys, 8)
    assert "spike check: armed from iteration 4 (once 3 losses are known)" in out, out
    assert [(e["iteration"], e["kind"], e["restored_iteration"]) for e in events] == [(8, "spike", 5)], out
    assert rolled == reference  # bit for bit: the spike's step was undone, its batch skipped


def test_a_spike_right_after_a_resume_is_rolled_back(tmp_path, capsys):
    """A resume is armed from its first iteration: the checkpoint records the losses before it
    (metadata.json's recent_losses), so spike@11 after a resume from iteration 10 is caught
    (before: no loss known, the check waited for 10 new ones). Equal to the resume that skipped
    batch 11; the losses recorded are the run's own."""
    first = pretrain(BASE + ["--train-iters", "10", "--save", str(tmp_path / "base"), "--save-interval", "10"])
    meta = json.loads((tmp_path / "base" / "iter_0000010" / "metadata.json").read_text())
    assert meta["recent_losses"] == [[r["iteration"], r["loss"]] for r in first]  # the last 10 of 10
    resume = BASE + SPIKY + ["--train-iters", "12", "--load", str(tmp_path / "base")]
    reference, rolled, out, events = _spike_and_its_reference(resume, tmp_path, capsys, 11)
    assert "spike check: armed from iteration 11 (10 loss(es) recorded by the checkpoint)" in out, out
    assert [(e["iteration"], e["kind"], e["restored_iteration"]) for e in events] == [(11, "spike", 10)], out
    assert rolled == reference and [r[0] for r in rolled] == [11, 12]
