#!/usr/bin/env python
"""Plot one or several --log-json runs, overlaid, as a PNG or SVG (needs matplotlib).

    python tools/plot_log.py runs/demo/log.jsonl -o docs/images/demo_loss.png
    python tools/plot_log.py runs/a/log.jsonl runs/b/log.jsonl --labels "DP=2" "TP=2" -o cmp.svg

Top: training loss (line) and validation loss (dashed, dots) against the iteration and
against the tokens seen (iteration x tokens per step, the step's tokens being
tokens_per_sec x elapsed_ms / 1000), log scale unless --loss-scale linear. Bottom:
throughput (tokens/s over all ranks), TFLOP/s per GPU (MFU in % when every run logged it),
memory of the logging rank (GPU: peak allocated; CPU: the tensor accounting), and per run
the time of each step split into forward / backward / grad sync / optimizer, stacked.
Each run has one colour in every panel, named in the legend by its file name or --labels.
Values that are null are skipped: a meta dry run computes no loss, and a non-finite value (a
NaN loss) is written as null and named under the record's "non_finite" field (strict JSON; an
older log's bare NaN or Infinity reads as null too); the summary line names the iterations
whose loss was not finite.

The format follows the output's extension (.png, .svg, .pdf; .png if none); --format png svg
writes one file per format.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.observe.plotting import FORMATS, new_figure, require_matplotlib, save  # noqa: E402
from tools.tool_errors import one_line_errors  # noqa: E402

TIME_PARTS = ["forward", "backward", "grad_sync", "optimizer"]


def load(path: str) -> list[dict]:
    """The records of a --log-json file, by iteration; a half-written last line (a run still
    going) is ignored."""
    records = []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    for n, line in enumerate(lines):
        try:
            records.append(json.loads(line, parse_constant=lambda constant: None))  # an old log's bare NaN
        except json.JSONDecodeError:
            if n != len(lines) - 1:
                raise ValueError(f"{path}: line {n + 1} is not JSON (a --log-json file holds one JSON object "
                                 f"per line)") from None
    if any(not isinstance(r, dict) or "iteration" not in r for r in records):
        raise ValueError(f"{path}: a record without an 'iteration' field: not a --log-json file")
    # Event lines (a rollback) are not iterations; an iteration logged again after a rollback
    # or a resume replaces the earlier record of it (the file order is the run's order).
    latest = {r["iteration"]: r for r in records if "event" not in r}
    return [latest[i] for i in sorted(latest)]


def unreadable(tool: str, e: Exception) -> None:
    """One line naming the file and why, no traceback; exit status 2."""
    what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
    print(f"{tool}: cannot read {what}", file=sys.stderr)
    sys.exit(2)


def default_labels(paths: list[str]) -> list[str]:
    """The shortest path tails that tell the runs apart; at least the parent folder too
    when every file has the generic name log.jsonl (runs/demo/log.jsonl -> demo/log.jsonl)."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    k = 2 if all(p[-1].startswith("log.") and len(p) > 1 for p in parts) else 1
    while k < max(len(p) for p in parts) and len({"/".join(p[-k:]) for p in parts}) < len(parts):
        k += 1
    return ["/".join(p[-k:]) for p in parts]


def points(records: list[dict], get) -> tuple[list, list]:
    """(iterations, values) where get(record) is not None."""
    xs, ys = [], []
    for r in records:
        try:
            v = get(r)
        except (KeyError, TypeError):
            v = None
        if v is not None:
            xs.append(r["iteration"])
            ys.append(v)
    return xs, ys


def tokens_seen(records: list[dict]) -> dict[int, float]:
    """Iteration -> tokens seen by its end: the sum of tokens per step over the iterations up
    to it; a step's tokens are tokens_per_sec x elapsed_ms / 1000, and an iteration without
    them (or not logged, e.g. before a resume) counts as the nearest known step."""
    per_step = {r["iteration"]: r["tokens_per_sec"] * r["elapsed_ms"] / 1e3 for r in records
                if r.get("tokens_per_sec") is not None and r.get("elapsed_ms") is not None}
    if not per_step:
        return {}
    typical = statistics.median(per_step.values())
    seen, total, previous = {}, 0.0, 0
    for r in records:
        step = per_step.get(r["iteration"], typical)
        total += (r["iteration"] - previous) * step
        previous = r["iteration"]
        seen[r["iteration"]] = total
    return seen


