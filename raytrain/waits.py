"""Waiting for something to happen: the one poll loop of the package (and of its tests), with an end.

A wait looks again at a steady pace instead of sleeping a fixed time, and ends either with what it waited
for or at its deadline; ``timeout_s=None`` is for a wait whose check itself ends it (a job that ended, a
step that exited), never for one that could hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(check: Callable[[], T | None], *, timeout_s: float | None, every_s: float) -> T | None:
    """Call ``check`` every ``every_s`` seconds until it returns something true, and return that; or return
    None once ``timeout_s`` has passed (checked once more at the deadline)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if found := check():
            return found
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(every_s, left))
        else:
            time.sleep(every_s)


def forever(check: Callable[[], T | None], *, every_s: float) -> T:
    """``until`` for a check that ends the wait itself (it returns, or raises, when what it watches ends)."""
    found = until(check, timeout_s=None, every_s=every_s)
    assert found is not None
    return found
