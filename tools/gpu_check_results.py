"""Reading the GPU acceptance check's results: one judge per part (scripts/gpu_check.sh).

A judge takes the output folder and the part's ``Outcome``s (tools/gpu_check_runner.py) and
returns (passed, figures, one line). It reads whatever the part left, complete or not: a part
killed at its budget still reports the tests, ranks, iterations or benchmark rows it finished.
Standard library only.
"""
from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

GPT_ITERS = 12      # part (c): iterations per run
GPT_WINDOW = 6      # measured: the last 6 (7-12); 1-6 hold compilation, allocator growth, warm-up

# Optional GPU libraries a test may skip for when they are not installed (tests/ skips with
# pytest.importorskip or a reason naming the library): such skips are not failures.
OPTIONAL_LIBRARIES = {"flash-attn": r"flash[-_]attn", "transformer-engine": r"transformer[-_]engine"}
NOT_INSTALLED = r"not installed|no module named|could not import"


def json_lines(path: Path) -> list:
    """The JSON objects of a JSON-lines file, skipping a line cut off when its writer was killed."""
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def library_skip(reason: str) -> str | None:
    """The optional library a skip reason says is missing, or None (any other skip)."""
    if not re.search(NOT_INSTALLED, reason, re.I):
        return None
    return next((lib for lib, pattern in OPTIONAL_LIBRARIES.items() if re.search(pattern, reason, re.I)), None)


def junit_cases(path: Path) -> list[dict]:
    """[{test, outcome: passed|failed|error|skipped, reason}] of a pytest junit XML."""
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        if not tc.get("name"):
            continue  # the placeholder pytest writes for a test cut by KeyboardInterrupt
        test = f"{tc.get('classname')}::{tc.get('name')}" if tc.get("classname") else tc.get("name")
        outcome, reason = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                reason = " ".join(filter(None, [child.get("message", ""), (child.text or "").strip()]))
                break
        cases.append(dict(test=test, outcome=outcome, reason=reason[:300]))
    return cases


def judge_pytest(out: Path, outcomes: list) -> tuple:
    """Part (a): the shards' junit XMLs. Pass: every test passed or skipped for an optional
    library that is not installed, and every shard exited 0 (5, "no tests", for an empty shard)."""
    cases, missing, bad_rc = {}, [], []
    for o in outcomes:
        xml = next((a.split("=", 1)[1] for a in o.command.argv if str(a).startswith("--junitxml=")), None)
        found = []
        if xml and Path(xml).is_file():
            found = junit_cases(Path(xml))
            for c in found:
                cases.setdefault(c["test"], c)  # a module skipped at collection shows in every shard
        else:
            missing.append(o.command.log)
        if not (o.rc == 0 or (o.rc == 5 and not found)):
            bad_rc.append(f"{o.command.log}: exit {o.rc}")
    count = {k: sum(c["outcome"] == k for c in cases.values()) for k in ("passed", "failed", "error", "skipped")}
    libraries, other = {}, []
    for c in cases.values():
        if c["outcome"] == "skipped":
            lib = library_skip(c["reason"])
            if lib:
                libraries[f"{lib} not installed"] = libraries.get(f"{lib} not installed", 0) + 1
            else:
                other.append(f"{c['test']}: {c['reason']}")
    failed = [c["test"] for c in cases.values() if c["outcome"] in ("failed", "error")]
    figures = dict(tests=len(cases), **count, skipped_not_installed=libraries, skipped_other=other[:30],
                   failed_tests=failed[:30], shards=len(outcomes), no_junit=missing, bad_exit=bad_rc)
    skips = f"skipped: {count['skipped']}" + "".join(f", {k} ({n})" for k, n in libraries.items())
    if other:
        skips += f", {len(other)} for other reasons (a failure on a GPU)"
    line = (f"({count['passed']} passed, {len(failed)} failed, {skips}; {len(outcomes)} shards"
            + (f"; no junit XML from {', '.join(missing)}" if missing else "")
            + (f"; {'; '.join(bad_rc)}" if bad_rc else "") + "; logs a_pytest_gpu_*.log)")
    return (bool(cases) and not failed and not other and not missing and not bad_rc), figures, line


