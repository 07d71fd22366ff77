"""Progress of long runs (``foscar bench``, ``foscar tune``): one bar line per finished step on stderr,
readable in a terminal and in a log file alike (no carriage returns, no dependency)."""
from __future__ import annotations

import sys
import time


class Progress:
    """``step(what)`` after each of ``total`` steps prints ``[#####-----] 3/10 12 s: what``: the elapsed
    time and, until the last step, the estimated time left."""

    def __init__(self, total: int, width: int = 24, stream=None):
        self.total, self.width, self.done = max(total, 1), width, 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()

    def bar(self) -> str:
        filled = round(self.width * self.done / self.total)
        return f"[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total}"

    def step(self, what: str = "") -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        eta = f", ~{left:.0f} s left" if self.done < self.total else ""
        print(f"{self.bar()} {elapsed:.0f} s{eta}" + (f": {what}" if what else ""), file=self.stream, flush=True)
