"""scripts/gpu_check.sh and its tools (gpu_check, _runner, _results, _shard, _bench), on a CPU.

Without a GPU the script says so, runs nothing and exits 0; ``--plan`` works anywhere, without
importing torch, and totals at most 480 s. The runner is checked with stand-in parts that are
real processes: one that overruns its budget is killed with its process tree (SIGINT first) and
the next part still runs; a failing part fails alone; summary.json is rewritten after each part;
the 480 s limit cuts or skips parts.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tools import gpu_check, gpu_check_bench, gpu_check_shard
from tools import gpu_check_results as results
from tools.gpu_check_runner import Command, Part, Run

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
                    reason="this machine has a GPU (or nvidia-smi): the script would run the whole check")
@pytest.mark.slow
def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out))
    run = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gpu_check:" in run.stdout and "no GPU on this machine" in run.stdout and "nothing to run" in run.stdout
    assert "(a)" not in run.stdout and not out.exists()  # nothing ran, no results folder


def test_plan_runs_without_torch_and_fits_480_s(tmp_path):
    """--plan on a machine whose torch cannot even be imported: it never imports it."""
    (tmp_path / "torch.py").write_text("raise ImportError('gpu_check --plan must not import torch')\n")
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(tmp_path), OUT=str(tmp_path / "out"))
    text = subprocess.run(["bash", str(SCRIPT), "--plan"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert text.returncode == 0, text.stdout + text.stderr
    for part in ("probe", "a", "b", "e", "c-triton", "f", "c-torch", "d"):
        assert re.search(rf"^  {re.escape(part)} +\d+ s", text.stdout, re.M), (part, text.stdout)
    assert "ZB-H1" in text.stdout and "ZBV" in text.stdout and "a2a and allgather" in text.stdout
    assert "bench_checkpoint.py --device cuda" in text.stdout and "preflight" in text.stdout
    total = int(re.search(r"^  total +(\d+) s", text.stdout, re.M).group(1))
    assert total <= 480 and not (tmp_path / "out").exists()

    plan = json.loads(subprocess.run(["bash", str(SCRIPT), "--plan", "--json"], env=env, capture_output=True,
                                     text=True, timeout=60, check=True).stdout)
    parts = {p["part"]: p for p in plan["parts"]}
    assert parts["a"]["stage"] == parts["b"]["stage"] == parts["e"]["stage"]  # side by side
    assert parts["e"]["budget_s"] <= parts["a"]["budget_s"]  # (e) adds no plan time
    assert parts["f"]["beside"] == [] and parts["f"]["mode"] == "required"  # it times: alone
    stages = {}
    for p in plan["parts"]:
        if p["mode"] != "extra" and not p.get("unavailable"):
            stages[p.get("stage", 0)] = max(stages.get(p.get("stage", 0), 0), p["budget_s"])
    assert plan["total_s"] == sum(stages.values()) == total
    assert plan["total_s"] + plan["reserve_s"] <= plan["limit_s"] == 480
    assert parts["c-te-bf16"]["mode"] == "extra" and parts["d"]["mode"] == "stretch"
    assert parts["c-torch"]["mode"] == "extra" and not parts["c-torch"]["unavailable"]  # shortened to fit (f)


def test_the_real_parts_commands(tmp_path):
    """Fixed tiles in (a)-(c), autotuning only in (d); pytest shards, 8 ranks, 12 iterations."""
    stages = gpu_check.build_stages(sys.executable, ["--quick"])
    parts = {p.key: p for stage in stages for p in stage}
    cmds = {k: p.commands(tmp_path) for k, p in parts.items()}
    for key in ("a", "b", "e", "c-triton", "c-torch", "f"):
        assert all(c.env["MEGALITE_KERNEL_TUNING"] == "fixed" for c in cmds[key]), key
    assert cmds["d"][0].env["MEGALITE_KERNEL_TUNING"] == "autotune" and "--quick" in cmds["d"][0].argv
    k = gpu_check.SHARDS
    assert [c.env["GPU_CHECK_SHARD"] for c in cmds["a"]] == [f"{i}/{k}" for i in range(k)]
    assert sorted((c.env["WORLD_SIZE"], c.env["RANK"]) for c in cmds["b"]) == [("8", "0")] * 4 + [("8", "7")] * 4
    assert len({c.log for c in cmds["b"]}) == 8
    assert cmds["c-triton"][0].argv[cmds["c-triton"][0].argv.index("--train-iters") + 1] == "12"
    for cmd in (c for cs in cmds.values() for c in cs):
        script = next((a for a in cmd.argv[1:] if str(a).endswith(".py")), None)
        assert script is None or (REPO / script).is_file(), script
    assert [[p.key for p in s] for s in stages][0] == ["a", "b", "e"]
    assert len(cmds["e"]) == len(gpu_check.DRY_LAYOUTS) and cmds["f"][0].argv[1] == "tools/bench_checkpoint.py"


# -- the runner, with stand-in parts (real processes) ------------------------------------------------

def code_part(key, code, budget, mode="required", judge=None):
    def rc_judge(out, outcomes):
        return all(o.rc == 0 for o in outcomes), {"rc": [o.rc for o in outcomes]}, f"(exit {outcomes[0].rc})"
    return Part(key, f"stand-in {key}", budget, lambda out: [Command([sys.executable, "-c", code], f"{key}.log")],
                judge or rc_judge, mode=mode)


def run_parts(tmp_path, stages, limit_s=60.0, **kw):
    lines = []
    kw.setdefault("min_run_s", 0.5)  # the stand-ins' budgets are seconds, not minutes
    run = Run(stages, tmp_path / "out", limit_s, time.monotonic(), lines.append, **kw)
    ok = run.run()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    return ok, summary, {p["part"]: p for p in summary["parts"]}, lines


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in state  # a zombie waiting for its reaper has ended


@pytest.mark.slow
def test_an_overrun_part_is_killed_with_its_children_and_the_rest_still_run(tmp_path):
    pid_file, seen = tmp_path / "grandchild.pid", tmp_path / "seen.json"
    sleeper = code_part("sleep", f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open({str(pid_file)!r}, "w").write(str(child.pid))
print("started a grandchild", flush=True)
time.sleep(60)
""", budget=1.5)
    failer = code_part("fail", f"""
import json, sys
parts = {{p["part"]: p["status"] for p in json.load(open({str(tmp_path / 'out' / 'summary.json')!r}))["parts"]}}
json.dump(parts, open({str(seen)!r}, "w"))
sys.exit(3)
""", budget=20)
    passer = code_part("pass", "print('fine')", budget=20)
    t0 = time.monotonic()
    ok, summary, parts, lines = run_parts(tmp_path, [[sleeper], [failer], [passer]], grace_s=0.5)
    assert not ok and time.monotonic() - t0 < 15
    assert {k: p["status"] for k, p in parts.items()} == {"sleep": "timeout", "fail": "fail", "pass": "pass"}
    assert parts["sleep"]["seconds"] < 5 and "started a grandchild" in parts["sleep"]["log_tail"]
    assert gone(int(pid_file.read_text())), "the part's process group (its grandchild too) must be killed"
    # summary.json was on disk, with the first part's result, when the second started
    assert json.loads(seen.read_text()) == {"sleep": "timeout", "fail": "running", "pass": "pending"}
    assert parts["fail"]["figures"] == {"rc": [3]} and parts["pass"]["figures"] == {"rc": [0]}
    assert summary["failed_parts"] == ["sleep", "fail"] and summary["overall"] == "fail" and summary["finished"]
    assert [line.split(":")[1].split()[0] for line in lines] == ["TIMEOUT", "FAIL", "PASS"]


