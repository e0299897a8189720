"""Progress bars (tqdm), drawn only on a terminal.

Every bar of megalite (training and meta dry runs, preprocessing, Hugging Face conversion)
comes from here: a ``tqdm`` on a stream that is a terminal. Off a terminal (logs, pipes, tests)
no bar is made, so no bar characters appear and tqdm starts no monitor thread (which matters
in processes that fork afterwards). Text printed while a bar is drawn goes through ``tqdm.write``
/ ``tqdm.external_write_mode``, which clear the bar, print the text on its own line and redraw
the bar under it; megalite passes ``nolock=True`` there: it prints from one thread, and tqdm's
default lock is a multiprocessing lock that forked processes would share.
"""
from __future__ import annotations

import sys
from typing import Iterable, TextIO

from tqdm import tqdm


def is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


def progress_bar(stream: TextIO | None = None, **kwargs) -> tqdm:
    """A tqdm bar on ``stream`` (default: ``sys.stderr`` at call time), disabled unless the
    stream is a terminal; ``kwargs`` go to tqdm (``total``, ``desc``, ``unit``, ...)."""
    stream = sys.stderr if stream is None else stream
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(file=stream, disable=not is_terminal(stream), **kwargs)


def track(iterable: Iterable, stream: TextIO | None = None, enabled: bool = True, **kwargs) -> Iterable:
    """``iterable`` with a bar on ``stream`` (default ``sys.stderr``) when ``enabled`` and the
    stream is a terminal; otherwise the iterable itself."""
    stream = sys.stderr if stream is None else stream
    if not (enabled and is_terminal(stream)):
        return iterable
    return progress_bar(stream, iterable=iterable, **kwargs)
