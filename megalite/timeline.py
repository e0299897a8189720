"""Pipeline schedule traces: measured bubble fraction and a timeline picture (PNG).

A trace is, per rank, a list of (op, micro-batch, chunk, start, end) with op "F" or "B"
and times from ``time.perf_counter`` (one monotonic clock for all processes of a machine).

Bubble: over the step's span [first start, last end] across all ranks, the fraction of
time a rank computes nothing, averaged over ranks. Theory for P stages, M micro-batches
and V chunks per rank, with uniform stages: (P - 1) / (V*M + P - 1).

The PNG is written with zlib alone (no plotting dependency): one row per rank, forward
steps in blue shades, backward in green shades (darker for later chunks), idle in white.
"""
from __future__ import annotations

import json
import struct
import zlib
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


def write_png(path: str, rgb: np.ndarray) -> None:
    """Minimal PNG encoder for an (H, W, 3) uint8 image."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


def draw_timeline(events_per_rank: list[list], path: str, width: int = 1200, row: int = 28,
                  num_chunks: int = 1) -> None:
    start = min(e[3] for events in events_per_rank for e in events)
    end = max(e[4] for events in events_per_rank for e in events)
    scale = (width - 1) / (end - start)
    gap = 4
    image = np.full((len(events_per_rank) * (row + gap) + gap, width, 3), 255, dtype=np.uint8)
    for r, events in enumerate(events_per_rank):
        top = gap + r * (row + gap)
        image[top: top + row, :] = (235, 235, 235)  # idle
        for op, micro, chunk, t0, t1 in events:
            x0, x1 = int((t0 - start) * scale), max(int((t1 - start) * scale), int((t0 - start) * scale) + 1)
            shade = 60 * chunk // max(1, num_chunks - 1) if num_chunks > 1 else 0
            color = (70 + shade // 2, 120 - shade // 2, 220 - shade) if op == "F" else (60, 170 - shade, 80)
            image[top + 2: top + row - 2, x0:x1] = color
            image[top + 2: top + row - 2, x0] = (255, 255, 255)  # a thin separator per step
    write_png(path, image)
