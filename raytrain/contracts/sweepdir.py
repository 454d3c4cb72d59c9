"""A sweep directory ``<storage>/<sweep name>``: what ``raytrain sweep`` keeps there.

The sweep's driver writes the meta file once and the trial table after every trial event; each trial is
a raytrain run of its own under ``runs/`` (run directory, checkpoints, ``result.json``, curves), and Ray
Tune keeps its experiment state (what a resumed sweep restores) under ``tune/``. ``raytrain report``,
``evaluate``, ``predict`` and ``export`` read the sweep through these names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

SWEEP_META = "raytrain_sweep.json"  # the sweep as started: SweepMeta (a resumed sweep must repeat it)
TRIALS = "trials.json"  # every trial so far: a list of TrialRecord
RUNS = "runs"  # the trials' run directories
TUNE = "tune"  # Ray Tune's experiment directory
CURVES = "sweep.png"  # the metric of the best trials by epoch, drawn by `raytrain report`
REPLAYED = "raytrain_replayed"  # in a report a trial replays to Tune from its run's history (True)

TrialStatus = Literal["pending", "running", "completed", "stopped", "preempted", "failed"]
ENDED: tuple[TrialStatus, ...] = ("completed", "stopped", "failed")  # a resumed sweep does not run these again


def trial_name(index: int) -> str:
    """The run name of the sweep's trial number INDEX (Ray Tune's, from 0)."""
    return f"trial_{index:05d}"


@dataclass(frozen=True, kw_only=True)
class SweepMeta:
    """What defines a sweep: its space, what it optimises, and the experiment every trial starts from."""

    name: str
    space: list[str]  # each parameter as NAME=KIND:ARGS
    metric: str
    mode: Literal["max", "min"]
    trials: int  # samples Ray Tune draws (each grid pass counted once)
    scheduler: str
    experiment: dict[str, Any]  # the base workload's, less the swept parameters
    fingerprint: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SweepMeta:
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls)})


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One trial as the sweep's driver last saw it."""

    name: str  # its run name under RUNS
    trial_id: str  # Ray Tune's
    params: dict[str, Any]
    status: TrialStatus
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TrialRecord:
        return cls(
            name=str(raw["name"]),
            trial_id=str(raw["trial_id"]),
            params=dict(raw["params"]),
            status=raw["status"],
            error=raw.get("error"),
        )
