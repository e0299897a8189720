#!/usr/bin/env python
"""Draw a pipeline schedule trace and measure its bubble.

    torchrun --nproc_per_node 4 pretrain_gpt.py --pipeline-model-parallel-size 4 ... --pipeline-trace runs/trace
    python tools/pipeline_timeline.py --trace-dir runs/trace --output runs/trace/timeline.png

Prints the measured bubble fraction beside the theory (P-1)/(M+P-1), or (P-1)/(V*M+P-1)
for the interleaved schedule. Only the ranks of one pipeline (tp=0, dp=0) are drawn.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.timeline import draw_timeline, load_traces, measured_bubble, theory_bubble  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace-dir", required=True)
    p.add_argument("--output", default=None, help="PNG path (default: TRACE_DIR/timeline.png)")
    args = p.parse_args()
    traces = [t for t in load_traces(args.trace_dir) if t["tp_rank"] == 0 and t["dp_rank"] == 0]
    traces.sort(key=lambda t: t["pp_rank"])
    P, V, M = traces[0]["P"], traces[0]["V"], traces[0]["M"]
    events = [t["events"] for t in traces]
    out = args.output or os.path.join(args.trace_dir, "timeline.png")
    draw_timeline(events, out, num_chunks=V)
    print(f"P={P} M={M} V={V}: measured bubble {measured_bubble(events):.3f}, "
          f"theory {theory_bubble(P, M, V):.3f}; timeline: {out}")


if __name__ == "__main__":
    main()
