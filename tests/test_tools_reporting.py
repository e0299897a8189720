"""The reporting tools: scaling efficiency, log plots and the benchmark charts. Pictures are
read back with matplotlib (size, not blank) and SVGs parsed for their text, not compared
pixel by pixel."""
import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import scaling_efficiency  # noqa: E402


def check_png(path, min_height=200, min_width=300):
    import matplotlib.image
    import numpy as np
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] >= min_height and image.shape[1] >= min_width, image.shape
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 10  # not blank


def svg_texts(path):
    return [e.text or "" for e in ET.parse(str(path)).iter() if e.tag.endswith("text")]


def assert_texts(texts, *wanted):
    for w in wanted:
        assert any(w in t for t in texts), (w, texts)


def test_scaling_table_and_thresholds():
    rows = scaling_efficiency.table([1, 2, 4], [1000.0, 1800.0, 2400.0])
    assert [round(r["efficiency"], 2) for r in rows] == [1.0, 0.9, 0.6]
    assert [r["verdict"] for r in rows] == ["ok", "ok", "look at communication"]
    assert scaling_efficiency.verdict(0.4).startswith("communication-bound")


@pytest.mark.slow
def test_scaling_tool_runs_at_1_2_4_ranks(tmp_path, monkeypatch, capsys):
    """The tool's main in this process (its worlds fork from here, with torch already imported;
    every tool also runs as __main__ in test_tools_bad_input_one_line)."""
    monkeypatch.setattr(sys, "argv", ["scaling_efficiency.py", "--ranks", "1", "2", "4",
                                      "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"),
                                      *scaling_efficiency.DEFAULT[:-5], "--train-iters", "4", "--log-interval", "1000"])
    scaling_efficiency.main()
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [r["ranks"] for r in rows] == [1, 2, 4] and rows[0]["efficiency"] == 1.0
    assert "efficiency" in out and "demonstration" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert "chart:" in out
        check_png(tmp_path / "s.png")


def test_scaling_chart(tmp_path):
    pytest.importorskip("matplotlib")
    rows = scaling_efficiency.table([1, 2, 4, 8], [1000.0, 1800.0, 2400.0, 3000.0])
    assert scaling_efficiency.plot(rows, str(tmp_path / "s.svg"), note="a note") == [str(tmp_path / "s.svg")]
    assert_texts(svg_texts(tmp_path / "s.svg"), "Data-parallel scaling efficiency", "a note", "data-parallel ranks",
                 "0.7: look at communication", "0.5: communication-bound", "3,000 tok/s")


def write_log(path, scale, mfu=False, dry_run_lines=0):
    with open(path, "w") as f:
        for i in range(1, 31):
            dry = i <= dry_run_lines
            record = {"iteration": i, "loss": None if dry else scale * 5 * 0.97 ** i, "lr": 1e-3, "grad_norm": 1.0,
                      "tokens_per_sec": None if dry else 1000.0 + i, "tflops_per_gpu": None if dry else 0.01,
                      "mfu": (0.3 if mfu else None), "elapsed_ms": 512.0,
                      "memory_bytes": {"weights": 10 * 2**20, "gradients": 10 * 2**20},
                      "times_ms": {"forward": 100.0, "backward": 200.0 + i, "grad_sync": 5.0, "optimizer": 9.0}}
            if i % 10 == 0:
                record["valid_loss"] = scale * 4.5 * 0.98 ** i
            f.write(json.dumps(record) + "\n")
        f.write('{"iteration": 31, "loss"')  # a run still writing its next line


@pytest.mark.slow
def test_plot_log_png_and_svg(tmp_path, capsys):
    """In this process (the tool runs as a program in test_plot_log_missing_or_unreadable_file)."""
    pytest.importorskip("matplotlib")
    import plot_log
    write_log(tmp_path / "a.jsonl", 1.0)
    write_log(tmp_path / "b.jsonl", 1.5, dry_run_lines=3)
    assert plot_log.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--labels", "run A", "run B",
                          "--smooth", "5", "-o", str(tmp_path / "p.png"), "--format", "png", "svg"]) is None
    out = capsys.readouterr().out
    assert "run A: 30 iterations, loss 4.85 -> 2.005" in out
    assert "wrote " + str(tmp_path / "p.svg") in out
    check_png(tmp_path / "p.png", 600, 1000)
    assert_texts(svg_texts(tmp_path / "p.svg"), "Training log: run A, run B", "Loss against iteration",
                 "Loss against tokens seen", "tokens seen", "iteration", "loss (cross-entropy, nats/token)",
                 "run A", "run B", "validation loss", "tokens/s (all ranks)", "Model TFLOP/s per GPU",
                 "MiB (logging rank)", "forward", "grad sync", "Time per step: run A")