@pytest.mark.slow
def test_an_overrun_part_gets_sigint_before_sigkill(tmp_path):
    flag = tmp_path / "interrupted"
    part = code_part("slow", f"""
import sys, time
try:
    time.sleep(60)
except KeyboardInterrupt:
    open({str(flag)!r}, "w").write("cleaned up")
    sys.exit(130)
""", budget=2.0)
    ok, _, parts, _ = run_parts(tmp_path, [[part]], grace_s=1.0)
    assert not ok and parts["slow"]["status"] == "timeout" and flag.read_text() == "cleaned up"
    assert parts["slow"]["commands"][0]["rc"] == 130


@pytest.mark.slow
def test_the_total_limit_cuts_then_skips_parts(tmp_path):
    sleep = "import time; time.sleep(30)"
    stages = [[code_part("one", sleep, 2.0)], [code_part("two", sleep, 20.0)], [code_part("three", sleep, 1.0)]]
    t0 = time.monotonic()
    ok, summary, parts, _ = run_parts(tmp_path, stages, limit_s=5.5, reserve_s=0.5, min_run_s=0.5, grace_s=0.2)
    assert time.monotonic() - t0 < 5.5 and not ok
    assert parts["one"]["status"] == "timeout" and parts["two"]["status"] == "timeout"
    assert "budget cut from 20" in parts["two"]["note"] and parts["two"]["budget_run_s"] < 3.5
    assert parts["three"]["status"] == "skipped" and "left of the 6 s limit" in parts["three"]["summary"]
    assert summary["failed_parts"] == ["one", "two", "three"]


