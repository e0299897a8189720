#!/usr/bin/env python
"""AdamW against Muon on one corpus: a learning-rate sweep of each, the same model and the same
tokens, validation loss against tokens in one figure, and the tokens Muon needs to reach AdamW's
final validation loss.

Each run is one ``pretrain_gpt.py`` process (one rank, ``OMP_NUM_THREADS=1``; ``--jobs`` of them
at a time), the demo's model and schedule (``scripts/demo.sh``: 4 layers, hidden 128, seq 128,
global batch 16, warm-up then cosine decay to ``--min-lr`` = lr / 10), the same seed and so the
same batches in the same order, and the same validation batches every ``--eval-interval``.
Muon runs add ``--optimizer muon`` and ``MUON_FLAGS`` (Moonlight's RMS matching: the spectral
scale sqrt(max(m, n)) times 0.2 gives the update AdamW's RMS, so AdamW's learning rates and
weight decay carry over); its AdamW part (embeddings, output layer, norms, biases) runs at the
same learning rate.

The best run of each optimizer is the one with the lowest final validation loss. The tokens Muon
needs to reach AdamW's best final loss ``L``: on the best Muon run's validation curve
(tokens, loss), the first segment that crosses ``L``, linearly interpolated; none if it never
does (say so). A run whose log already holds its last iteration is not run again (a sweep can be
resumed, or only re-drawn with ``--no-run``).

    python tools/compare_optimizers.py --data-path runs/demo/corpus --tokenizer-model runs/demo/tok.model \\
        --out runs/compare [--adam-lrs 3e-4 1e-3 3e-3] [--muon-lrs 1e-3 3e-3 1e-2] [--train-iters 300] \\
        [--jobs 2] [--plot docs/images/muon_vs_adamw.png] [--summary docs/muon_vs_adamw.json]
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.plot_log import load  # noqa: E402
from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "8", "--global-batch-size", "16", "--hidden-dropout", "0.0",
         "--attention-dropout", "0.0", "--weight-decay", "0.1", "--clip-grad", "1.0", "--lr-decay-style", "cosine",
         "--seed", "1234"]  # scripts/demo.sh's model and training flags (one rank: 2 micro-batches per step)
MUON_FLAGS = ["--optimizer", "muon", "--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2"]


def run_name(optimizer: str, lr: float) -> str:
    return f"{optimizer}_lr{lr:g}"


def tokens_per_iteration(model_flags: list[str]) -> int:
    flags = dict(zip(model_flags[::2], model_flags[1::2]))
    return int(flags["--global-batch-size"]) * int(flags["--seq-length"])


def command(args, optimizer: str, lr: float, folder: str) -> list[str]:
    """The pretrain_gpt.py command line of one run of the sweep."""
    extra = MUON_FLAGS if optimizer == "muon" else []
    return [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--data-path", args.data_path,
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", args.tokenizer_model, *MODEL,
            "--train-iters", str(args.train_iters), "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}",
            "--lr-warmup-iters", str(args.warmup_iters), "--log-interval", "10",
            "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
            "--log-json", os.path.join(folder, "log.jsonl"), *extra]


def finished(folder: str, iters: int) -> bool:
    path = os.path.join(folder, "log.jsonl")
    return os.path.exists(path) and any(r["iteration"] == iters and "valid_loss" in r for r in load(path))


def run_sweep(args, runs: list[tuple[str, float]]) -> None:
    """Run the sweep's missing runs, ``--jobs`` at a time; a failed run stops the sweep with its output's tail."""
    todo = [(opt, lr) for opt, lr in runs if not finished(os.path.join(args.out, run_name(opt, lr)), args.train_iters)]
    running: list = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    while todo or running:
        while todo and len(running) < args.jobs:
            opt, lr = todo.pop(0)
            folder = os.path.join(args.out, run_name(opt, lr))
            os.makedirs(folder, exist_ok=True)
            if os.path.exists(os.path.join(folder, "log.jsonl")):
                os.remove(os.path.join(folder, "log.jsonl"))  # an interrupted run starts again
            cmd = command(args, opt, lr, folder)
            with open(os.path.join(folder, "command.txt"), "w") as f:
                f.write(" ".join(cmd) + "\n")
            out = open(os.path.join(folder, "stdout.txt"), "w")
            running.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT),
                            out, folder, time.monotonic()))
            print(f"started {run_name(opt, lr)}", flush=True)
        time.sleep(1.0)
        for entry in list(running):
            proc, out, folder, start = entry
            if proc.poll() is None:
                continue
            out.close()
            running.remove(entry)
            if proc.returncode != 0:
                with open(os.path.join(folder, "stdout.txt")) as f:
                    tail = f.read()[-2000:]
                raise SystemExit(f"compare_optimizers: {folder} failed (exit {proc.returncode}):\n{tail}")
            print(f"finished {os.path.basename(folder)} in {time.monotonic() - start:.0f} s", flush=True)


def curve(records: list[dict], per_iter: int) -> list[tuple[int, float]]:
    """(tokens seen, validation loss) at each evaluation."""
    return [(r["iteration"] * per_iter, r["valid_loss"]) for r in records if r.get("valid_loss") is not None]


def tokens_to_reach(points: list[tuple[int, float]], target: float) -> float | None:
    """The tokens at which the curve first reaches ``target``, linearly interpolated inside the
    crossing segment (from the origin's side: the first evaluation already at or below it
    counts as reached there); None if it never does."""
    for k, (tokens, loss) in enumerate(points):
        if loss <= target:
            if k == 0:
                return float(tokens)
            (t0, l0) = points[k - 1]
            return t0 + (l0 - target) / (l0 - loss) * (tokens - t0)
    return None


def summarise(args, runs: list[tuple[str, float]]) -> dict:
    per_iter = tokens_per_iteration(MODEL)
    table = []
    for opt, lr in runs:
        folder = os.path.join(args.out, run_name(opt, lr))
        records = load(os.path.join(folder, "log.jsonl"))
        points = curve(records, per_iter)
        last = records[-1]
        table.append({"optimizer": opt, "lr": lr, "final_valid_loss": points[-1][1], "curve": points,
                      "final_train_loss": last.get("loss"), "seconds": last.get("run_elapsed_s")})
    best = {opt: min((r for r in table if r["optimizer"] == opt), key=lambda r: r["final_valid_loss"])
            for opt in ("adam", "muon") if any(r["optimizer"] == opt for r in table)}
    summary = {"tokens_per_iteration": per_iter, "train_iters": args.train_iters, "runs": table,
               "best": {opt: run_name(opt, r["lr"]) for opt, r in best.items()}}
    if len(best) == 2:
        target = best["adam"]["final_valid_loss"]
        adam_tokens = best["adam"]["curve"][-1][0]
        reached = tokens_to_reach(best["muon"]["curve"], target)
        summary.update(adam_final_valid_loss=target, adam_tokens=adam_tokens, muon_tokens_to_adam_final=reached,
                       token_ratio=None if reached is None else reached / adam_tokens)
    return summary


def draw(summary: dict, path: str) -> None:
    """Validation loss against tokens: the two best runs bold, the rest of the sweep faint, AdamW's
    final loss dotted and where Muon reaches it marked; the sweep's final losses in a table below."""
    from megalite.observe.plotting import new_figure, save

    fig = new_figure(7.5, 6.2)
    ax, tab = fig.subplots(2, 1, height_ratios=[3.2, 1.3])
    colours = {"adam": "tab:blue", "muon": "tab:orange"}
    labels = {"adam": "AdamW", "muon": "Muon"}
    best = set(summary["best"].values())
    for r in summary["runs"]:
        name = run_name(r["optimizer"], r["lr"])
        xs = [t / 1e6 for t, _ in r["curve"]]
        ys = [loss for _, loss in r["curve"]]
        strong = name in best
        ax.plot(xs, ys, color=colours[r["optimizer"]], alpha=1.0 if strong else 0.3, lw=2.2 if strong else 0.9,
                marker="o" if strong else None, ms=3.5, label=f"{labels[r['optimizer']]} lr {r['lr']:g}"
                + (" (best)" if strong else ""))
    if summary.get("adam_final_valid_loss") is not None:
        target = summary["adam_final_valid_loss"]
        ax.axhline(target, color="tab:blue", ls=":", lw=1)
        if summary["muon_tokens_to_adam_final"] is not None:
            x = summary["muon_tokens_to_adam_final"] / 1e6
            ax.plot([x], [target], marker="*", color="tab:red", ms=13, zorder=5,
                    label=f"Muon reaches AdamW's final loss: {x:.3f}M tokens ({summary['token_ratio']:.2f}x)")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"AdamW vs Muon, the demo corpus ({summary['train_iters']} iterations, "
                 f"{summary['tokens_per_iteration']:,} tokens each)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, ncol=2)
    tab.axis("off")
    rows = [[labels[r["optimizer"]], f"{r['lr']:g}", f"{r['final_valid_loss']:.4f}",
             "best" if run_name(r["optimizer"], r["lr"]) in best else ""] for r in summary["runs"]]
    cells = tab.table(cellText=rows, colLabels=["optimizer", "lr", "final validation loss", ""], loc="center",
                      cellLoc="center")
    cells.auto_set_font_size(False)
    cells.set_fontsize(8)
    cells.scale(1, 1.1)
    save(fig, path, dpi=100)


