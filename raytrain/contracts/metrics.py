"""The metric keys raytrain's service reads from any training function's reports.

A training function reports whatever it likes with ``ray.train.report``; every report becomes a line on
the driver's terminal and an entry of ``result.json``'s history. These optional keys mean something to
the service itself. The built-in recipe's own keys are in ``raytrain.recipe.metrics``.
"""

from __future__ import annotations

from typing import Any, TypedDict

EPOCH = "epoch"  # int: the epoch the report is about (the line is then headed "epoch N")
EPOCHS = "epochs"  # int: the epochs the run will train (the line is then headed "epoch N/M")
STARTUP = "startup"  # first report of an attempt: Startup, for "first training step after ..." timings
RESUMED = "resumed"  # first report of an attempt: what it resumed from ({"checkpoint": path, ...})


class Startup(TypedDict):
    """Unix times, taken on rank 0."""

    first_batch_at: float | None
    first_step_at: float | None


def scalars(metrics: dict[str, Any]) -> dict[str, float | int | str | bool]:
    """The plain values of a report, the ones a terminal line or a history table can show."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | str | bool) and k not in (EPOCH, EPOCHS)}
