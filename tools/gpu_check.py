"""The GPU acceptance check (scripts/gpu_check.sh): its parts, their budgets, the probe, the CLI.

The probe (one python process: what torch sees) is followed by the preflight
(tools/gpu_check_preflight.py: Triton's C compiler and cache folder, nvcc, driver, free memory),
which stops the check with the fix before any part when every Triton kernel would fail.

    python tools/gpu_check.py --plan [--json]     # the parts, budgets and total; no torch import
    python tools/gpu_check.py [--out DIR]         # run (one CUDA GPU), results in DIR/

Standard library only (tools/gpu_check_runner.py runs the parts; tools/gpu_check_results.py
reads their results), so it reports even where ``import torch`` is broken. The budgets'
arithmetic is in scripts/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools import gpu_check_preflight as check_preflight  # noqa: E402
from tools import gpu_check_results as results  # noqa: E402
from tools.gpu_check_runner import (  # noqa: E402
    RESERVE_S,
    Command,
    Part,
    Run,
    plan_total,
    stage_budget,
    write_json_atomic,
)

LIMIT_S = 480          # the whole check, probe included: 15 min of device time = a failed start + one rerun
PROBE_S = 20
SHARDS = 5             # part (a): pytest processes side by side
FAKE_RANKS = (0, 7)
FIXED = {"MEGALITE_KERNEL_TUNING": "fixed"}        # one tile config per kernel: parts a, b, c, e, f
AUTOTUNE = {"MEGALITE_KERNEL_TUNING": "autotune"}  # every config timed: part d only

SMALL = ["--mock-data", "--vocab-size", "1024", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads",
         "8", "--seq-length", "256", "--micro-batch-size", "2", "--global-batch-size", "8", "--bf16",
         "--hidden-dropout", "0", "--attention-dropout", "0"]  # ring attention (CP) has no attention dropout
FAKE = ["--fake-process-group", "--device", "cuda", *SMALL, "--train-iters", "2"]
LAYOUTS = {
    "tp2pp2dp2_zero1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
    "tp2cp2dp2": ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"],
    "tp4dp2_zero3": ["--tensor-model-parallel-size", "4", "--zero-stage", "3"],
    "tp2dp4_ep4_moe": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "8",
                       "--moe-router-topk", "2", "--expert-model-parallel-size", "4", "--moe-aux-loss-coeff", "1e-2",
                       "--moe-grouped-gemm", "--zero-stage", "1"],
}
GPT = ["--device", "cuda", "--bf16", "--mock-data", "--vocab-size", "50257", "--num-layers", "24", "--hidden-size",
       "2048", "--num-attention-heads", "16", "--seq-length", "2048", "--micro-batch-size", "4", "--train-iters",
       str(results.GPT_ITERS), "--log-interval", str(results.GPT_WINDOW), "--hidden-dropout", "0",
       "--attention-dropout", "0"]  # values are read once per log interval: the last one is the window
GPT_RUNS = {  # name -> (flags, mode); transformer-engine runs are extras (only with TE, only spare time)
    "triton": (["--attention-backend", "triton"], "required"),
    "torch": (["--attention-backend", "torch"], "extra"),  # shortened to fit (f): scripts/gpu_check.sh
    "te_bf16": (["--transformer-impl", "transformer_engine"], "extra"),
    "te_fp8": (["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--fp8-amax-history-len",
                "1024", "--fp8-amax-compute-algo", "max"], "extra"),
}
# part (e): tools/dry_run.py --device cuda, one process per layout of 8 fake ranks, every pipeline
# stage's role in it (one iteration each): the zero-bubble executor and the CP a2a / allgather blocks
DRY_LAYOUTS = {
    "tp2pp2dp2_zb-h1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                        "--pipeline-schedule", "zb-h1", "--zero-stage", "2", "--overlap-grad-reduce"],
    "tp2pp2dp2_zbv": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--pipeline-schedule", "zbv", "--sequence-parallel"],  # 4 layers = 2 ranks x 2 chunks
    "tp2cp2dp2_a2a": ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--cp-comm-type", "a2a"],
    "tp2cp2dp2_allgather": ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                            "--cp-comm-type", "allgather"],
}
DRY_WORLD = 8
CKPT_BENCH = ["--device", "cuda", "--rounds", "3"]  # part (f): 42M parameters, a 481 MiB checkpoint
# seconds per part: the arithmetic behind each is in scripts/gpu_check.sh
# C, the cold cost of one kernel variant: triton.compile (tools/compile_kernels.py) + the C launcher build
# (tools/gpu_check_launcher.py, gcc -O3 of Triton 3.6's generated launcher), measured here on 2 cores
C_COMPILE, C_LAUNCHER = 0.6, 0.4
C = C_COMPILE + C_LAUNCHER
BUDGETS = {"a": 120, "b": 90, "e": 60, "c": 45, "f": 40, "d": 245}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None  # finds, does not import
    except (ImportError, ValueError):
        return False


def build_stages(py: str, bench_args: list) -> list:
    """The parts of the check, in stages (parts of a stage run side by side)."""

    def pytest_shards(out: Path) -> list:
        tmp = tempfile.mkdtemp(prefix="gpu_check_a_")  # pytest's tmp_path: checkpoints stay out of OUT
        return [Command([py, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
                         "-p", "tools.gpu_check_shard", "--continue-on-collection-errors", "tests/",
                         f"--junitxml={out}/a_pytest_gpu_{i}.xml",
                         f"--basetemp={tmp}/shard{i}"], f"a_pytest_gpu_{i}.log",
                        dict(FIXED, GPU_CHECK_SHARD=f"{i}/{SHARDS}")) for i in range(SHARDS)]

    def fake_ranks(out: Path) -> list:
        return [Command([py, "pretrain_gpt.py", *FAKE, *flags], f"b_{name}_rank{rank}.log",
                        dict(FIXED, WORLD_SIZE="8", RANK=str(rank), OMP_NUM_THREADS="2"))  # 16 cores, shared with (a)
                for name, flags in LAYOUTS.items() for rank in FAKE_RANKS]

    def dry_runs(out: Path) -> list:
        return [Command([py, "tools/dry_run.py", "--world-size", str(DRY_WORLD), "--device", "cuda", *SMALL, *flags,
                         "--json", f"{out}/e_{name}.json"], f"e_{name}.log", dict(FIXED, OMP_NUM_THREADS="1"))
                for name, flags in DRY_LAYOUTS.items()]

    def gpt(name: str, flags: list):
        return lambda out: [Command([py, "pretrain_gpt.py", *GPT, "--log-json", f"{out}/c_gpt1p3b_{name}.jsonl", *flags],
                                    f"c_gpt1p3b_{name}.log", dict(FIXED))]

    def checkpoint_bench(out: Path) -> list:
        return [Command([py, "tools/bench_checkpoint.py", *CKPT_BENCH, "--json", f"{out}/f_bench_checkpoint.json"],
                        "f_bench_checkpoint.txt", dict(FIXED))]

    def bench(out: Path) -> list:
        return [Command([py, "tools/gpu_check_bench.py", f"{out}/d_bench_rows.jsonl", *bench_args, "--json",
                         f"{out}/d_bench_kernels.json"], "d_bench_kernels.txt", dict(AUTOTUNE))]

    te = None if installed("transformer_engine") else "transformer-engine is not installed"
    a = Part("a", "pytest -m gpu tests/", BUDGETS["a"], pytest_shards, results.judge_pytest,
             f"{SHARDS} pytest shards side by side, fixed tiles: ~175 kernel variants x {C:.1f} s + 6 training "
             f"processes x 10 s + 5 x 15 s start = ~310 CPU-s; the longest shard (3 runs in a row) ~90 s")
    b = Part("b", f"fake process group on CUDA, ranks {' and '.join(map(str, FAKE_RANKS))} of "
             "TP2xPP2xDP2 ZeRO-1, TP2xCP2xDP2, TP4xDP2 ZeRO-3, MoE TP2xDP4 EP4", BUDGETS["b"], fake_ranks,
             results.judge_fake, f"8 processes at once beside (a): 10 s start + ~12 variants x {C:.1f} s + 2 "
             "iterations, ~30 s")
    e = Part("e", "fake process group on CUDA, tools/dry_run.py --device cuda, every stage's role of TP2xPP2xDP2 "
             "ZB-H1 ZeRO-2 and ZBV SP, TP2xCP2xDP2 CP a2a and allgather", BUDGETS["e"], dry_runs,
             results.judge_dry_runs, f"4 processes at once beside (a) and (b): 10 s start + ~12 variants x {C:.1f} s "
             "+ 1-2 roles x (build + 1 tracked iteration, ~3 s), ~30 s")
    stages = [[a, b, e]]
    for name, (flags, mode) in GPT_RUNS.items():
        title = f"GPT ~1.3B bf16 (24 x 2048, seq 2048, micro 4), {results.GPT_ITERS} iterations, {' '.join(flags)}"
        why = (f"10 s start + ~9 s drawing 1.3B weights on the CPU + ~8 variants x {C:.1f} s + 12 x ~0.3 s "
               "iterations + set-up, ~34 s" + ("; an extra since (f) came (issue 36): it runs when the parts "
                                              "before it leave 45 s beyond (d)'s budget" if name == "torch" else ""))
        stages.append([Part(f"c-{name}".replace("_", "-"), title, BUDGETS["c"], gpt(name, flags),
                            results.gpt_judge(name), why, mode=mode,
                            unavailable=te if name.startswith("te") else None)])
        if name == "triton":  # (f) before the extras: it is required
            stages.append([Part("f", f"tools/bench_checkpoint.py {' '.join(CKPT_BENCH)}: blocked time of the "
                                "async save vs the sync save", BUDGETS["f"], checkpoint_bench,
                                results.judge_checkpoint_bench, f"alone (it times): 10 s start + ~8 fp32 variants x "
                                f"{C:.1f} s + 3 rounds x (6 steps + a sync and an async save of 481 MiB + the steps "
                                "during the write, ~3 s), ~30 s")])
    stages.append([Part("d", f"tools/bench_kernels.py {' '.join(bench_args)}".rstrip(), BUDGETS["d"], bench,
                        results.judge_bench, f"full autotuning: 132 attention configs x ({C_COMPILE} s compile + "
                        f"0.13 s timing; configs share their kernel's launcher) + 22 norm/cross-entropy variants x "
                        f"{C:.1f} s + torch.compile baselines ~65 s + the rest, ~230 s", mode="stretch")])
    return stages


def print_plan(stages: list, as_json: bool) -> None:
    """Each part, its budget and why; the total (probe + each stage's longest part)."""
    rows = [dict(part="probe", title="GPU name and versions; preflight: Triton's C compiler, its cache folder, nvcc, "
                 "driver, free GPU memory", budget_s=PROBE_S, mode="required",
                 why="one python process: import torch + CUDA init (~10 s assumed) and nvidia-smi; then the "
                     "compiler builds a launcher-like Python extension (~0.4 s); stops here without one")]
    for i, stage in enumerate(stages):
        for p in stage:
            rows.append(dict(part=p.key, title=p.title, budget_s=p.budget_s, mode=p.mode, why=p.why, stage=i + 1,
                             beside=[q.key for q in stage if q is not p], unavailable=p.unavailable))
    grand = PROBE_S + plan_total(stages)
    if as_json:
        print(json.dumps(dict(parts=rows, total_s=grand, reserve_s=RESERVE_S, limit_s=LIMIT_S), indent=1))
        return
    print(f"gpu_check plan: one CUDA GPU, cold Triton cache, at most {LIMIT_S} s in all (arithmetic: "
          "scripts/gpu_check.sh)")
    for r in rows:
        if r.get("unavailable"):
            budget, when = "   -  ", f"extra, not run: {r['unavailable']}"
        else:
            budget = f"{r['budget_s']:4.0f} s"
            when = {"extra": "extra: only with time to spare", "stretch": "+ any time the parts before it leave",
                    "required": ""}[r["mode"]]
            when = "; ".join(filter(None, [when, r.get("beside") and f"side by side with {', '.join(r['beside'])}"]))
        print(f"  {r['part']:<9} {budget}  {r['title']}" + (f" [{when}]" if when else ""))
        print(f"  {'':<9} {'':6}  {r['why']}")
    stages_s = " + ".join(f"{b:.0f}" for b in [PROBE_S] + [stage_budget(s) for s in stages] if b)
    print(f"  total     {grand:4.0f} s = {stages_s} (stages one after another), + {RESERVE_S:.0f} s reserve "
          f"<= {LIMIT_S} s")


PROBE = r"""
import importlib.util, json, os, platform, sys, sysconfig
info = {"python": platform.python_version(), "python_executable": sys.executable}
try:  # the folder of Python.h, as triton/runtime/build.py finds it (for the preflight)
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    info.update(python_include=include, python_h=os.path.isfile(os.path.join(include, "Python.h")))
except Exception as e:
    info["python_include_error"] = f"{type(e).__name__}: {e}"
try:
    import torch
    info.update(torch=torch.__version__, cuda_version=torch.version.cuda, cuda=torch.cuda.is_available())
    if info["cuda"]:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), devices=torch.cuda.device_count())
        torch.zeros(1, device="cuda")
        info["memory_free_gib"] = round(torch.cuda.mem_get_info(0)[0] / 2**30, 1)
    import triton
    info["triton"] = triton.__version__
except Exception as e:
    info["error"] = f"{type(e).__name__}: {e}"
for m in ("flash_attn", "transformer_engine"):
    info[m] = importlib.util.find_spec(m) is not None
print("GPU_CHECK_PROBE " + json.dumps(info))
"""


def _start(argv: list):
    try:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True)
    except OSError:
        return None


