"""The reporting tools: scaling efficiency and log plots."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import scaling_efficiency  # noqa: E402


def test_scaling_table_and_thresholds():
    rows = scaling_efficiency.table([1, 2, 4], [1000.0, 1800.0, 2400.0])
    assert [round(r["efficiency"], 2) for r in rows] == [1.0, 0.9, 0.6]
    assert [r["verdict"] for r in rows] == ["ok", "ok", "look at communication"]
    assert scaling_efficiency.verdict(0.4).startswith("communication-bound")


def test_scaling_tool_runs_at_1_2_4_ranks(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scaling_efficiency.py"), "--ranks", "1", "2", "4",
                          "--json", str(tmp_path / "s.json"), *scaling_efficiency.DEFAULT[:-5], "--train-iters", "4",
                          "--log-interval", "1000"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [r["ranks"] for r in rows] == [1, 2, 4] and rows[0]["efficiency"] == 1.0
    assert "efficiency" in out.stdout and "demonstration" in out.stdout


def test_plot_log_writes_a_png(tmp_path):
    for name, scale in (("a", 1.0), ("b", 1.5)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(1, 11):
                f.write(json.dumps({"iteration": i, "loss": scale * (5 - 0.3 * i), "tokens_per_sec": 1000 + i,
                                    "memory_bytes": {"weights": 10}, **({"valid_loss": 4.0} if i == 10 else {})}) + "\n")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_log.py"), str(tmp_path / "a.jsonl"),
                          str(tmp_path / "b.jsonl"), "--output", str(tmp_path / "p.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "a.jsonl (10 iterations)" in out.stdout and "loss: y from" in out.stdout
