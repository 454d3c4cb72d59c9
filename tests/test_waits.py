"""The one poll loop: it ends with what it waited for, or at its deadline, never later."""

from __future__ import annotations

import itertools
import time

from raytrain import waits


def test_a_wait_returns_the_first_true_answer() -> None:
    answers = iter([None, False, 0, [], [3], 7])
    assert waits.until(lambda: next(answers), timeout_s=5, every_s=0.001) == [3]
    calls = itertools.count()
    assert waits.forever(lambda: "done" if next(calls) == 3 else None, every_s=0.001) == "done"


def test_a_wait_ends_at_its_deadline_after_a_last_look() -> None:
    looks: list[float] = []
    started = time.monotonic()
    assert waits.until(lambda: looks.append(time.monotonic()), timeout_s=0.3, every_s=0.1) is None
    took = time.monotonic() - started
    assert 0.3 <= took < 1.0, took
    assert looks[-1] - started >= 0.3 - 0.01  # looked once more at the deadline
    assert 3 <= len(looks) <= 6, looks