def _collect(proc, deadline: float) -> str:
    """stdout+stderr of ``proc``; its process group killed at ``deadline`` ("" if it did not start)."""
    if proc is None:
        return ""
    try:
        return proc.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0] + "\n(timed out)"


def probe(py: str) -> tuple[dict, str]:
    """(what torch in ``py`` sees, the GPU name nvidia-smi gives or ""), both within PROBE_S."""
    deadline = time.monotonic() + PROBE_S
    smi = _start(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) if shutil.which("nvidia-smi") else None
    torch_probe = _start([py, "-c", PROBE])
    text = _collect(torch_probe, deadline)
    names = _collect(smi, deadline).strip().splitlines()
    name = names[0].strip() if smi and smi.returncode == 0 and names else ""
    line = next((x for x in text.splitlines() if x.startswith("GPU_CHECK_PROBE ")), None)
    info = json.loads(line.split(" ", 1)[1]) if line else {"error": text.strip()[-500:] or f"{py} did not start"}
    return info, name


def say_to(out: Path | None):
    """A function that prints a "gpu_check: ..." line and, given ``out``, appends it to summary.txt."""
    def say(line: str) -> None:
        print(f"gpu_check: {line}", flush=True)
        if out is not None:
            with open(out / "summary.txt", "a") as f:
                f.write(f"gpu_check: {line}\n")
    return say


