"""The Muon benchmark tools (issue 39): tools/bench_optimizer.py --muon (Newton-Schulz FLOPs, the
step-time table, DP 2 ZeRO-1 ownership) and tools/compare_optimizers.py (the sweep's summary,
the tokens-to-reach interpolation, the figure), at tiny shapes and on hand-made logs."""
import json
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_optimizer  # noqa: E402
import compare_optimizers  # noqa: E402
from megalite.data_parallel.muon import matrix_ns_flops, newton_schulz  # noqa: E402


@pytest.mark.parametrize("rows,cols", [(24, 40), (40, 24), (32, 32)])
def test_ns_flops_counts_the_iterations_matmuls(rows, cols):
    """The formula against torch's own count of the matrix products NS_5 runs (tall matrices
    transposed first: the same count either way)."""
    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(rows, cols), 5)
    assert matrix_ns_flops(rows, cols, 5) == counter.get_total_flops()


def test_matrix_flops_per_logical_matrix():
    """A fused QKV counts as q, k, v (three h x h), the MLP as its two h x 4h; norms, biases,
    embeddings and the output layer count nothing."""
    cfg, t, model, _ = bench_optimizer.build_shape(16, 1, **bench_optimizer.MUON_SETTINGS)
    per = {n: bench_optimizer.matrix_flops(n, p, cfg, t) for n, p in model.named_parameters()}
    square, wide = matrix_ns_flops(16, 16, 5), matrix_ns_flops(64, 16, 5)
    qkv = next(n for n in per if n.endswith("qkv.weight"))
    assert per[qkv] == 3 * square
    assert sum(per.values()) == 4 * square + 2 * wide
    assert all(v == 0 for n, v in per.items() if "embed" in n or n.endswith("bias") or "norm" in n)


def test_tokens_to_reach():
    curve = [(100, 5.0), (200, 4.0), (300, 3.0)]
    assert compare_optimizers.tokens_to_reach(curve, 3.5) == pytest.approx(250.0)
    assert compare_optimizers.tokens_to_reach(curve, 4.0) == 200.0
    assert compare_optimizers.tokens_to_reach(curve, 6.0) == 100.0  # reached at the first evaluation
    assert compare_optimizers.tokens_to_reach(curve, 2.0) is None
    assert compare_optimizers.tokens_to_reach([(100, 5.0), (200, 3.0), (300, 4.5)], 4.0) == pytest.approx(150.0)


def _log(path, losses, every):
    path.parent.mkdir(parents=True)
    with open(path, "w") as f:
        for k, loss in enumerate(losses, start=1):
            f.write(json.dumps({"iteration": k * every, "loss": loss + 0.1, "valid_loss": loss,
                                "run_elapsed_s": 1.0 * k}) + "\n")


def _sweep(tmp_path, *extra):
    out = tmp_path / "runs"
    _log(out / "adam_lr0.001" / "log.jsonl", [6.0, 5.0, 4.0], 10)
    _log(out / "adam_lr0.003" / "log.jsonl", [6.0, 5.5, 4.5], 10)
    _log(out / "muon_lr0.003" / "log.jsonl", [5.0, 3.0, 2.5], 10)
    _log(out / "muon_lr0.01" / "log.jsonl", [7.0, 7.0, 7.0], 10)
    return compare_optimizers.main(["--data-path", "x", "--tokenizer-model", "x", "--out", str(out), "--no-run",
                                    "--adam-lrs", "1e-3", "3e-3", "--muon-lrs", "3e-3", "1e-2", "--train-iters", "30",
                                    "--eval-interval", "10", *extra])


def test_compare_summary_and_table(tmp_path, capsys):
    """--no-run on hand-made logs: the best run of each optimizer by final validation loss, the
    tokens Muon needs to reach AdamW's best final loss (interpolated), the markdown table."""
    per = compare_optimizers.tokens_per_iteration(compare_optimizers.MODEL)
    summary = _sweep(tmp_path, "--summary", str(tmp_path / "s.json"))
    assert summary["best"] == {"adam": "adam_lr0.001", "muon": "muon_lr0.003"}
    assert summary["muon_tokens_to_adam_final"] == pytest.approx(15 * per)  # 5.0 at 10 iters, 3.0 at 20: 4.0 at 15
    assert summary["token_ratio"] == pytest.approx(0.5)
    text = capsys.readouterr().out
    assert "| AdamW | 0.001 **(best)** | 4.0000" in text and "(0.50x)" in text
    assert json.loads((tmp_path / "s.json").read_text())["adam_tokens"] == 30 * per


@pytest.mark.slow
def test_compare_figure(tmp_path):
    """The figure of the same sweep (matplotlib's import and drawing: seconds, so slow tier)."""
    pytest.importorskip("matplotlib")
    import matplotlib.image
    _sweep(tmp_path, "--plot", str(tmp_path / "f.png"))
    image = matplotlib.image.imread(str(tmp_path / "f.png"))
    assert image.shape[0] >= 400 and image.shape[1] >= 600 and image.std() > 0.05


def test_compare_commands_and_bad_input(tmp_path, capsys):
    """The Muon runs get the Muon flags, AdamW runs none; same model, data and schedule; a
    --train-iters the evaluations do not end on is refused in one line."""
    args = type("A", (), {"data_path": "d", "tokenizer_model": "t", "train_iters": 30, "warmup_iters": 3,
                          "eval_interval": 10, "eval_iters": 2})()
    adam = compare_optimizers.command(args, "adam", 1e-3, "x")
    muon = compare_optimizers.command(args, "muon", 1e-3, "x")
    assert muon[:len(adam)] == adam and muon[len(adam):] == compare_optimizers.MUON_FLAGS
    assert "--optimizer" not in adam and adam[adam.index("--min-lr") + 1] == "0.0001"
    with pytest.raises(SystemExit) as e:
        compare_optimizers.main(["--data-path", "d", "--tokenizer-model", "t", "--out", str(tmp_path),
                                 "--train-iters", "25", "--eval-interval", "10"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a multiple of --eval-interval" in err[0]
    with pytest.raises(SystemExit):
        bench_optimizer.main(["--muon", "--muon-shapes", "100"])
    assert "is not HIDDENxLAYERS" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_optimizer_muon_tables(tmp_path, capsys):
    """The tool's --muon path end to end at tiny shapes: the AdamW and Muon rows of two shapes,
    and Muon at DP 1 against DP 2 ZeRO-1, whose ranks split the NS FLOPs between them (every
    matrix orthogonalised once, by its owner)."""
    result = bench_optimizer.main(["--muon", "--muon-shapes", "16x1", "32x2", "--hidden", "32", "--layers", "2",
                                   "--rounds", "1", "--threads", "2", "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert [s["shape"] for s in result["shapes"]] == ["16x1", "32x2"]
    assert set(result["shapes"][0]["median_ms"]) == {"torch fused", "megalite AdamW", "megalite Muon"}
    total = result["shapes"][1]["ns_flops_per_step"]
    assert result["dp"]["DP1"]["ns_flops_per_rank"] == [total]
    two = result["dp"]["DP2"]["ns_flops_per_rank"]
    assert sum(two) == total and min(two) > 0  # owned across both ranks, each matrix once
    assert "DP2" in out and "GFLOP per step" in out
    assert json.loads((tmp_path / "m.json").read_text())["dp"]["DP2"]["ns_flops_per_rank"] == two
