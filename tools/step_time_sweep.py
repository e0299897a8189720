#!/usr/bin/env python
"""Prediction against measurement: the planner's step time for some twenty layouts of one small GPT
on this machine, beside the step time measured by training each (issue 40).

For each layout (DP with ZeRO 0-3, TP with SP, PP 1F1B / interleaved / zb-h1, CP p2p / a2a /
allgather, EP with MoE, recomputation, Muon) on at most two ranks (this machine has two cores: a
third rank would share a core, which no profile describes):

- **predicted**: :func:`megalite.planner.estimate.estimate`'s step time (the named terms of
  :mod:`megalite.planner.step_time`) with a hardware profile of this machine
  (``tools/calibrate_hardware.py``; ``--profile FILE``);
- **measured**: ``pretrain`` run with the planner's own flags for the layout
  (:func:`megalite.planner.flags.pretrain_flags`, fp32, mock data) in real gloo processes forked
  on loopback, one thread each; the median of the iterations' times after ``--warmup`` of them
  (the step log's ``elapsed_ms`` on rank 0: every rank waits for the others in a step).

Printed: per layout predicted and measured seconds and their error; the median absolute error,
Spearman's rank correlation, and how far the predicted-best layout's measured time is from the
measured-best (the issue's goals: <= 15%, >= 0.8, within 10%). ``--json`` writes the rows,
``--plot`` the predicted-against-measured scatter.

    python tools/step_time_sweep.py --profile docs/profiles/cpu-2core.json [--quick] [--json P] [--plot PNG]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments import build_parser, config_from_args  # noqa: E402
from megalite.planner.estimate import estimate  # noqa: E402
from megalite.planner.flags import pretrain_flags  # noqa: E402
from megalite.planner.hardware import hardware_from_profile  # noqa: E402
from megalite.planner.types import Layout, UpdatePlan, precision  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from megalite.train.pretrain import pretrain  # noqa: E402
from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402

# The model: small enough that twenty layouts train in minutes on two cores, large enough that its
# matrix products, not Python, take most of a step.
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256", "--vocab-size", "4096", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
GLOBAL_BATCH, MICRO = 8, 1


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    layout: Layout
    model: tuple = ()  # flags beyond MODEL (MoE)
    update: UpdatePlan = UpdatePlan()

    @property
    def world(self) -> int:
        return self.layout.tp * self.layout.pp * self.layout.dp * self.layout.cp


CASES = [
    Case("1 rank", Layout()),
    Case("1 rank, selective recompute", Layout(recompute="selective")),
    Case("1 rank, full recompute", Layout(recompute="full")),
    Case("1 rank, Muon", Layout(), update=UpdatePlan("muon")),
    Case("DP 2", Layout(dp=2)),
    Case("DP 2 ZeRO-1", Layout(dp=2, zero=1)),
    Case("DP 2 ZeRO-2", Layout(dp=2, zero=2)),
    Case("DP 2 ZeRO-3", Layout(dp=2, zero=3)),
    Case("DP 2 ZeRO-1, full recompute", Layout(dp=2, zero=1, recompute="full")),
    Case("DP 2 ZeRO-1, Muon", Layout(dp=2, zero=1), update=UpdatePlan("muon")),
    Case("TP 2 + SP", Layout(tp=2)),
    Case("TP 2 + SP, full recompute", Layout(tp=2, recompute="full")),
    Case("TP 2 + SP, Muon distributed", Layout(tp=2), update=UpdatePlan("muon", muon_tp_mode="distributed")),
    Case("PP 2 1F1B", Layout(pp=2, schedule="1f1b")),
    Case("PP 2 interleaved, V 2", Layout(pp=2, schedule="1f1b", virtual=2)),
    Case("PP 2 zbv", Layout(pp=2, schedule="zbv")),
    Case("PP 2 gpipe", Layout(pp=2, schedule="gpipe")),
    Case("PP 2 zb-h1", Layout(pp=2, schedule="zb-h1")),
    Case("CP 2 p2p", Layout(cp=2, cp_comm_type="p2p")),
    Case("CP 2 a2a", Layout(cp=2, cp_comm_type="a2a")),
    Case("CP 2 allgather", Layout(cp=2, cp_comm_type="allgather")),
    Case("MoE, 1 rank", Layout(), model=tuple(MOE)),
    Case("MoE, DP 2 x EP 2", Layout(dp=2, ep=2), model=tuple(MOE)),
    Case("MoE, DP 2 x EP 2 ZeRO-1", Layout(dp=2, ep=2, zero=1), model=tuple(MOE)),
]
QUICK = ("1 rank", "DP 2 ZeRO-1", "PP 2 1F1B")


def model_config(case: Case, model: tuple = tuple(MODEL)):
    """The case's ModelConfig: ``model``'s flags (the sweep's GPT) and the case's own (MoE)."""
    args = build_parser().parse_args(list(model) + list(case.model) + ["--mock-data"])
    return config_from_args(args, args.vocab_size).model


def flags_of(case: Case, model: tuple = tuple(MODEL)) -> list[str]:
    """The layout's pretrain_gpt.py flags as the planner writes them (fp32: this is a CPU)."""
    return (pretrain_flags(model_config(case, model), case.layout, GLOBAL_BATCH, MICRO, "fp32", update=case.update)
            + ["--mock-data", "--lr", "1e-4", "--lr-warmup-iters", "0"])


def predict(case: Case, hw, model: tuple = tuple(MODEL)) -> tuple[float, dict]:
    """The planner's step seconds for the case's layout, and its terms."""
    e = estimate(model_config(case, model), case.layout, GLOBAL_BATCH, MICRO, precision("fp32", update=case.update), hw)
    return e.step_seconds, dict(e.step)


def _train(rank, world, flags, iters):
    with contextlib.redirect_stdout(io.StringIO()):  # the per-iteration log lines: the table says it
        records = pretrain(flags + ["--train-iters", str(iters), "--log-interval", "1", "--lr-decay-iters", str(iters)])
    return [r["elapsed_ms"] / 1e3 for r in records]


def measure(case: Case, iters: int, warmup: int, model: tuple = tuple(MODEL)) -> float:
    """The median seconds of the iterations after ``warmup`` of them, on rank 0."""
    times = run_world(_train, case.world, flags_of(case, model), iters, timeout=900.0)[0]
    return statistics.median(times[warmup:])


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among measured times)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        out = [0.0] * len(x)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out
    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def summary(rows: list[dict]) -> dict:
    """The issue's three figures: median |error|, rank correlation, the predicted-best's gap."""
    predicted, measured = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    best_predicted = min(rows, key=lambda r: r["predicted_s"])
    best_measured = min(rows, key=lambda r: r["measured_s"])
    return {"layouts": len(rows), "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
            "spearman": spearman(predicted, measured), "predicted_best": best_predicted["label"],
            "measured_best": best_measured["label"],
            "predicted_best_gap": best_predicted["measured_s"] / best_measured["measured_s"] - 1}


