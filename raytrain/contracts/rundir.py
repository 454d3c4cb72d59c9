"""A run directory ``<storage>/<name>``: the files raytrain keeps there beside Ray Train's own.

Every process that trains, resumes, inspects or locks a run finds these by the names below.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

RUN_META = "raytrain_run.json"  # the experiment the run was started with (a resume must repeat it)
RESULT = "result.json"  # the last attempt's outcome: raytrain.contracts.result.RunResult
LOCK = "driver.lock"  # the driver that holds the run: raytrain.service.runlock.Holder
LOCK_CLAIM_PREFIX = "driver.lock.taken-"  # + a holder's nonce: who took the run over from that holder
MANIFEST = ".raytrain-manifest.json"  # in each checkpoint directory: Manifest
HISTORY = "history.jsonl"  # every report of every attempt, a JSON line each: HistoryEntry
CURVES = "curves.png"  # loss, accuracy and throughput by epoch, redrawn after each report
TENSORBOARD = "tensorboard"  # TensorBoard event files (a directory; one file per attempt)
SERVICE_DIRS = (TENSORBOARD,)  # the directories raytrain's service keeps in a run (never checkpoints)


@dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    """One line of ``history.jsonl``: rank 0's plain metrics of one report, and when it came."""

    at: float  # Unix time the driver received it
    attempt: float  # Unix time the attempt started (tells the attempts of a resumed run apart)
    metrics: dict[str, float | int | str | bool]

    def to_line(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_line(cls, line: str) -> HistoryEntry:
        raw = json.loads(line)
        return cls(at=float(raw["at"]), attempt=float(raw["attempt"]), metrics=dict(raw["metrics"]))


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Written into a checkpoint directory once Ray Train has registered it: what a complete copy holds,
    so that a checkpoint cut short, emptied or partly deleted is recognised, whatever wrote it."""

    files: dict[str, int]  # path relative to the checkpoint -> size in bytes
    metrics: dict[str, Any]  # rank 0's metrics of the report it came with
    reported_at: float  # when Ray Train registered it (orders the checkpoints of a run)

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Manifest:
        raw = json.loads(blob)
        return cls(
            files={str(k): int(v) for k, v in raw["files"].items()},
            metrics=dict(raw.get("metrics") or {}),
            reported_at=float(raw.get("reported_at", 0.0)),
        )
