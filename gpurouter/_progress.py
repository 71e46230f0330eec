"""A dependency-free progress bar for the command line (stderr, one line)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str, enabled: bool = True,
             describe: Callable[[T], str] = str) -> Iterator[T]:
    """Yields ``items`` while drawing ``label [#####.....] i/total elapsed item`` on
    stderr, each item named by ``describe``: one line redrawn with ``\\r`` on a
    terminal, else (a log file, a pipe) one plain line per item."""
    start = time.perf_counter()
    out = sys.stderr
    width = 24

    tty = bool(getattr(out, "isatty", lambda: False)())

    def draw(i: int, what: str) -> None:
        if not enabled:
            return
        if not tty:  # a log file or a pipe: one plain line per item, no carriage returns
            out.write(f"{label} {i}/{total} {time.perf_counter() - start:6.1f}s {what}\n")
            out.flush()
            return
        filled = width * i // max(total, 1)
        bar = "#" * filled + "." * (width - filled)
        out.write(f"\r{label} [{bar}] {i}/{total} {time.perf_counter() - start:6.1f}s {what[:40]:<40}")
        out.flush()

    for i, item in enumerate(items):
        draw(i, describe(item))
        yield item
    draw(total, "done")
    if enabled and tty:
        out.write("\n")
        out.flush()
