"""The training progress display: tqdm's bar on a terminal, plain rate-limited lines otherwise.

A progress bar redraws itself with carriage returns several times a second; written to a file
(a job's redirected log, a CI console) every redraw stays, so an hour of training leaves tens of
thousands of bar fragments on one line. When the output is not a terminal, ``LineProgress``
writes one ordinary line (step, percentage, the bar's figures) at most every ``every_s`` seconds,
and always the last step; ``write`` lines (checkpoint saves) go through unchanged, to standard
output as tqdm's ``write`` sends them.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

EVERY_S = 10.0
"""Seconds between two progress lines in a log."""


class LineProgress:
    """The part of tqdm's interface the training loop uses, as rate-limited lines."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", disable: bool = False,
                 stream: TextIO | None = None, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic,
                 out: TextIO | None = None):
        self.total, self.n, self.desc, self.disable = total, initial, desc, disable
        self.stream, self.every_s, self.clock = stream or sys.stderr, every_s, clock
        self.out = out  # None: sys.stdout at each write (as tqdm.write), so redirections apply
        self.postfix: dict[str, str] = {}
        self._last = clock()
        self._printed = initial

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self._last >= self.every_s or self.n >= self.total:
            self._line()
            self._last = now

    def _line(self) -> None:
        if self.disable or self._printed == self.n:
            return
        figures = ", ".join(f"{k} {v}" for k, v in self.postfix.items())
        pct = 100.0 * self.n / self.total if self.total else 100.0
        self.stream.write(f"{self.desc} step {self.n}/{self.total} ({pct:.0f}%)" + (f": {figures}" if figures else "")
                          + "\n")
        self.stream.flush()
        self._printed = self.n

    def write(self, text: str) -> None:
        if not self.disable:
            out = self.out or sys.stdout
            out.write(text + "\n")
            out.flush()

    def close(self) -> None:
        self._line()


def progress(total: int, initial: int, desc: str, disable: bool, stream: TextIO | None = None):
    """tqdm's bar when ``stream`` (default stderr) is a terminal, else ``LineProgress``."""
    stream = stream or sys.stderr
    if stream.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, disable=disable, dynamic_ncols=True, file=stream)
    return LineProgress(total, initial, desc, disable, stream)
