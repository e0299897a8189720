"""Shared helpers for the pictures (pipeline timelines, log plots, benchmark charts).

matplotlib is an optional dependency (``pip install matplotlib`` or ``megalite[plots]``),
imported only when a picture is drawn. Figures are built with ``matplotlib.figure.Figure``
on the headless Agg backend: no display, no pyplot state shared with the caller.
"""
from __future__ import annotations

import os
import sys

FORMATS = ("png", "svg", "pdf")


def require_matplotlib():
    """Import matplotlib on the headless Agg backend, or fail with how to install it."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("drawing pictures needs matplotlib: pip install matplotlib "
                          "(or pip install -e '.[plots]' for megalite[plots])") from e
    major, minor = (int(x) for x in matplotlib.__version__.split(".")[:2])
    if (major, minor) < (3, 7):
        raise ImportError(f"drawing pictures needs matplotlib>=3.7 (found {matplotlib.__version__}): "
                          "pip install -U matplotlib")
    if "matplotlib.pyplot" not in sys.modules:  # leave an interactive session's backend alone
        matplotlib.use("Agg")
    return matplotlib


def new_figure(width: float, height: float):
    """A Figure of width x height inches, detached from pyplot (nothing to close)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # so that fig.canvas.draw() lays out and measures text
    return fig


def output_paths(path: str, formats: list[str] | None = None) -> list[str]:
    """Where to write: the path as given when its extension names a format (png, svg, pdf),
    else path + ".png"; with ``formats``, one file per format, the extension replaced."""
    root, ext = os.path.splitext(path)
    ext = ext[1:].lower()
    if not formats:
        return [path] if ext in FORMATS else [path + ".png"]
    base = root if ext in FORMATS else path
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"unknown picture format {f!r}; use one of {', '.join(FORMATS)}")
    return [f"{base}.{f}" for f in formats]


def save(fig, path: str, formats: list[str] | None = None, dpi: int = 120) -> list[str]:
    """Write the figure to each of ``output_paths(path, formats)``; returns the paths."""
    import matplotlib

    paths = output_paths(path, formats)
    # SVG keeps its text as <text> elements (searchable, small); no dates, stable ids, so a
    # regenerated picture differs only where the picture does.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "megalite"}):
        for p in paths:
            directory = os.path.dirname(p)
            if directory:
                os.makedirs(directory, exist_ok=True)
            fmt = os.path.splitext(p)[1][1:].lower()
            metadata = {"png": None, "svg": {"Date": None}, "pdf": {"CreationDate": None}}[fmt]
            fig.savefig(p, dpi=dpi, format=fmt, metadata=metadata)
    return paths