def judge_fake(out: Path, outcomes: list) -> tuple:
    """Part (b): each rank exited 0 and printed "done: 2 iterations"."""
    ok, failed = [], []
    for o in outcomes:
        text = o.log.read_text(errors="replace") if o.log.is_file() else ""
        good = o.rc == 0 and re.search(r"^done: 2 iterations", text, re.M)
        (ok if good else failed).append(o.command.log.removeprefix("b_").removesuffix(".log"))
    figures = dict(ranks=len(outcomes), ranks_ok=len(ok), failed=failed, side_by_side=len(outcomes),
                   seconds_max=max((o.seconds for o in outcomes), default=0.0))
    line = (f"({len(ok)}/{len(outcomes)} ran, side by side{'; failed: ' + ' '.join(failed) if failed else ''}; "
            "logs b_*.log)")
    return not failed and bool(ok), figures, line


def gpt_figures(records: list, log_text: str) -> dict:
    """Tokens/s, TFLOP/s and MFU over the measurement window (time-weighted: total work over
    total time) of a ``--log-json`` run, and what it managed if it stopped early."""
    params = re.search(r"model: ([\d.]+[KMB]) parameters", log_text)
    fig = dict(iterations=len(records), parameters=params.group(1) if params else None)
    if records:
        fig.update(loss_first=records[0]["loss"], loss_last=records[-1]["loss"])
    if len(records) >= GPT_ITERS:
        window = records[GPT_ITERS - GPT_WINDOW:GPT_ITERS]
        secs = [r["elapsed_ms"] / 1e3 for r in window]

        def avg(key):
            return sum(r[key] * s for r, s in zip(window, secs)) / sum(secs)
        fig.update(window=f"iterations {GPT_ITERS - GPT_WINDOW + 1}-{GPT_ITERS}",
                   tokens_per_sec=round(avg("tokens_per_sec")), tflops_per_gpu=round(avg("tflops_per_gpu"), 1),
                   seconds_per_iteration=round(sum(secs) / len(secs), 3))
        if all("mfu" in r for r in window):
            fig["mfu_pct"] = round(100 * avg("mfu"), 1)
    return fig


def gpt_judge(name: str):
    """Part (c), one run: 12 records with finite losses; the window's figures."""
    def judge(out: Path, outcomes: list) -> tuple:
        path, log = out / f"c_gpt1p3b_{name}.jsonl", outcomes[0].log
        records = json_lines(path)
        fig = gpt_figures(records, log.read_text(errors="replace") if log.is_file() else "")
        finite = all(r["loss"] is not None and math.isfinite(r["loss"]) for r in records)  # null: not finite
        if "tokens_per_sec" in fig:
            mfu = f"MFU {fig['mfu_pct']:.1f}%" if "mfu_pct" in fig else "MFU n/a (GPU not in the peak table)"
            line = (f"{fig['parameters'] or '?'} params: {fig['tokens_per_sec']:,} tokens/s, "
                    f"{fig['tflops_per_gpu']:.1f} TFLOP/s/GPU, {mfu} ({fig['window']}); "
                    f"loss {fig['loss_first']:.3f} -> {fig['loss_last']:.3f}")
        else:
            line = f"{len(records)}/{GPT_ITERS} iterations logged"
        ok = outcomes[0].rc == 0 and len(records) == GPT_ITERS and finite
        if not finite:
            line += "; a loss is not finite"
        return ok, fig, f"({line}; log {log.name})"
    return judge


def _rows(out: Path) -> tuple[list, bool]:
    """The benchmark's rows: its final JSON, or the sections kept so far (partial)."""
    final = out / "d_bench_kernels.json"
    if final.is_file():
        try:
            return json.loads(final.read_text())["rows"], True
        except (ValueError, KeyError):
            pass
    return json_lines(out / "d_bench_rows.jsonl"), False


def judge_bench(out: Path, outcomes: list) -> tuple:
    """Part (d): the rows (all, or the sections finished); fail if a Triton row has an error."""
    rows, complete = _rows(out)
    bad = [f"{r['kernel']} {r['case']}" for r in rows if "error" in r and r.get("impl") == "triton"]

    def best(kernel, impl, key):
        vals = [r[key] for r in rows if r.get("kernel") == kernel and r.get("impl") == impl and r.get(key)]
        return round(max(vals), 1) if vals else None
    attention = {impl: [best("attention", impl, "fwd_rate"), best("attention", impl, "bwd_rate")]
                 for impl in ("triton", "sdpa-flash", "flash-attn") if best("attention", impl, "fwd_rate")}
    kernels = sorted({r.get("kernel") for r in rows})
    triton = {k: best(k, "triton", "fwd_rate") for k in kernels}
    figures = dict(rows=len(rows), complete=complete, kernels=kernels, attention_best_tflops_fwd_bwd=attention,
                   triton_best_fwd_rate=triton, triton_errors=bad)

    def pair(impl):
        return "/".join("-" if v is None else f"{v:.0f}" for v in attention.get(impl, [None, None]))
    line = (f"{len(rows)} rows{'' if complete else ' (partial: ' + ', '.join(kernels) + ')'}; attention TFLOP/s "
            f"fwd/bwd best: triton {pair('triton')}, sdpa-flash {pair('sdpa-flash')}"
            + (f"; triton failed: {', '.join(bad)}" if bad else ""))
    return outcomes[0].rc == 0 and complete and not bad, figures, f"({line}; table d_bench_kernels.txt)"