def markdown(summary: dict) -> str:
    """The sweep's table and the tokens sentence, as docs/BENCHMARKS.md shows them."""
    lines = ["| optimizer | lr | final validation loss | final training loss | run time |", "|---|---|---|---|---|"]
    best = set(summary["best"].values())
    for r in summary["runs"]:
        mark = " **(best)**" if run_name(r["optimizer"], r["lr"]) in best else ""
        name = "AdamW" if r["optimizer"] == "adam" else "Muon"
        lines.append(f"| {name} | {r['lr']:g}{mark} | {r['final_valid_loss']:.4f} | {r['final_train_loss']:.4f} | "
                     f"{r['seconds']:.0f} s |")
    if summary.get("adam_final_valid_loss") is not None:
        reached = summary["muon_tokens_to_adam_final"]
        lines.append("")
        lines.append(f"AdamW's best final validation loss {summary['adam_final_valid_loss']:.4f} after "
                     f"{summary['adam_tokens']:,} tokens; " + (
                         f"Muon's best run reaches it after {reached:,.0f} tokens ({summary['token_ratio']:.2f}x)."
                         if reached is not None else "Muon's best run does not reach it."))
    return "\n".join(lines)


def main(argv=None):
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--data-path", required=True)
    parser.add_argument("--tokenizer-model", required=True)
    parser.add_argument("--out", required=True, help="a folder for the runs (git-ignored: runs/ or /tmp)")
    parser.add_argument("--adam-lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--warmup-iters", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--eval-iters", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--no-run", action="store_true", help="only summarise and draw the runs already in --out")
    parser.add_argument("--plot", default=None, help="the figure (.png, .svg, .pdf)")
    parser.add_argument("--summary", default=None, help="a JSON file of the sweep's curves and the comparison")
    args = parser.parse_args(argv)
    positive(parser, "--train-iters/--eval-interval/--eval-iters/--jobs", args.train_iters, args.eval_interval,
             args.eval_iters, args.jobs)
    if args.train_iters % args.eval_interval:
        parser.error(f"--train-iters {args.train_iters} is not a multiple of --eval-interval {args.eval_interval}: "
                     f"the last iteration would have no validation loss")
    writable(parser, "--plot", args.plot)
    writable(parser, "--summary", args.summary)
    runs = [("adam", lr) for lr in args.adam_lrs] + [("muon", lr) for lr in args.muon_lrs]
    if not args.no_run:
        run_sweep(args, runs)
    summary = summarise(args, runs)
    print(markdown(summary))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        draw(summary, args.plot)
        print(f"figure: {args.plot}")
    return summary


if __name__ == "__main__":
    main()