def plot(rows: list[dict], path: str, facts: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 6))
    xs, ys = [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]
    ax.scatter(xs, ys, s=18)
    for r in rows:
        ax.annotate(r["label"], (r["measured_s"], r["predicted_s"]), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.12)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (s)",
           ylabel="predicted step time (s)",
           title=f"planner step time against measurement ({facts['layouts']} layouts, this CPU)\n"
                 f"median |error| {facts['median_abs_error']:.0%}, Spearman {facts['spearman']:.2f}, "
                 f"predicted-best {facts['predicted_best_gap']:+.0%} off the best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--profile", required=True, help="a hardware profile of this machine "
                        "(tools/calibrate_hardware.py --link-ranks 2 writes one)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the median")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    a = parser.parse_args(argv)
    positive(parser, "--iters", a.iters)
    writable(parser, "--json", a.json)
    writable(parser, "--plot", a.plot)
    if not 0 <= a.warmup < a.iters:
        parser.error(f"--warmup ({a.warmup}) must be at least 0 and below --iters ({a.iters})")
    hw = hardware_from_profile(a.profile, gpus_per_node=2)  # both ranks on this machine
    cases = [c for c in CASES if not a.quick or c.label in QUICK]
    rows = []
    print(f"{'layout':<32} {'predicted s':>11} {'measured s':>10} {'error':>7}  largest predicted terms")
    for case in cases:
        predicted, terms = predict(case, hw)
        measured = measure(case, a.iters, a.warmup)
        error = predicted / measured - 1
        top = ", ".join(f"{k} {v:.3f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])[:3] if v > 0)
        print(f"{case.label:<32} {predicted:>11.3f} {measured:>10.3f} {error:>+7.0%}  {top}", flush=True)
        rows.append({"label": case.label, "layout": case.layout.to_dict(), "update": dataclasses.asdict(case.update),
                     "flags": flags_of(case), "predicted_s": predicted, "measured_s": measured, "error": error,
                     "terms": terms})
    facts = summary(rows)
    print(f"\n{facts['layouts']} layouts: median |error| {facts['median_abs_error']:.1%} (goal <= 15%), Spearman "
          f"{facts['spearman']:.2f} (goal >= 0.8); predicted best {facts['predicted_best']!r} measured "
          f"{facts['predicted_best_gap']:+.1%} from the measured best {facts['measured_best']!r} (goal within 10%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"profile": a.profile, "rows": rows, "summary": facts}, f, indent=1)
    if a.plot:
        plot(rows, a.plot, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
