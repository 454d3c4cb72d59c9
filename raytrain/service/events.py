"""The events of a run, from the Ray Train controller and the workers to the driver, and how a worker
posts one. A leaf: plain data, no Ray import at load, imported by both sides.

The controller's callback (``raytrain.service.reports``) posts a ``Report`` once all workers have
reported, and ``WorkersFailed`` on a failure; each worker posts ``WorkerStarted`` where it runs when it
starts (``raytrain.service.wrapper``) and ``EndedEarly`` when it stopped because the job ends soon; rank 0
posts its pace within an epoch as ``Progress`` (``raytrain.progress``, ``raytrain.service.telemetry``).
The driver collects them (``raytrain.service.reports.Reports``) into its lines and ``result.json``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from raytrain.contracts.result import Placement


@dataclass(frozen=True)
class Report:
    """One ``ray.train.report`` of every worker: their metrics, by rank, and the checkpoint, if any."""

    metrics: list[dict[str, Any]]
    checkpoint: str | None
    received_at: float = field(default_factory=time.time)

    @property
    def rank0(self) -> dict[str, Any]:
        return self.metrics[0] if self.metrics else {}


@dataclass(frozen=True)
class WorkerStarted:
    placement: Placement
    started_at: float
    world_size: int = 0  # the size of the worker group it started in


@dataclass(frozen=True)
class WorkersFailed:
    """One or more workers failed (Ray Train then restarts them all, or the run fails)."""

    at: float
    ranks: list[int]
    error: str
    fatal: bool = False  # a training function raised raytrain.Fatal: the run fails without retries
    too_few: bool = False  # elastic: the nodes left hold fewer than the least workers asked for


@dataclass(frozen=True)
class EndedEarly:
    """Training stopped before its end because the job ends soon (``raytrain.ending_soon()``)."""

    via: str
    abandoned_save: str | None = None  # why the last save did not make it before the job's end, if it did not
    not_whole: str | None = None  # the last save's checkpoint, registered with a rank's part missing


@dataclass(frozen=True)
class Progress:
    """Rank 0's pace in the epoch in progress."""

    step: int  # steps done in this epoch
    steps: int | None  # steps the epoch has, if known
    epoch: int | None  # the epoch in progress, counted from 1
    epochs: int | None
    samples_per_s: float | None  # the run's: rank 0's pace over the last second or so, times the world size
    # (ranks step together); None on an epoch's first step
    step_time_s: float | None
    at: float

    def eta_s(self) -> tuple[float | None, float | None]:
        """Seconds left in the epoch, and in the run (training steps only: validation is not counted)."""
        if self.step_time_s is None or self.steps is None:
            return None, None
        epoch_left = max(0, self.steps - self.step) * self.step_time_s
        if self.epoch is None or self.epochs is None:
            return epoch_left, None
        return epoch_left, epoch_left + max(0, self.epochs - self.epoch) * self.steps * self.step_time_s


def post(events: Any, item: object) -> None:
    """Put ``item`` on the driver's event queue (a ``ray.util.queue.Queue``)."""
    from ray.exceptions import RayError

    with contextlib.suppress(RayError):  # the driver's node is gone: training's outcome stands regardless
        events.put(item)