@pytest.mark.slow
def test_side_by_side_parts_extras_and_a_stretch_part(tmp_path):
    """a and b run at once; an extra without spare time is skipped (not a failure); a stretch part
    may run past its own budget into time the others left; a part that cannot run here is skipped."""
    stamp = "import json, sys, time; t = time.time(); time.sleep(1); json.dump([t, time.time()], open(sys.argv[1], 'w'))"

    def timed(key, budget):
        return Part(key, key, budget, lambda out: [Command([sys.executable, "-c", stamp, str(tmp_path / key)],
                                                           f"{key}.log")],
                    lambda out, o: (o[0].rc == 0, {}, ""))
    extra = code_part("extra", "print(1)", 100.0, mode="extra")
    stretch = code_part("stretch", "import time; time.sleep(1.5)", 0.5, mode="stretch")
    absent = code_part("absent", "raise SystemExit(1)", 5.0)
    absent.unavailable = "a library is not installed"
    ok, summary, parts, _ = run_parts(tmp_path, [[timed("a", 5), timed("b", 5)], [extra], [absent], [stretch]],
                                      limit_s=30)
    (a0, a1), (b0, b1) = (json.loads((tmp_path / k).read_text()) for k in "ab")
    assert a0 < b1 and b0 < a1, "a and b must overlap"
    assert parts["extra"]["status"] == "skipped" and "to spare" in parts["extra"]["summary"]
    assert parts["absent"]["status"] == "skipped" and parts["absent"]["unavailable"]
    assert parts["stretch"]["status"] == "pass" and parts["stretch"]["seconds"] >= 1.4
    assert ok and summary["overall"] == "pass" and summary["failed_parts"] == []


RUNNER = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from tools.gpu_check_runner import Command, Part, Run
code = "import os, time; open({pid!r}, 'w').write(str(os.getpid())); time.sleep(60)"
part = Part("sleep", "sleep", 60, lambda out: [Command([sys.executable, "-c", code], "sleep.log")],
            lambda out, o: (True, {{}}, ""))