def test_plot_log_reading(tmp_path):
    import plot_log
    write_log(tmp_path / "log.jsonl", 1.0, dry_run_lines=2)
    records = plot_log.load(str(tmp_path / "log.jsonl"))
    assert len(records) == 30  # the half-written line is skipped
    seen = plot_log.tokens_seen(records)  # 1000+i tokens/s x 0.512 s per step; dry-run steps: the median
    median = sorted((1000.0 + i) * 0.512 for i in range(3, 31))[13:15]
    assert seen[1] == pytest.approx(sum(median) / 2) and seen[30] - seen[29] == pytest.approx(1030 * 0.512)
    assert plot_log.points(records, lambda r: r["loss"])[0][0] == 3
    assert plot_log.default_labels(["runs/a/log.jsonl", "runs/b/log.jsonl"]) == ["a/log.jsonl", "b/log.jsonl"]
    assert plot_log.default_labels(["x/a.jsonl", "y/a.jsonl"]) == ["x/a.jsonl", "y/a.jsonl"]
    assert plot_log.smoothed([1.0, 2.0, 3.0, 4.0], 3) == [1.5, 2.0, 3.0, 3.5]


@pytest.mark.slow
def test_bench_kernels_chart(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_kernels
    rows = [dict(kernel="attention", case=f"B1 H16 N{n} D128 causal", dtype="bfloat16", impl=impl,
                 fwd_rate=rate * n / 1024, bwd_rate=rate, unit="TFLOP/s")
            for n in (1024, 2048, 4096) for impl, rate in (("triton", 200.0), ("sdpa", 150.0))]
    rows += [dict(kernel="attention", case="B1 H16 N16384 D128", impl="sdpa", error="out of memory"),
             dict(kernel="rmsnorm", case="64x1000", dtype="float32", impl="triton", fwd_rate=10.0, bwd_rate=5.0,
                  unit="GB/s")]
    bench_kernels.plot(rows, str(tmp_path / "k.png"), "test device")
    bench_kernels.plot(rows, str(tmp_path / "k.svg"), "test device")
    check_png(tmp_path / "k.png")
    texts = svg_texts(tmp_path / "k.svg")
    assert_texts(texts, "Attention forward", "Attention backward", "sequence length N (tokens)", "4096",
                 "triton D128 bfloat16", "sdpa D128 bfloat16", "Norms and cross-entropy", "failed (not drawn)")
    if not bench_kernels.GPU:
        assert_texts(texts, "NOT meaningful")


def test_missing_matplotlib_names_the_install(monkeypatch, tmp_path):
    from megalite.observe import plotting
    from megalite.observe.timeline import draw_timeline
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plotting.require_matplotlib()
    with pytest.raises(ImportError, match=r"megalite\[plots\]"):
        draw_timeline([[("F", 0, 0, 0.0, 1.0)]], str(tmp_path / "t.png"))


def test_output_paths():
    from megalite.observe.plotting import output_paths
    assert output_paths("a/b.svg") == ["a/b.svg"] and output_paths("a/b") == ["a/b.png"]
    assert output_paths("a/b.png", ["png", "svg"]) == ["a/b.png", "a/b.svg"]
    assert output_paths("a/b.v1", ["pdf"]) == ["a/b.v1.pdf"]


def _simulated_events(schedule, P, M, unit=0.01):
    """A trace as the executor records it, from the schedule's simulation (unit-time ops)."""
    from megalite.pipeline.op_lists import simulate
    return [[(op.kind, op.micro, op.chunk, unit * a, unit * b) for op, a, b in ops]
            for ops in simulate(schedule, P, M).timed]


def test_timeline_zero_bubble_names_theory_and_weight_boxes(tmp_path):
    """B and W drawn apart (W in the orange family, one shade per chunk), the schedule guessed
    from the trace, the theory from the operation lists' simulation."""
    pytest.importorskip("matplotlib")
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    from megalite.pipeline.op_lists import theory_bubble as simulated
    from megalite.observe.timeline import (
        _shades, draw_timeline, idle_seconds, measured_bubble, schedule_name, schedule_theory)
    zb, zbv, classical = (_simulated_events(s, 2, 2) for s in ("zb-h1", "zbv", "1f1b"))
    assert [schedule_name(zb), schedule_name(zbv), schedule_name(classical)] == ["ZB-H1", "ZBV", "1F1B"]
    assert schedule_theory("ZB-H1", 4, 8) == ("(P-1)/(3M+P-1)", pytest.approx(3 / 27))
    assert schedule_theory("zbv", 4, 8)[1] == pytest.approx(simulated("zbv", 4, 8))
    assert schedule_theory("interleaved 1F1B", 4, 8, 2) == ("(P-1)/(V·M+P-1)", pytest.approx(3 / 19))
    assert schedule_theory("ZB-H1", 4, 2)[0] == "simulated, F=B=W"  # M < P: no closed form
    # ZB-H1, P=2, M=2: a span of 7 units, 6 of them busy on each rank (F, B, W per micro-batch).
    assert idle_seconds(zb) == pytest.approx([0.01, 0.01]) and measured_bubble(zb) == pytest.approx(1 / 7)

    oranges = [to_hex(c) for c in _shades(colormaps["Oranges"], 2)]
    draw_timeline(zbv, str(tmp_path / "zbv.svg"), num_micro=2)
    svg = (tmp_path / "zbv.svg").read_text()
    assert all(f"fill: {c}" in svg for c in oranges), oranges  # W boxes of both chunks
    assert_texts(svg_texts(tmp_path / "zbv.svg"), "ZBV schedule, P=2 stages, M=2 micro-batches, V=2 chunks",
                 f"theory simulated, F=B=W = {simulated('zbv', 2, 2):.3f}", "weight grad W (chunk 1)",
                 "backward B (input grad) (chunk 0)")
    draw_timeline(zb, str(tmp_path / "zb.svg"))
    assert_texts(svg_texts(tmp_path / "zb.svg"), "ZB-H1 schedule", "theory (P-1)/(3M+P-1) = 0.143", "weight grad W")
    draw_timeline(classical, str(tmp_path / "c.svg"))
    assert to_hex(_shades(colormaps["Oranges"], 1)[0]) not in (tmp_path / "c.svg").read_text()
    assert not any("weight grad" in t for t in svg_texts(tmp_path / "c.svg"))


def test_bench_pipeline_bubble_zero_bubble(tmp_path, capsys):
    """The benchmark on P=2, M=2 with 5 ms operations: ZB-H1 and ZBV run through the executor
    in their operation lists' order, their stages' backward deferring a W that sleeps t. (No
    assertion on the measured bubble: other work on a loaded machine can delay any sleep.)"""
    pytest.importorskip("matplotlib")
    import bench_pipeline_bubble

    from megalite.pipeline.op_lists import rank_ops
    t_ms = 5.0
    results = bench_pipeline_bubble.main(["--stages", "2", "--micro-batches", "2", "--schedules", "1f1b", "zb-h1",
                                          "zbv", "--t-forward-ms", str(t_ms), "--repeat", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for name in ("1F1B", "ZB-H1", "ZBV", "ZB-H1 / 1F1B, M=2: idle time"):
        assert name in out, out
    for schedule in ("1f1b", "zb-h1", "zbv"):
        assert (tmp_path / f"pipeline_P2_M2_{schedule}.png").exists()
    one, zb, zbv = results[("1f1b", 2)], results[("zb-h1", 2)], results[("zbv", 2)]
    t = t_ms / 1e3
    for r, chunk_t, schedule in ((zb, t, "zb-h1"), (zbv, t / 2, "zbv")):
        for rank, events in enumerate(r["events"]):
            assert [(e[0], e[1], e[2]) for e in events] == \
                [(op.kind, op.micro, op.chunk) for op in rank_ops(schedule, 2, 2, rank)]
        ops = [e for events in r["events"] for e in events]
        assert sorted({e[0] for e in ops}) == ["B", "F", "W"]
        assert all(e[4] - e[3] >= 0.95 * chunk_t for e in ops)  # every op slept its time, W too
        assert len([e for e in ops if e[0] == "W"]) == 2 * 2 * (2 if r is zbv else 1)  # M * P * chunks
    assert all(e[4] - e[3] >= 0.95 * 2 * t for events in one["events"] for e in events if e[0] == "B")
    assert zb["theory"] == pytest.approx(1 / 7) and one["theory"] == pytest.approx(1 / 3)
    # Theory idle per rank: (P-1) t for ZB-H1 against 3 (P-1) t for 1F1B.
    assert zb["theory_idle_ms"] == pytest.approx(t_ms) and one["theory_idle_ms"] == pytest.approx(3 * t_ms)


# -- a missing or unreadable input: one line naming the file, exit status 2, no traceback ------------

def _one_line_exit_2(capsys, call, *wanted):
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for text in wanted:
        assert text in err, err


def test_plot_log_missing_or_unreadable_file(tmp_path, capsys):
    import plot_log
    missing = str(tmp_path / "nope.jsonl")
    _one_line_exit_2(capsys, lambda: plot_log.main([missing]), f"plot_log.py: cannot read {missing}",
                     "No such file or directory")
    _one_line_exit_2(capsys, lambda: plot_log.main([str(tmp_path)]), str(tmp_path), "Is a directory")
    (tmp_path / "bad.jsonl").write_text('garbage\n{"iteration": 1}\n')
    _one_line_exit_2(capsys, lambda: plot_log.main([str(tmp_path / "bad.jsonl")]), "bad.jsonl: line 1 is not JSON")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_log.py"), missing],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() == f"plot_log.py: cannot read {missing}: No such file or directory"


def test_timeline_and_scaling_tools_missing_input(tmp_path, capsys, monkeypatch):
    import pipeline_timeline
    _one_line_exit_2(capsys, lambda: pipeline_timeline.main(["--trace-dir", str(tmp_path / "none")]),
                     f"pipeline_timeline.py: no trace_rank*.json in {tmp_path / 'none'}")
    missing = str(tmp_path / "nope.jsonl")
    monkeypatch.setattr(sys, "argv", ["scaling_efficiency.py", "--ranks", "1", "--logs", missing])
    _one_line_exit_2(capsys, scaling_efficiency.main, f"scaling_efficiency.py: cannot read {missing}")


def test_data_tools_missing_input(tmp_path, capsys):
    import preprocess_data
    import train_tokenizer
    missing = str(tmp_path / "nope.jsonl")
    _one_line_exit_2(capsys, lambda: preprocess_data.main(["--input", missing, "--output-prefix", str(tmp_path / "x"),
                                                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"]),
                     "preprocess_data.py:", missing)
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    _one_line_exit_2(capsys, lambda: preprocess_data.main(
        ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "x"),
         "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "t.model")]),
        "preprocess_data.py:", str(tmp_path / "t.model"))
    _one_line_exit_2(capsys, lambda: train_tokenizer.main(["--input", missing, "--model-prefix", str(tmp_path / "t")]),
                     "train_tokenizer.py:", missing)
    _one_line_exit_2(capsys, lambda: preprocess_data.main(["--input", str(tmp_path), "--output-prefix",
                                                           str(tmp_path / "x"), "--tokenizer-type", "NullTokenizer",
                                                           "--vocab-size", "9"]),
                     "is a directory; --input takes one .jsonl or text file")


def test_generate_missing_tokenizer(tmp_path, capsys):
    import generate
    assert generate.main(["--load", str(tmp_path), "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", str(tmp_path / "tok"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(tmp_path / "tok") in err and err.startswith("generate: ")


# -- bad input to any single-process tool: one line on stderr, exit status 2, no traceback ----------

def _bad_inputs(tmp_path):
    """(tool, argv, text the line must hold): a flag missing or with a bad value, a file that is
    missing or not what the flag expects, an output folder that does not exist."""
    (tmp_path / "bad.jsonl").write_text("garbage\n")
    corrupt = tmp_path / "corrupt_ckpt"
    corrupt.mkdir()
    (corrupt / "latest_checkpointed_iteration.txt").write_text("junk\n")
    (tmp_path / "empty").mkdir()
    nodir = str(tmp_path / "no_such_folder" / "out.json")
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "64", "--micro-batch-size", "1"]
    return [
        ("preprocess_data.py", ["--input", str(tmp_path / "bad.jsonl")], "required: --output-prefix"),
        ("convert_hf.py", ["--direction", "export", "--load", str(corrupt), "--hf-dir", str(tmp_path / "hf")],
         "convert_hf:"),
        ("convert_hf.py", ["--direction", "sideways", "--hf-dir", "x"], "invalid choice: 'sideways'"),
        ("reshard_checkpoint.py", ["--load", str(corrupt), "--save", str(tmp_path / "rs"),
                                   "--target-tensor-model-parallel-size", "2"], "reshard_checkpoint:"),
        ("plan_parallel.py", ["--model-size", "7B", "--gpus-per-node", "x"], "--gpus-per-node: invalid int value"),
        ("dry_run.py", ["--world-size", "1", *tiny, "--json", nodir], "does not exist"),
        ("dry_run.py", ["--world-size", "2", *tiny, "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ("train_tokenizer.py", ["--input", str(tmp_path / "bad.jsonl"), "--model-prefix", str(tmp_path / "t")],
         "is not valid JSON"),
        ("zero_report.py", ["--dp", "2", "--json", nodir], "does not exist"),
        ("scaling_efficiency.py", ["--ranks", "0"], "--ranks takes positive integers"),
        ("plot_log.py", [str(tmp_path / "missing.jsonl")], "cannot read"),
        ("pipeline_timeline.py", ["--trace-dir", str(tmp_path / "empty")], "no trace_rank"),
        ("bench_kernels.py", ["--json", nodir], "does not exist"),
        ("bench_tp_comm.py", ["--tp", "0"], "positive integers, got 0"),
        ("bench_cp.py", ["--cp", "x"], "invalid int value: 'x'"),
        ("bench_pipeline_bubble.py", ["--stages", "0"], "positive integers, got 0"),
        ("bench_overhead.py", ["--num-attention-heads", "3"], "not divisible by --num-attention-heads 3"),
        ("bench_optimizer.py", ["--rounds", "0"], "positive integers, got 0"),
        ("bench_packed.py", ["--doc", "0"], "positive integers, got 0"),
        ("bench_host_syncs.py", ["--steps", "0"], "positive integers, got 0"),
        ("bench_generation_cache.py", ["--context", "0"], "positive integers, got 0"),
    ]


_DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
results = []
for tool, argv in json.loads(sys.argv[1]):
    err, code = io.StringIO(), 0
    sys.argv = [tool] + argv
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(tool, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def _assert_one_line(tool, argv, wanted, code, err):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (tool, argv, code, err)
    assert wanted in err and tool.split(".")[0] in err, (tool, wanted, err)


def test_tools_bad_input_one_line(tmp_path):
    """Every case in one fork of this process (torch imported already; a new interpreter per
    tool: the own-process test below): each tool run as __main__ by the driver's code."""
    cases = _bad_inputs(tmp_path)
    out = tmp_path / "driver.txt"
    argv = [json.dumps([[os.path.join(ROOT, "tools", t), a] for t, a, _ in cases])]
    pid = os.fork()
    if pid == 0:  # the driver, as `python -c _DRIVER argv` would run it, stdout to a file
        code = 1
        try:
            os.chdir(tmp_path)
            sys.argv = ["-c", *argv]
            with open(out, "w") as sys.stdout:
                exec(compile(_DRIVER, "<driver>", "exec"), {"__name__": "__main__"})
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out.read_text()[-3000:] if out.exists() else status
    for (tool, argv, wanted), (code, err) in zip(cases, json.loads(out.read_text().strip().splitlines()[-1])):
        _assert_one_line(tool, argv, wanted, code, err)


@pytest.mark.slow
def test_tool_bad_input_own_process(tmp_path):
    """Some of the same cases as the user meets them, each tool in its own process (a fresh
    interpreter, the tool's own imports); every case runs as __main__ in the test above. The
    processes run at once (each is one interpreter starting: on two cores, two at a time). Every
    tool a guide runs is here (the guides' commands run in forks: tests/forked_commands.py),
    but those started in a new interpreter elsewhere: plot_log.py (its own process above),
    preprocess_data.py (tests/test_hf_tokenizer.py), reshard_checkpoint.py
    (tests/test_transformer_engine.py, on a TE checkpoint without TE) and dry_run.py (by
    launch.sh under docs/recipes.md's ``ACTION=dry-run``, tests/test_docs_commands.py)."""
    every = _bad_inputs(tmp_path)
    # the HF conversion, the planner, the tokenizer trainer, ZeRO's report, the pipeline
    # timeline and a benchmark
    cases = [every[i] for i in (2, 4, 7, 8, 11, 13)]
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", tool), *argv], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, cwd=str(tmp_path)) for tool, argv, _ in cases]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    for (tool, argv, wanted), p, err in zip(cases, procs, errs):
        _assert_one_line(tool, argv, wanted, p.returncode, err)


def test_tool_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """An exception that is not about the user's input (here a KeyError inside the work) is not
    turned into one line: it propagates, so its traceback shows."""
    sys.path.insert(0, ROOT)
    from tools import reshard_checkpoint

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(reshard_checkpoint, "reshard", broken)
    with pytest.raises(KeyError):
        reshard_checkpoint.main(["--load", str(tmp_path), "--save", str(tmp_path / "out")])