def _json_arg(outcome) -> Path | None:
    """The path a command was told to write with ``--json PATH``."""
    argv = [str(a) for a in outcome.command.argv]
    return Path(argv[argv.index("--json") + 1]) if "--json" in argv[:-1] else None


def _read_json(path: Path | None) -> dict | None:
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else None
    except ValueError:
        return None  # cut off mid-write


def judge_dry_runs(out: Path, outcomes: list) -> tuple:
    """Part (e): each layout's tools/dry_run.py exited 0 and its --json holds every role, each of
    which fits (the tiny model always should). Figures per layout: the roles' tracked peak (the
    memory tracker's storages) beside ``torch.cuda.max_memory_allocated`` and the planner's."""
    layouts, failed = {}, []
    for o in outcomes:
        name = o.command.log.removeprefix("e_").removesuffix(".log")
        data = _read_json(_json_arg(o)) or {}
        roles = data.get("roles", [])
        gib = lambda v: None if v is None else round(v / 2**30, 3)  # noqa: E731
        layouts[name] = dict(rc=o.rc, seconds=o.seconds, roles=[dict(
            role=r.get("role"), ranks=r.get("ranks"), tracked_peak_gib=gib(r.get("measured_bytes")),
            planned_gib=gib(r.get("planned_bytes")), cuda_max_allocated_gib=gib(r.get("cuda_max_memory_allocated")),
            comm_bytes=r.get("comm_bytes")) for r in roles])
        if o.rc != 0 or not roles or not all(r.get("fits") for r in roles):
            failed.append(name)
    n_roles = sum(len(v["roles"]) for v in layouts.values())
    figures = dict(layouts=layouts, failed=failed, roles=n_roles)
    line = (f"({len(outcomes) - len(failed)}/{len(outcomes)} layouts, {n_roles} roles ran on CUDA"
            f"{'; failed: ' + ' '.join(failed) if failed else ''}; logs e_*.log)")
    return bool(outcomes) and not failed, figures, line


def judge_checkpoint_bench(out: Path, outcomes: list) -> tuple:
    """Part (f): tools/bench_checkpoint.py's JSON. Passes when it ran to the end with finite
    figures; the goals (async blocked <= a tenth of sync; steps during the write within 10%)
    are reported, not enforced: this is their first measurement on a GPU (issue 36)."""
    res = _read_json(_json_arg(outcomes[0])) if outcomes else None
    if not res:
        return False, {}, "(no results: see f_bench_checkpoint.txt)"
    keys = ("blocked_s_sync", "blocked_s_async", "blocked_ratio", "step_s_no_save", "async_write_s")
    finite = all(isinstance(res.get(k), (int, float)) and math.isfinite(res[k]) for k in keys)
    figures = dict(res, blocked_goal_met=finite and res["blocked_ratio"] <= 0.1)
    slow = res.get("step_slowdown_during_write")
    if finite:
        goal = "met" if figures["blocked_goal_met"] else "MISSED"
        line = (f"blocked per save: sync {res['blocked_s_sync']:.3f} s, async {res['blocked_s_async']:.3f} s "
                f"(async/sync {res['blocked_ratio']:.3f}, goal <= 0.1 {goal})"
                f"; step {1e3 * res['step_s_no_save']:.1f} ms"
                + (f", {100 * slow:+.1f}% during the write" if isinstance(slow, (int, float)) else "")
                + f"; {res.get('checkpoint_bytes', 0) / 2**20:.0f} MiB on {res.get('device')}")
    else:
        line = "figures missing or not finite"
    return outcomes[0].rc == 0 and finite, figures, f"({line}; f_bench_checkpoint.txt)"
