"""Pipeline schedule traces: measured bubble fraction and a timeline picture.

A trace is, per rank, a list of (op, micro-batch, chunk, start, end) with times from
``time.perf_counter`` (one monotonic clock for all processes of a machine) and op one of

- ``F``: a chunk's forward;
- ``B``: its backward; in a zero-bubble trace (one that has ``W`` ops) only the backward to
  the chunk's input, else the whole backward (what older traces record);
- ``W``: the chunk's weight gradients, deferred from B (zero-bubble schedules);
- ``BW``: B and W at once, the classical backward as the schedule executor records it.

Bubble: over the step's span [first start, last end] across all ranks, the fraction of
time a rank computes nothing, averaged over ranks. Theory (:func:`schedule_theory`), with
uniform stages whose F, B and W take the same time t (so the classical backward takes 2t):
(P - 1) / (V*M + P - 1) for GPipe, 1F1B and interleaved 1F1B with V chunks per rank;
(P - 1) / (3M + P - 1) for ZB-H1 when M >= P (idle (P-1)(F+B-W) per rank against 1F1B's
(P-1)(F+B+W)); for ZBV, and ZB-H1 with M < P, the simulation of the operation lists. The
number is the resolved schedule's (:meth:`megalite.pipeline.plan.PipelineSchedule.theory_bubble`).

The picture (matplotlib, PNG / SVG / PDF by the file's extension): one row per stage,
labelled with its rank and idle fraction; forward in blue, backward (B or BW) in green,
weight gradients (W) in orange, darker shades for later chunks; each box numbered with
its micro-batch where the number fits; idle time in grey; a time axis in ms; the measured
bubble beside the theory in the title.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megalite.pipeline.plan import resolve_schedule
from megalite.pipeline.schedule_kinds import DISPLAY_NAMES

# Display names and the --pipeline-schedule values (megalite.pipeline.schedule_kinds).
NAMES = dict(DISPLAY_NAMES)
_KEYS = {name: key for key, name in NAMES.items()}


def load_traces(trace_dir: str) -> list[dict]:
    traces = [json.loads(p.read_text()) for p in sorted(Path(trace_dir).glob("trace_rank*.json"))]
    if not traces:
        raise FileNotFoundError(f"no trace_rank*.json in {trace_dir}; run pretrain_gpt.py with "
                                f"--pipeline-trace {trace_dir} (and --pipeline-model-parallel-size > 1)")
    return traces


def schedule_theory(schedule: str, P: int, M: int, V: int = 1) -> tuple[str, float]:
    """(formula or how it was obtained, theoretical bubble) for a schedule given by its
    display name (:data:`NAMES`) or its --pipeline-schedule value, F = B = W per stage: the
    resolved schedule's :meth:`~megalite.pipeline.plan.PipelineSchedule.theory_bubble`. A name
    this module does not know gets the classical (P-1)/(V*M+P-1)."""
    resolved = resolve_schedule(_KEYS.get(schedule, schedule.lower()), P, V)
    value = resolved.theory_bubble(M)
    if resolved.split_backward:
        if resolved.kind.one_chunk_split and M >= P:
            return "(P-1)/(3M+P-1)", value
        return "simulated, F=B=W", value
    return ("(P-1)/(M+P-1)" if resolved.V == 1 else "(P-1)/(V·M+P-1)"), value


def measured_bubble(events_per_rank: list[list]) -> float:
    start = min(e[3] for events in events_per_rank for e in events)
    end = max(e[4] for events in events_per_rank for e in events)
    span = end - start
    idle = [1.0 - sum(e[4] - e[3] for e in events) / span for events in events_per_rank]
    return float(np.mean(idle))


def idle_seconds(events_per_rank: list[list]) -> list[float]:
    """Per rank, the time it computes nothing within the step's span (the bubble, in seconds)."""
    start = min(e[3] for events in events_per_rank for e in events)
    end = max(e[4] for events in events_per_rank for e in events)
    return [(end - start) - sum(e[4] - e[3] for e in events) for events in events_per_rank]


def schedule_name(events_per_rank: list[list], num_chunks: int = 1) -> str:
    """The schedule a trace shows. With W ops (weight gradients apart from B): ZB-H1 on one
    chunk per rank, ZBV on two. Else: interleaved 1F1B with several chunks per rank; GPipe
    when every rank runs all its forwards before any backward (and M > 1); else 1F1B."""
    chunks = max([num_chunks] + [e[2] + 1 for events in events_per_rank for e in events])
    if any(e[0] == "W" for events in events_per_rank for e in events):
        return {1: "ZB-H1", 2: "ZBV"}.get(chunks, f"zero-bubble, {chunks} chunks per rank")
    if chunks > 1:
        return "interleaved 1F1B"
    micro = {e[1] for events in events_per_rank for e in events}
    for events in events_per_rank:
        ops = [e[0] for e in sorted(events, key=lambda e: e[3])]
        backward = [i for i, op in enumerate(ops) if op in ("B", "BW")]
        if backward and "F" in ops[backward[0]:]:
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
    title, which also picks the theory (:func:`schedule_theory`; default: guessed from the
    trace, see :func:`schedule_name`); ``num_micro``: M (default: the number of
    micro-batches in the trace)."""
    from megalite.observe.plotting import new_figure, require_matplotlib, save

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
    colors = {"F": _shades(colormaps["Blues"], V), "B": _shades(colormaps["Greens"], V),
              "W": _shades(colormaps["Oranges"], V)}
    colors["BW"] = colors["B"]
    split = any(e[0] == "W" for events in events_per_rank for e in events)
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
            color = colors[op][chunk]
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
    formula, theory = schedule_theory(schedule, P, M, V)
    sizes = f"P={P} stages, M={M} micro-batches" + (f", V={V} chunks per stage" if V > 1 else "")
    ax.set_title(f"{schedule} schedule, {sizes}\nbubble: measured {measured_bubble(events_per_rank):.3f}, "
                 f"theory {formula} = {theory:.3f}  (numbers on the boxes: micro-batch)")
    kinds = [("F", "forward"), ("B", "backward B (input grad)"), ("W", "weight grad W")] if split else \
        [("F", "forward"), ("B", "backward")]
    # One legend column per kind, one row per chunk (the legend fills column by column).
    handles = [Patch(color=colors[kind][c], label=label + (f" (chunk {c})" if V > 1 else ""))
               for kind, label in kinds for c in range(V)]
    handles += [Patch(color="#e6e6e6", label="idle")] + [Patch(color="none", label=" ")] * (V - 1)
    fig.legend(handles=handles, loc="outside lower center", ncol=len(kinds) + 1, frameon=False)

    # Keep a micro-batch number only where it fits inside its box (positions after layout).
    fig.canvas.draw()
    to_px = ax.transData.transform
    for text, x0, x1 in numbers:
        box = to_px((x1, 0))[0] - to_px((x0, 0))[0]
        if text.get_window_extent().width > box - 2:
            text.remove()
    return save(fig, path, formats, dpi=dpi)
