#!/usr/bin/env python
"""Data-parallel scaling efficiency: throughput(N) / (N x throughput(1)).

    python tools/scaling_efficiency.py --ranks 1 2 4 [pretrain_gpt.py flags...]
    python tools/scaling_efficiency.py --logs run1/log.jsonl run2/log.jsonl run4/log.jsonl --ranks 1 2 4

Runs the same model (weak scaling: the same micro batch per rank, so the global batch grows
with N) at each number of data-parallel ranks, here as local gloo processes, or reads the
--log-json logs of such runs, and takes the median tokens/s after the first iterations.
The practitioners' reading: efficiency below 0.7, look at communication (bucket size,
overlap, the interconnect); below 0.5 the run is communication-bound: change the layout
(less DP, more TP inside a node) or the network. On a CPU with few cores the processes
compete for the same cores, so the numbers only demonstrate the tool.

--plot PATH also draws efficiency against the number of DP ranks, with the ideal 1.0 and the
0.7 / 0.5 thresholds, tokens/s at each point (PNG, SVG or PDF by the extension; needs
matplotlib).
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402
os.environ.setdefault("OMP_NUM_THREADS", "1")

DEFAULT = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4",
           "--train-iters", "8", "--log-interval", "1000", "--overlap-grad-reduce"]


def _run(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return [r["tokens_per_sec"] for r in pretrain(argv)]


def median_throughput(tokens_per_sec: list[float], skip: int = 2) -> float:
    return statistics.median(tokens_per_sec[skip:] or tokens_per_sec)


def verdict(efficiency: float) -> str:
    if efficiency < 0.5:
        return "communication-bound: change the layout or the interconnect"
    if efficiency < 0.7:
        return "look at communication"
    return "ok"


def table(ranks: list[int], throughputs: list[float]) -> list[dict]:
    base = throughputs[0] / ranks[0]
    rows = []
    for n, tput in zip(ranks, throughputs):
        eff = tput / (n * base)
        rows.append({"ranks": n, "tokens_per_sec": tput, "efficiency": eff, "verdict": verdict(eff)})
    return rows


def plot(rows: list[dict], path: str, note: str | None = None) -> list[str]:
    """Efficiency against DP size, with the threshold lines; returns the paths written."""
    from megalite.observe.plotting import new_figure, save

    ranks = [r["ranks"] for r in rows]
    eff = [r["efficiency"] for r in rows]
    fig = new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    ax.axhspan(0, 0.5, color="#d62728", alpha=0.08)
    ax.axhspan(0.5, 0.7, color="#ff7f0e", alpha=0.08)
    ax.axhline(1.0, color="0.4", linestyle=":", label="ideal (linear scaling)")
    ax.axhline(0.7, color="#ff7f0e", linestyle="--", label="0.7: look at communication")
    ax.axhline(0.5, color="#d62728", linestyle="--", label="0.5: communication-bound")
    ax.plot(ranks, eff, marker="o", color="C0", linewidth=2, label="measured")
    for r in rows:
        ax.annotate(f"{r['tokens_per_sec']:,.0f} tok/s", (r["ranks"], r["efficiency"]),
                    textcoords="offset points", xytext=(0, 9), ha="center", fontsize=9,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.8))
    if len(set(ranks)) > 1 and min(ranks) > 0 and max(ranks) / min(ranks) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(n) for n in ranks])
    ax.minorticks_off()
    ax.margins(x=0.12)
    ax.set_ylim(0, max(1.15, max(eff) + 0.15))
    ax.set_xlabel("data-parallel ranks")
    ax.set_ylabel("efficiency = tokens/s(N) / (N · tokens/s(1))")
    ax.set_title("Data-parallel scaling efficiency" + (f"\n{note}" if note else ""), fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=9)
    return save(fig, path)


def main():
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--logs", nargs="*", default=None, help="--log-json files of runs at --ranks")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="PATH", help="also draw the chart (.png, .svg, .pdf)")
    a, rest = p.parse_known_args()
    positive(p, "--ranks", *a.ranks)
    writable(p, "--json", a.json)
    writable(p, "--plot", a.plot)
    if a.plot:  # fail now, not after the runs
        from megalite.observe.plotting import require_matplotlib
        require_matplotlib()
    if a.logs:
        try:
            records = [[json.loads(x) for x in open(f) if x.strip()] for f in a.logs]
            throughputs = [median_throughput([r["tokens_per_sec"] for r in rs if "event" not in r]) for rs in records]
        except OSError as e:  # one line naming the file, no traceback
            print(f"scaling_efficiency.py: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
            sys.exit(2)
        except (ValueError, KeyError) as e:
            print(f"scaling_efficiency.py: --logs must be --log-json files with tokens_per_sec ({e!r})",
                  file=sys.stderr)
            sys.exit(2)
    else:
        from megalite.testing import run_world
        argv = rest or DEFAULT
        throughputs = []
        for n in a.ranks:
            micro = int(argv[argv.index("--micro-batch-size") + 1]) if "--micro-batch-size" in argv else 4
            extra = ["--global-batch-size", str(micro * n)]
            throughputs.append(median_throughput(run_world(_run, n, argv + extra, timeout=600)[0]))
    rows = table(a.ranks, throughputs)
    print(f"{'DP ranks':>8} {'tokens/s':>10} {'efficiency':>10}  reading")
    for r in rows:
        print(f"{r['ranks']:>8} {r['tokens_per_sec']:>10,.0f} {r['efficiency']:>10.2f}  {r['verdict']}")
    if not a.logs:
        print("(CPU processes share the machine's cores: a demonstration of the tool, not a measurement "
              "of megalite's scaling.)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    if a.plot:
        note = None if a.logs else "CPU processes sharing the cores: a demonstration, not a measurement"
        print(f"chart: {', '.join(plot(rows, a.plot, note))}")


if __name__ == "__main__":
    main()