Run([[part]], Path({out!r}), 120, time.monotonic(), print).run()
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stopped_check_stops_its_parts(tmp_path, how):
    """SIGTERM: the runner kills the running part and records it "interrupted"; SIGKILL (no
    chance to clean up): the part dies with it (PR_SET_PDEATHSIG)."""
    import signal

    pid, out = tmp_path / "part.pid", tmp_path / "out"
    runner = subprocess.Popen([sys.executable, "-c", RUNNER.format(repo=str(REPO), pid=str(pid), out=str(out))])
    deadline = time.monotonic() + 30
    while not pid.exists() or not pid.read_text():
        assert time.monotonic() < deadline and runner.poll() is None
        time.sleep(0.05)
    runner.send_signal(getattr(signal, how))
    runner.wait(timeout=30)
    part_pid = int(pid.read_text())
    deadline = time.monotonic() + 10
    while not gone(part_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(part_pid)
    summary = json.loads((out / "summary.json").read_text())
    if how == "SIGTERM":
        assert summary["parts"][0]["status"] == "interrupted" and summary["finished"]
        assert summary["overall"] == "fail"
    else:
        assert summary["parts"][0]["status"] == "running" and not summary["finished"]


def test_a_broken_judge_or_missing_program_fails_only_its_part(tmp_path):
    def broken(out, outcomes):
        raise KeyError("figures")
    missing = Part("missing", "no such program", 5, lambda out: [Command(["/nonexistent/program"], "missing.log")],
                   lambda out, o: (o[0].rc == 0, {}, ""))
    ok, _, parts, _ = run_parts(tmp_path, [[code_part("judge", "pass", 5, judge=broken)], [missing],
                                           [code_part("fine", "pass", 5)]])
    assert parts["judge"]["status"] == "fail" and "judge_error" in parts["judge"]["figures"]
    assert parts["missing"]["status"] == "fail" and parts["missing"]["commands"][0]["rc"] is None
    assert parts["fine"]["status"] == "pass" and not ok


def test_run_check_writes_summary_txt_and_json(tmp_path, capsys):
    """The check as it runs after the probe found a GPU, with stand-in parts."""
    info = dict(cuda=True, gpu="Stand-in GPU", sms=132, memory_gib=139.8, python="3.12", torch="2.11", triton="3.6")
    stages = [[code_part("a", "print('ok')", 5), code_part("b", "raise SystemExit(2)", 5)]]
    rc = gpu_check.run_check(stages, tmp_path / "out", info, "", time.monotonic(), limit_s=60, min_run_s=0.5)
    text = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert rc == 1 and all(line.startswith("gpu_check: ") for line in text)
    assert "Stand-in GPU" in text[1] and "132 SMs" in text[1] and "triton 3.6" in text[2]
    assert any("(a) stand-in a: PASS" in line for line in text) and any("(b) stand-in b: FAIL" in line for line in text)
    assert text[-1].startswith("gpu_check: FAILED parts: b;") and text[-1] in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["gpu"]["gpu"] == "Stand-in GPU" and summary["overall"] == "fail" and summary["finished"]


# -- reading results ---------------------------------------------------------------------------------

SKIPS = '''
import pytest
def test_ok(): pass
def test_te():
    pytest.skip("transformer-engine is not installed; it needs a CUDA GPU with cuDNN: pip install megalite[te]")
def test_fa():
    pytest.importorskip("flash_attn", reason="flash-attn is not installed (it builds only on a CUDA machine)")
def test_fa_default(): pytest.importorskip("flash_attn")
def test_other(): pytest.skip("TRITON_INTERPRET=1 was set when megalite.kernels was imported")
'''


def pytest_xml(tmp_path, source, name):
    (tmp_path / f"test_{name}.py").write_text(source)
    xml = tmp_path / f"{name}.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"test_{name}.py",
                          f"--junitxml={xml}", "--rootdir", str(tmp_path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    return run.returncode, xml


def outcome(xml, rc=0):
    return types.SimpleNamespace(command=Command(["python", f"--junitxml={xml}"], "a.log"), rc=rc)


def test_library_skips_are_not_failures_other_skips_are(tmp_path):
    rc, xml = pytest_xml(tmp_path, SKIPS, "skips")
    ok, fig, line = results.judge_pytest(tmp_path, [outcome(xml, rc)])
    assert fig["skipped_not_installed"] == {"transformer-engine not installed": 1, "flash-attn not installed": 2}
    assert len(fig["skipped_other"]) == 1 and "TRITON_INTERPRET" in fig["skipped_other"][0]
    assert not ok and "skipped: 4, transformer-engine not installed (1), flash-attn not installed (2)" in line
    rc, xml = pytest_xml(tmp_path, SKIPS.replace("def test_other", "def _other"), "libs")
    ok, fig, line = results.judge_pytest(tmp_path, [outcome(xml, rc)])
    assert ok and fig["passed"] == 1 and fig["skipped"] == 3 and fig["failed_tests"] == [], line
    ok, fig, line = results.judge_pytest(tmp_path, [outcome(xml, rc), outcome(tmp_path / "none.xml", -9)])
    assert not ok and fig["no_junit"] and "exit -9" in line  # a shard killed before writing its XML


@pytest.mark.slow
def test_shards_hold_each_test_once_and_keep_module_fixtures_together(tmp_path):
    (tmp_path / "test_many.py").write_text('''
import pytest
@pytest.fixture(scope="module")
def shared():
    return 1
@pytest.mark.parametrize("i", range(7))
def test_p(i): pass
def test_s1(shared): pass
def test_s2(shared, tmp_path): pass
''')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    shards = []
    for i in range(3):
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-p", "tools.gpu_check_shard", "test_many.py", "--rootdir", str(tmp_path)],
                             cwd=tmp_path, env=dict(env, GPU_CHECK_SHARD=f"{i}/3"), capture_output=True, text=True,
                             timeout=60)
        shards.append([x for x in run.stdout.splitlines() if "::" in x])
    every = [t for s in shards for t in s]
    assert len(every) == len(set(every)) == 9
    assert any({"test_many.py::test_s1", "test_many.py::test_s2"} <= set(s) for s in shards)
    assert max(map(len, shards)) - min(map(len, shards)) <= 3
    assert gpu_check_shard.split(["x", "y", "x", "z"], [1, 5, 1, 1], 2) == [1, 0, 1, 1]
    with pytest.raises(ValueError, match="i/K"):
        gpu_check_shard.shard_spec("2")


def test_gpt_figures_use_iterations_7_to_12_time_weighted():
    records = [dict(iteration=i, loss=10.0 - i / 10, elapsed_ms=1000.0 if i > 6 else 5000.0,
                    tokens_per_sec=8000.0 if i < 12 else 16000.0, tflops_per_gpu=100.0, mfu=0.25)
               for i in range(1, 13)]
    fig = results.gpt_figures(records, "model: 1316.3M parameters\n")
    assert fig["window"] == "iterations 7-12" and fig["parameters"] == "1316.3M"
    assert fig["tokens_per_sec"] == round((5 * 8000 + 16000) / 6) and fig["mfu_pct"] == 25.0
    partial = results.gpt_figures(records[:5], "")
    assert partial["iterations"] == 5 and "tokens_per_sec" not in partial


def test_a_gpt_run_cut_mid_line_still_reports_its_iterations(tmp_path):
    log = tmp_path / "c_gpt1p3b_triton.log"
    log.write_text("model: 1316.3M parameters\n")
    lines = [json.dumps(dict(iteration=i, loss=9.0, elapsed_ms=300.0, tokens_per_sec=27000.0, tflops_per_gpu=250.0))
             for i in (1, 2, 3)]
    (tmp_path / "c_gpt1p3b_triton.jsonl").write_text("\n".join(lines) + '\n{"iteration": 4, "lo')
    cut = types.SimpleNamespace(rc=-9, log=log)
    ok, fig, line = results.gpt_judge("triton")(tmp_path, [cut])
    assert not ok and fig["iterations"] == 3 and fig["parameters"] == "1316.3M" and "3/12 iterations" in line


def test_bench_rows_are_kept_per_section_and_read_back_when_cut_short(tmp_path):
    bench = types.ModuleType("stand_in_bench")
    bench.bench_attention = lambda *a: [dict(kernel="attention", case="N1k", impl=impl, fwd_rate=r, bwd_rate=r / 2)
                                        for impl, r in (("triton", 400.0), ("sdpa-flash", 500.0))]
    bench.bench_rowwise = lambda *a: [dict(kernel="layernorm", case="4k", impl="triton", fwd_rate=2000.0)]
    bench.bench_grouped = lambda *a: [dict(kernel="grouped GEMM", case="E8", impl="triton", error="boom")]
    rows = tmp_path / "d_bench_rows.jsonl"
    gpu_check_bench.keep_rows(bench, str(rows))
    bench.bench_attention()
    bench.bench_rowwise()
    cut = types.SimpleNamespace(rc=-9)
    ok, fig, line = results.judge_bench(tmp_path, [cut])
    assert not ok and fig["rows"] == 3 and not fig["complete"] and "partial" in line
    assert fig["attention_best_tflops_fwd_bwd"] == {"triton": [400.0, 200.0], "sdpa-flash": [500.0, 250.0]}
    bench.bench_grouped()
    (tmp_path / "d_bench_kernels.json").write_text(json.dumps(
        {"rows": [json.loads(x) for x in rows.read_text().splitlines()]}))
    ok, fig, line = results.judge_bench(tmp_path, [types.SimpleNamespace(rc=0)])
    assert not ok and fig["complete"] and fig["triton_errors"] == ["grouped GEMM E8"]
