#!/usr/bin/env python
"""Plot one or several --log-json runs side by side as a PNG (no plotting library needed).

    python tools/plot_log.py runs/a/log.jsonl runs/b/log.jsonl --output runs/compare.png

Three panels, left to right: loss (and validation loss as dots), tokens/s, memory bytes per
rank; x is the iteration. Each run has its own colour; the legend (run -> colour) and each
panel's value range are printed, since the picture has no text.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megalite.timeline import write_png  # noqa: E402

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]
PANELS = [("loss", lambda r: r["loss"]), ("tokens/s", lambda r: r["tokens_per_sec"]),
          ("memory bytes", lambda r: sum(r.get("memory_bytes", {}).values()) or None)]


def load(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def draw_line(img, xs, ys, color, box):
    x0, y0, x1, y1 = box
    for (xa, ya), (xb, yb) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        n = int(max(abs(xb - xa), abs(yb - ya), 1))
        for t in np.linspace(0, 1, n + 1):
            x, y = int(round(xa + t * (xb - xa))), int(round(ya + t * (yb - ya)))
            img[max(y0, y - 1): min(y1, y + 1), max(x0, x - 1): min(x1, x + 1)] = color


def plot(runs: dict, output: str, width=420, height=300, margin=20):
    img = np.full((height, 3 * width, 3), 255, dtype=np.uint8)
    ranges = {}
    for p, (title, get) in enumerate(PANELS):
        box = (p * width + margin, margin, (p + 1) * width - margin, height - margin)
        img[box[1]: box[3], [box[0], box[2] - 1]] = 0
        img[[box[1], box[3] - 1], box[0]: box[2]] = 0
        series = {n: [(r["iteration"], get(r)) for r in recs if get(r) is not None] for n, recs in runs.items()}
        values = [v for s in series.values() for _, v in s]
        iters = [i for s in series.values() for i, _ in s]
        if not values:
            continue
        lo, hi = min(values), max(values)
        lo, hi = (lo - 1, hi + 1) if lo == hi else (lo, hi)
        ranges[title] = (lo, hi)
        first, last = min(iters), max(max(iters), min(iters) + 1)

        def to_px(i, v):
            return (box[0] + 2 + (i - first) / (last - first) * (box[2] - box[0] - 4),
                    box[3] - 2 - (v - lo) / (hi - lo) * (box[3] - box[1] - 4))
        for c, (name, s) in enumerate(series.items()):
            pts = [to_px(i, v) for i, v in s]
            draw_line(img, [x for x, _ in pts], [y for _, y in pts], COLORS[c % len(COLORS)], box)
            if title == "loss":  # validation points
                for r in runs[name]:
                    if "valid_loss" in r and lo <= r["valid_loss"] <= hi:
                        x, y = to_px(r["iteration"], r["valid_loss"])
                        img[int(y) - 3: int(y) + 3, int(x) - 3: int(x) + 3] = COLORS[c % len(COLORS)]
    write_png(output, img)
    return ranges


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+")
    p.add_argument("--output", default="log_plot.png")
    a = p.parse_args()
    runs = {path: load(path) for path in a.logs}
    ranges = plot(runs, a.output)
    for c, name in enumerate(runs):
        print(f"rgb{COLORS[c % len(COLORS)]}: {name} ({len(runs[name])} iterations)")
    for title, (lo, hi) in ranges.items():
        print(f"{title}: y from {lo:.4g} to {hi:.4g}")
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