def run_check(stages: list, out: Path, info: dict, smi: str, started: float, limit_s: float = LIMIT_S,
              preflight: dict | None = None, **run_options) -> int:
    """Run the stages on a GPU the probe found: summary.txt (header, one line per part, verdict) and
    summary.json in ``out``; 0 if every required part passed. A ``preflight`` with problems
    (tools/gpu_check_preflight.py) stops the check before any part, with the fix."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text("")
    say = say_to(out)
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    say(f"{now} on {platform.node()}")
    say(f"GPU: {smi or info.get('gpu')} (torch: {info.get('gpu')}, {info.get('sms')} SMs, {info.get('memory_gib')} GiB)")
    say(f"python {info.get('python')} | torch {info.get('torch')} (CUDA {info.get('cuda_version')}) | "
        f"triton {info.get('triton')} | flash-attn {'yes' if info.get('flash_attn') else 'no'} | "
        f"transformer-engine {'yes' if info.get('transformer_engine') else 'no'}")
    header = dict(started=now, host=platform.node(), gpu=info, nvidia_smi=smi, out=str(out))
    if preflight is not None:
        header["preflight"] = preflight
        say(check_preflight.describe(preflight))
        for line in preflight["warnings"]:
            say(f"preflight warning: {line}")
        if preflight["problems"]:
            return preflight_failed(stages, out, preflight, say, dict(header, limit_s=limit_s), started)
    say(f"plan: {PROBE_S + plan_total(stages):.0f} s in a {limit_s:.0f} s limit; the probe and preflight took "
        f"{time.monotonic() - started:.0f} s")
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = Run(stages, out, limit_s, started, say, header=header, env=env, **run_options)
    run.summary.update(plan_total_s=PROBE_S + plan_total(stages), probe_s=round(time.monotonic() - started, 1))
    ok = run.run()
    took = time.monotonic() - started
    if ok:
        say(f"all parts PASS in {took:.0f} s; results in {out}/")
        return 0
    say(f"FAILED parts: {' '.join(run.summary['failed_parts'])}; {took:.0f} s; results in {out}/")
    return 1


def preflight_failed(stages: list, out: Path, preflight: dict, say, header: dict, started: float) -> int:
    """Stop before any part: summary.json with the preflight, every part skipped; the fix said."""
    for line in preflight["problems"]:
        say(f"preflight FAILED: {line}")
    note = "not run: the preflight failed (see preflight.problems)"
    parts = [dict(part=p.key, title=p.title, budget_s=p.budget_s, mode=p.mode, status="skipped", summary=note)
             for stage in stages for p in stage]
    write_json_atomic(out / "summary.json", dict(header, parts=parts,
                                                 plan_total_s=PROBE_S + plan_total(stages), finished=True,
                                                 overall="fail", failed_parts=["preflight"],
                                                 elapsed_s=round(time.monotonic() - started, 1)))
    say(f"FAILED: preflight; nothing else ran ({time.monotonic() - started:.0f} s); results in {out}/")
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="store_true", help="print the parts, their budgets and the total; run nothing")
    p.add_argument("--json", action="store_true", help="with --plan: as JSON")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="results folder (env OUT)")
    args = p.parse_args(argv)
    started = time.monotonic()
    py = os.environ.get("PYTHON") or "python3"
    bench_args = os.environ.get("GPU_CHECK_BENCH_ARGS", "--quick").split()
    os.chdir(ROOT)
    stages = build_stages(py, bench_args)
    if args.plan:
        print_plan(stages, args.json)
        return 0
    info, smi = probe(py)
    if not info.get("cuda"):
        say = say_to(None)
        if not smi:
            now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
            say(f"{now}: no GPU on this machine (no nvidia-smi GPU, no CUDA device for {py}): nothing to run")
            return 0
        say(f"nvidia-smi sees '{smi}' but torch in '{py}' sees no CUDA device (a CPU-only torch?"
            f"{' ' + info['error'] if info.get('error') else ''}): FAIL")
        return 1
    return run_check(stages, Path(args.out).resolve(), info, smi, started, preflight=check_preflight.preflight(info))


if __name__ == "__main__":
    sys.exit(main())
