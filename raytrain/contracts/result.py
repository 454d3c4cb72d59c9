"""``result.json``: what a run did, written into its run directory when an attempt ends.

One schema for every kind of run (the built-in recipe, a user's train function, a stock script on a
raytrain cluster); fields a kind cannot know are null. Readers should check ``schema``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

SCHEMA = 1
Status = Literal["completed", "preempted", "cancelled", "lost", "failed"]
Kind = Literal["fit", "train-func", "script"]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one rank ran."""

    rank: int
    hostname: str
    ip: str
    device: str


@dataclass(frozen=True, kw_only=True)
class Restart:
    """Workers failed during the attempt and Ray Train restarted them from the newest checkpoint.

    at_s: seconds after the attempt started; lost_s: training since the checkpoint it went back to (done
    again); restart_s: until the workers ran again (null: they did not, the run failed)."""

    at_s: float
    ranks: list[int]
    error: str
    resumed_from: str | None
    lost_s: float | None
    restart_s: float | None


@dataclass(frozen=True, kw_only=True)
class Resize:
    """An elastic run grew (a node came back): Ray Train restarted the workers, more of them, from the
    newest checkpoint. at_s: seconds after the attempt started, when the new workers started; cost_s: from
    that checkpoint to then (training done again, plus the restart)."""

    at_s: float
    workers: int
    were: int
    resumed_from: str | None
    cost_s: float | None


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One attempt of a run, and where the run stands after it.

    status: completed; preempted (stopped early with a checkpoint because the job ends soon: it
    resumes); lost (workers or nodes failed more often than ``max_failures`` allows: the job requeues and
    the next attempt resumes); failed (an error in the training itself; ``error`` says which).
    history: rank 0's metrics of every report of this attempt;
    final: the last of them. epochs_completed / epochs: progress when the reports carry an epoch.
    """

    schema: int = SCHEMA
    name: str
    kind: Kind
    status: Status
    error: str | None = None
    # Why it ended early: "ray-drain" or "flag-file" (the job ends), "yield" (to a run of higher priority; it
    # resumed after) when preempted; "cancel" when cancelled (raytrain cancel)
    preempted_via: str | None = None
    epochs_completed: int | None = None
    epochs: int | None = None
    epochs_this_attempt: int = 0  # reports of this attempt that carried an epoch
    reports_this_attempt: int = 0
    world_size: int
    backend: str
    placement: list[Placement] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    last_checkpoint: str | None = None
    best_checkpoint: str | None = None  # a workload's best so far, kept apart (the recipe: by val_acc)
    resumed_from: dict[str, Any] | None = None
    wall_time_s: float = 0.0
    # worker, first_batch, first_step: seconds after the batch job started, else after the command's process
    # started (raytrain fit), else after raytrain.train was called
    startup_s: dict[str, float] | None = None
    restarts: list[Restart] = field(default_factory=list)
    resizes: list[Resize] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RunResult:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        values["placement"] = [Placement(**p) for p in raw.get("placement", [])]
        values["restarts"] = [Restart(**r) for r in raw.get("restarts", [])]
        values["resizes"] = [Resize(**r) for r in raw.get("resizes", [])]
        return cls(**values)


# The driver's exit status for each outcome. The batch script requeues on EXIT_PREEMPTED (EX_TEMPFAIL: the
# job ends soon) and EXIT_LOST (the cluster failed under the run: a node's Ray died, or worker failures ran
# past --max-failures), so that the next attempt resumes from the newest checkpoint.
# A run ended by raytrain cancel exits EXIT_CANCELLED (128 + SIGTERM: ended on request), and is not requeued.
EXIT_OK, EXIT_FAILED, EXIT_PREEMPTED, EXIT_LOST, EXIT_CANCELLED = 0, 1, 75, 76, 143
EXIT_STATUS: dict[Status, int] = {
    "completed": EXIT_OK,
    "failed": EXIT_FAILED,
    "preempted": EXIT_PREEMPTED,
    "cancelled": EXIT_CANCELLED,
    "lost": EXIT_LOST,
}