def smoothed(ys: list[float], window: int) -> list[float]:
    """Running mean over ``window`` points centred on each point (fewer at the ends)."""
    prefix = [0.0]
    for y in ys:
        prefix.append(prefix[-1] + y)
    out = []
    for i in range(len(ys)):
        lo, hi = max(0, i - window // 2), min(len(ys), i - window // 2 + window)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def memory_of(record: dict):
    """(bytes, kind) of a record's memory: the GPU peak, or the CPU tensor accounting total."""
    mem = record.get("memory_bytes") or {}
    if "peak" in mem:
        return mem["peak"], "GPU peak allocated"
    return (sum(mem.values()), "tensor accounting") if mem else (None, None)


def _robust_top(values: list[float]) -> float | None:
    """An upper y limit that keeps warm-up spikes from flattening the rest: the maximum, or
    1.5x the 95th percentile when the maximum is far above it."""
    if not values:
        return None
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return ordered[-1] * 1.05 if ordered[-1] <= 1.5 * p95 else 1.5 * p95


def _log_axis_labels(ax) -> None:
    """Plain numbers on a log axis: 5, 6, 7 within one decade; 0.1, 1, 10 across several."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = ax.get_ylim()
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    if hi / lo < 20:
        ax.yaxis.set_minor_locator(LogLocator(subs=(1.0, 1.5, 2, 3, 4, 5, 6, 7, 8, 9)))
        ax.yaxis.set_minor_formatter(plain)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def plot(runs: dict, output: str, formats: list[str] | None = None, loss_scale: str = "log",
         smooth: int = 0, title: str | None = None, dpi: int = 110) -> list[str]:
    """Draw ``runs`` (label -> records) into ``output``; returns the paths written."""
    require_matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    colors = [f"C{i % 10}" for i in range(len(runs))]
    fig = new_figure(16, 9.5)
    grid = fig.add_gridspec(2, 12, height_ratios=[1.15, 1])
    ax_loss, ax_tok = fig.add_subplot(grid[0, :6]), fig.add_subplot(grid[0, 6:])
    ax_tps, ax_flops, ax_mem = (fig.add_subplot(grid[1, i:i + 3]) for i in (0, 3, 6))
    time_axes = grid[1, 9:].subgridspec(len(runs), 1)

    def line(ax, xs, ys, color, **kw):
        if smooth > 1 and len(ys) > smooth:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, smoothed(ys, smooth), color=color, linewidth=1.6, **kw)
        else:
            ax.plot(xs, ys, color=color, linewidth=1.3, **kw)

    # Loss against iterations and tokens seen.
    loss_values = []
    for (label, records), color in zip(runs.items(), colors):
        seen = tokens_seen(records)
        for ax, to_x in ((ax_loss, lambda i: i), (ax_tok, seen.get)):
            xs, ys = points(records, lambda r: r["loss"] if to_x(r["iteration"]) is not None else None)
            line(ax, [to_x(i) for i in xs], ys, color)
            vx, vy = points(records, lambda r: r.get("valid_loss") if to_x(r["iteration"]) is not None else None)
            ax.plot([to_x(i) for i in vx], vy, color=color, linestyle="--", marker="o", markersize=5)
            loss_values += ys + vy
    runs_legend = [Line2D([], [], color=c, linewidth=2.5, label=label) for label, c in zip(runs, colors)]
    style = [Line2D([], [], color="0.3", label="training loss" + (f" (mean of {smooth})" if smooth > 1 else "")),
             Line2D([], [], color="0.3", linestyle="--", marker="o", label="validation loss")]
    for ax, xlabel, what in ((ax_loss, "iteration", "iteration"), (ax_tok, "tokens seen", "tokens seen")):
        ax.set_title(f"Loss against {what}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (cross-entropy, nats/token)")
        ax.grid(True, which="major", alpha=0.3)
        if loss_values:
            if loss_scale == "log" and min(loss_values) > 0:
                ax.set_yscale("log")
                _log_axis_labels(ax)
                ax.grid(True, which="minor", alpha=0.15)
            ax.legend(handles=runs_legend + style if ax is ax_loss else style, loc="upper right")
        else:
            ax.text(0.5, 0.5, "no loss logged (dry run?)", ha="center", va="center", transform=ax.transAxes)
    ax_tok.xaxis.set_major_formatter(EngFormatter())

    # Throughput, FLOPs, memory against iterations.
    use_mfu = all(any(r.get("mfu") is not None for r in records) for records in runs.values())
    memory_bytes = [memory_of(r)[0] for records in runs.values() for r in records if memory_of(r)[0]]
    mem_unit, mem_div = ("GiB", 2**30) if memory_bytes and max(memory_bytes) >= 2**31 else ("MiB", 2**20)
    mem_kinds = {memory_of(r)[1] for records in runs.values() for r in records} - {None}
    panels = [(ax_tps, lambda r: r["tokens_per_sec"], "Throughput", "tokens/s (all ranks)"),
              (ax_flops, (lambda r: 100 * r["mfu"]) if use_mfu else (lambda r: r["tflops_per_gpu"]),
               "Model FLOPs utilization" if use_mfu else "Model TFLOP/s per GPU",
               "MFU (% of peak)" if use_mfu else "TFLOP/s per GPU"),
              (ax_mem, lambda r: memory_of(r)[0] / mem_div if memory_of(r)[0] is not None else None,
               "Memory" + (f" ({mem_kinds.pop()})" if len(mem_kinds) == 1 else ""),
               f"{mem_unit} (logging rank)")]
    for ax, get, panel_title, ylabel in panels:
        values = []
        for (label, records), color in zip(runs.items(), colors):
            xs, ys = points(records, get)
            line(ax, xs, ys, color)
            values += ys
        top = _robust_top(values)
        if top is not None and top > 0:
            ax.set_ylim(0, top)
            if top < max(values):
                panel_title += " (spikes clipped)"
        elif not values:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(panel_title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_tps.yaxis.set_major_formatter(EngFormatter())

    # Time split per step, one stacked area per run.
    parts_colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd"]
    for n, ((label, records), color) in enumerate(zip(runs.items(), colors)):
        ax = fig.add_subplot(time_axes[n, 0])
        timed = [r for r in records if r.get("times_ms")]
        names = TIME_PARTS + sorted({k for r in timed for k in r["times_ms"]} - set(TIME_PARTS))
        names = [k for k in names if any(r["times_ms"].get(k) for r in timed)]
        if timed and names:
            xs = [r["iteration"] for r in timed]
            stacks = [[r["times_ms"].get(k) or 0.0 for r in timed] for k in names]
            if smooth > 1:
                stacks = [smoothed(s, smooth) for s in stacks]
            ax.stackplot(xs, stacks, labels=[k.replace("_", " ") for k in names],
                         colors=parts_colors[:len(names)], alpha=0.9)
            totals = [sum(col) for col in zip(*stacks)]
            top = _robust_top(totals)
            ax.set_ylim(0, top)
            clipped = " (spikes clipped)" if top < max(totals) else ""
            if n == 0:
                ax.legend(loc="upper right", fontsize=8, ncol=2)
        else:
            clipped = ""
            ax.text(0.5, 0.5, "no times logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(("Time per step: " if n == 0 else "") + label + clipped, color=color,
                     fontsize=10 if len(runs) > 1 else None)
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        if n == len(runs) - 1:
            ax.set_xlabel("iteration")
        else:
            ax.tick_params(labelbottom=False)

    fig.suptitle(title or ("Training log: " + ", ".join(runs) if len(runs) <= 3
                           else f"Training logs of {len(runs)} runs"), fontsize=14)
    return save(fig, output, formats, dpi=dpi)


def summary(label: str, records: list[dict]) -> str:
    _, loss = points(records, lambda r: r["loss"])
    _, valid = points(records, lambda r: r.get("valid_loss"))
    _, tps = points(records, lambda r: r["tokens_per_sec"])
    text = f"{label}: {len(records)} iterations"
    if loss:
        text += f", loss {loss[0]:.4g} -> {loss[-1]:.4g}"
    if valid:
        text += f", last validation loss {valid[-1]:.4g}"
    if tps:
        text += f", median {statistics.median(tps):,.0f} tokens/s"
    not_finite = [r["iteration"] for r in records if "loss" in (r.get("non_finite") or {})]
    if not_finite:
        text += (f"; loss not finite (null in the log, left out) at iteration{'s' if len(not_finite) > 1 else ''} "
                 f"{', '.join(map(str, not_finite))}")
    return text


def main(argv=None):
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("logs", nargs="+", help="--log-json files (one JSON object per iteration)")
    p.add_argument("--output", "-o", default="log_plot.png", help="picture path; its extension picks the format")
    p.add_argument("--format", nargs="+", choices=FORMATS, default=None,
                   help="write one file per format (the output's extension replaced)")
    p.add_argument("--labels", nargs="+", default=None, help="one legend name per log (default: file names)")
    p.add_argument("--title", default=None)
    p.add_argument("--loss-scale", choices=["log", "linear"], default="log")
    p.add_argument("--smooth", type=int, default=0, metavar="N",
                   help="also draw the running mean over N logged iterations, centred (raw values faint)")
    p.add_argument("--dpi", type=int, default=110)
    a = p.parse_args(argv)
    if a.labels is not None and len(a.labels) != len(a.logs):
        p.error(f"--labels: {len(a.labels)} names for {len(a.logs)} logs")
    labels = a.labels or default_labels(a.logs)
    if len(set(labels)) != len(labels):
        p.error(f"two runs share a label: {labels}")
    try:
        runs = {label: load(path) for label, path in zip(labels, a.logs)}
    except (OSError, ValueError) as e:
        unreadable("plot_log.py", e)
    try:
        require_matplotlib()
    except ImportError as e:
        sys.exit(f"plot_log.py: {e}")
    for label, records in runs.items():
        if not records:
            p.error(f"{label}: no records")
        print(summary(label, records))
    for path in plot(runs, a.output, a.format, a.loss_scale, a.smooth, a.title, a.dpi):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
