"""The driver's progress line within an epoch, from rank 0's ``Progress`` events.

On a terminal it is one live line, redrawn in place and wiped before any other line is printed; in a
batch log (not a terminal) it is a plain line every ``RAYTRAIN_PROGRESS_EVERY`` seconds, so that a log
shows a long epoch moving without filling up. Ray's own progress output never goes through here.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from raytrain.contracts import env
from raytrain.service.events import Progress

_WIPE = "\r\033[K"


def progress_every() -> float:
    """``RAYTRAIN_PROGRESS_EVERY``, checked: seconds between a log's progress lines."""
    return env.PROGRESS_EVERY.value()


def duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def line(p: Progress) -> str:
    """ "progress: epoch  3/10  step 40/100  ...": never taken for an epoch's own line by a reader of the log."""
    parts = []
    if p.epoch is not None:  # as wide as the epoch lines of reports: "epoch  3/80"
        width = len(str(p.epochs)) if p.epochs is not None else 0
        parts.append(f"epoch {p.epoch:>{width}}" + (f"/{p.epochs}" if p.epochs is not None else ""))
    parts.append(f"step {p.step}" + (f"/{p.steps}" if p.steps is not None else ""))
    if p.samples_per_s is not None:
        parts.append(f"{p.samples_per_s:,.0f} samples/s")
    epoch_left, run_left = p.eta_s()
    if epoch_left is not None:
        parts.append(f"ETA epoch {duration(epoch_left)}" + (f", run {duration(run_left)}" if run_left else ""))
    return "progress: " + "  ".join(parts)


class LiveProgress:
    """Shows Progress events; ``echo`` (wrapped) prints every other line of the driver."""

    def __init__(
        self,
        echo: Callable[[str], None],
        *,
        every_s: float,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._echo = echo
        self._stream = stream if stream is not None else sys.stdout
        self._tty = self._stream.isatty()
        self._every_s = every_s  # progress_every(), checked before anything started
        self._clock = clock
        self._shown = False  # a live line is on the terminal
        self._printed = float("-inf")
        self._lock = threading.Lock()

    def echo(self, text: str) -> None:
        with self._lock:
            self._wipe()
            self._echo(text)
            self._printed = self._clock()  # a report line counts as news: the next plain line waits

    def show(self, p: Progress) -> None:
        with self._lock:
            if self._tty:
                self._stream.write(_WIPE + line(p))
                self._stream.flush()
                self._shown = True
            elif self._clock() - self._printed >= self._every_s:
                self._echo(line(p))
                self._printed = self._clock()

    def close(self) -> None:
        with self._lock:
            self._wipe()

    def _wipe(self) -> None:
        if self._shown:
            self._stream.write(_WIPE)
            self._stream.flush()
            self._shown = False
