#!/usr/bin/env python
"""Draw a pipeline schedule trace and measure its bubble.

    torchrun --nproc_per_node 4 pretrain_gpt.py --pipeline-model-parallel-size 4 ... --pipeline-trace runs/trace
    python tools/pipeline_timeline.py --trace-dir runs/trace --output runs/trace/timeline.png

Prints the measured bubble fraction beside the theory: (P-1)/(M+P-1) for 1F1B,
(P-1)/(V*M+P-1) for the interleaved schedule, (P-1)/(3M+P-1) for ZB-H1 (M >= P), the
operation lists' simulation for ZBV (F = B = W assumed). Only the ranks of one pipeline
(tp=0, dp=0) are drawn: one row per stage, labelled with its global rank, forward,
backward and, for the zero-bubble schedules, the deferred weight gradients W (per chunk)
in distinct colours, micro-batch numbers on the boxes, a time axis in ms and both bubbles
in the title. The output's extension picks the format (.png, .svg, .pdf); --format writes
several. Needs matplotlib (pip install matplotlib).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.pipeline.schedule_kinds import schedule as describe  # noqa: E402
from megalite.observe.plotting import FORMATS  # noqa: E402
from megalite.observe.timeline import (  # noqa: E402
    NAMES, draw_timeline, load_traces, measured_bubble, schedule_name, schedule_theory)
from tools.tool_errors import one_line_errors  # noqa: E402


def _cannot_read(tool: str, e: OSError) -> None:
    """One line naming the file and why, no traceback; exit status 2."""
    print(f"{tool}: cannot read {e.filename}: {e.strerror}" if e.filename else f"{tool}: {e}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--trace-dir", required=True)
    p.add_argument("--output", "-o", default=None, help="picture path (default: TRACE_DIR/timeline.png)")
    p.add_argument("--format", nargs="+", choices=FORMATS, default=None,
                   help="write one file per format (the output's extension replaced)")
    p.add_argument("--schedule", default=None, help="schedule name for the title and the theory (default: "
                   "the trace's, else guessed from it: GPipe, 1F1B, interleaved 1F1B, ZB-H1 or ZBV)")
    args = p.parse_args(argv)
    try:
        traces = [t for t in load_traces(args.trace_dir) if t["tp_rank"] == 0 and t["dp_rank"] == 0]
    except OSError as e:
        _cannot_read("pipeline_timeline.py", e)
    except (ValueError, KeyError) as e:  # a file that is not a --pipeline-trace JSON
        print(f"pipeline_timeline.py: {args.trace_dir}: not a --pipeline-trace folder ({e!r})", file=sys.stderr)
        sys.exit(2)
    traces.sort(key=lambda t: t["pp_rank"])
    P, V, M = traces[0]["P"], traces[0]["V"], traces[0]["M"]
    events = [t["events"] for t in traces]
    labels = [f"stage {t['pp_rank']} (rank {t['rank']})" for t in traces]
    recorded = traces[0].get("schedule")  # a --pipeline-schedule value, when the trace names it
    if recorded:
        recorded = describe(recorded).run_name(V)
    schedule = args.schedule or NAMES.get(recorded, recorded) or schedule_name(events, V)
    out = args.output or os.path.join(args.trace_dir, "timeline.png")
    paths = draw_timeline(events, out, num_chunks=V, labels=labels, schedule=schedule, num_micro=M,
                          formats=args.format)
    formula, theory = schedule_theory(schedule, P, M, V)
    print(f"{schedule}, P={P} M={M} V={V}: measured bubble {measured_bubble(events):.3f}, "
          f"theory {formula} = {theory:.3f}; timeline: {', '.join(paths)}")


if __name__ == "__main__":
    main()
