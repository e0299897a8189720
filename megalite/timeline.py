"""Pipeline schedule traces: measured bubble fraction and a timeline picture.

A trace is, per rank, a list of (op, micro-batch, chunk, start, end) with op "F" or "B"
and times from ``time.perf_counter`` (one monotonic clock for all processes of a machine).

Bubble: over the step's span [first start, last end] across all ranks, the fraction of
time a rank computes nothing, averaged over ranks. Theory for P stages, M micro-batches
and V chunks per rank, with uniform stages: (P - 1) / (V*M + P - 1).

The picture (matplotlib, PNG / SVG / PDF by the file's extension): one row per stage,
labelled with its rank and idle fraction; forward steps in blue, backward in green (darker
shades for later virtual chunks), each box numbered with its micro-batch where the number
fits; idle time in grey; a time axis in ms; the measured bubble beside the theory in the title.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load_traces(trace_dir: str) -> list[dict]:
    traces = [json.loads(p.read_text()) for p in sorted(Path(trace_dir).glob("trace_rank*.json"))]
    if not traces:
        raise FileNotFoundError(f"no trace_rank*.json in {trace_dir}; run pretrain_gpt.py with "
                                f"--pipeline-trace {trace_dir} (and --pipeline-model-parallel-size > 1)")
    return traces


def theory_bubble(P: int, M: int, V: int = 1) -> float:
    return (P - 1) / (V * M + P - 1)


def measured_bubble(events_per_rank: list[list]) -> float:
    start = min(e[3] for events in events_per_rank for e in events)
    end = max(e[4] for events in events_per_rank for e in events)
    span = end - start
    idle = [1.0 - sum(e[4] - e[3] for e in events) / span for events in events_per_rank]
    return float(np.mean(idle))


def schedule_name(events_per_rank: list[list], num_chunks: int = 1) -> str:
    """The schedule a trace shows: GPipe when every rank runs all its forwards before any
    backward (and M > 1), else 1F1B; interleaved 1F1B with several chunks per rank."""
    if num_chunks > 1:
        return "interleaved 1F1B"
    micro = {e[1] for events in events_per_rank for e in events}
    for events in events_per_rank:
        ops = [e[0] for e in sorted(events, key=lambda e: e[3])]
        if "B" in ops and "F" in ops[ops.index("B"):]:
            return "1F1B"
    return "GPipe" if len(micro) > 1 else "1F1B"


def _shades(cmap, n: int) -> list:
    return [cmap(x) for x in (np.linspace(0.55, 0.85, n) if n > 1 else [0.65])]


def draw_timeline(events_per_rank: list[list], path: str, num_chunks: int = 1, *,
                  labels: list[str] | None = None, schedule: str | None = None,
                  num_micro: int | None = None, formats: list[str] | None = None,
                  dpi: int = 120) -> list[str]:
    """Draw one step's pipeline timeline to ``path`` (PNG, SVG or PDF by its extension, or
    one file per entry of ``formats``); returns the paths written.

    ``events_per_rank[p]``: stage p's (op, micro, chunk, start, end), times in seconds.
    ``labels``: one row label per stage (default "stage p"); ``schedule``: its name in the
    title (default: guessed from the trace, see :func:`schedule_name`); ``num_micro``: M
    (default: the number of micro-batches in the trace)."""
    from megalite.plotting import new_figure, require_matplotlib, save

    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    P = len(events_per_rank)
    V = max([num_chunks] + [e[2] + 1 for events in events_per_rank for e in events])
    M = num_micro or len({e[1] for events in events_per_rank for e in events})
    start = min(e[3] for events in events_per_rank for e in events)
    end = max(e[4] for events in events_per_rank for e in events)
    span_ms = (end - start) * 1e3
    forward, backward = _shades(colormaps["Blues"], V), _shades(colormaps["Greens"], V)
    schedule = schedule or schedule_name(events_per_rank, V)
    labels = labels or [f"stage {p}" for p in range(P)]

    fig = new_figure(12, 1.9 + 0.55 * P)
    ax = fig.add_subplot()
    height = 0.8
    numbers = []
    for p, events in enumerate(events_per_rank):
        ax.broken_barh([(0, span_ms)], (p - height / 2, height), facecolors="#e6e6e6")  # idle
        busy = 0.0
        for op, micro, chunk, t0, t1 in events:
            x0, width = (t0 - start) * 1e3, (t1 - t0) * 1e3
            busy += width
            color = (forward if op == "F" else backward)[chunk]
            ax.broken_barh([(x0, width)], (p - height / 2, height), facecolors=color,
                           edgecolors="white", linewidth=0.6)
            dark = 0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2] < 0.5
            text = ax.text(x0 + width / 2, p, str(micro), ha="center", va="center", fontsize=8,
                           color="white" if dark else "black", clip_on=True)
            text.set_in_layout(False)
            numbers.append((text, x0, x0 + width))
        ax.text(1.005, p, f"idle {1 - busy / span_ms:.0%}", transform=blended_transform_factory(
            ax.transAxes, ax.transData), va="center", fontsize=9)
    ax.set_xlim(0, span_ms)
    ax.set_ylim(P - 0.5, -0.5)  # stage 0 on top
    ax.set_yticks(range(P), labels)
    ax.set_xlabel("time since the step's first operation (ms)")
    formula = "(P-1)/(M+P-1)" if V == 1 else "(P-1)/(V·M+P-1)"
    sizes = f"P={P} stages, M={M} micro-batches" + (f", V={V} chunks per stage" if V > 1 else "")
    ax.set_title(f"{schedule} schedule, {sizes}\nbubble: measured {measured_bubble(events_per_rank):.3f}, "
                 f"theory {formula} = {theory_bubble(P, M, V):.3f}  (numbers on the boxes: micro-batch)")
    handles = []
    for c in range(V):
        suffix = f" (chunk {c})" if V > 1 else ""
        handles += [Patch(color=forward[c], label="forward" + suffix),
                    Patch(color=backward[c], label="backward" + suffix)]
    handles.append(Patch(color="#e6e6e6", label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)

    # Keep a micro-batch number only where it fits inside its box (positions after layout).
    fig.canvas.draw()
    to_px = ax.transData.transform
    for text, x0, x1 in numbers:
        box = to_px((x1, 0))[0] - to_px((x0, 0))[0]
        if text.get_window_extent().width > box - 2:
            text.remove()
    return save(fig, path, formats, dpi=dpi)
