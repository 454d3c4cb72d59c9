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
PART_PREFIX = ".raytrain-part-"  # + the rank + ".json", in a checkpoint directory: the Part that rank uploaded
OWN_FILE_PREFIX = ".raytrain-"  # raytrain's own files in a checkpoint directory (never part of the checkpoint)
HISTORY = "history.jsonl"  # every report of every attempt, a JSON line each: HistoryEntry
CURVES = "curves.png"  # loss, accuracy and throughput by epoch, redrawn after each report
TRACKING = "tracking.json"  # the run's MLflow run (--tracker): every attempt logs into it
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


def part_name(rank: int) -> str:
    return f"{PART_PREFIX}{rank:05d}.json"


@dataclass(frozen=True)
class FileSum:
    """One file of a checkpoint as it was written: its size and CRC32 (None: recorded by size only, as
    manifests of version 1 were)."""

    size: int
    crc32: int | None

    @classmethod
    def parse(cls, raw: Any) -> FileSum:
        if isinstance(raw, int):  # version 1: the size alone
            return cls(size=raw, crc32=None)
        crc = raw.get("crc32")
        return cls(size=int(raw["size"]), crc32=None if crc is None else int(crc))


def _plain(value: Any) -> Any:
    """A metric JSON cannot hold as it is: a NumPy or torch scalar as its number, anything else as text."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


def _sums(raw: dict[str, Any]) -> dict[str, FileSum]:
    return {str(k): FileSum.parse(v) for k, v in raw.items()}


@dataclass(frozen=True, kw_only=True)
class Part:
    """Written into a checkpoint directory by each rank that uploaded files into it, once its upload is
    done: those files as the rank wrote them, so that no process has to read a sharded checkpoint whole
    to record it."""

    rank: int
    files: dict[str, FileSum]  # path relative to the checkpoint -> size and CRC32
    world_size: int = 0
    report_index: int = 0  # the how-many-th report of the run it came with (Ray Train's count, from 1)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)  # the rank's metrics of that report
    written_at: float = 0.0  # Unix time its upload was done
    group: str = ""  # the worker group that made it (the parts of one checkpoint share it)
    # Every rank of the group writes part of this checkpoint (raytrain.save_sharded): it is whole only with
    # each one's part. False where the code chose which ranks report a checkpoint (one, a few, all).
    every_rank: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=_plain).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Part:
        raw = json.loads(blob)
        return cls(
            rank=int(raw["rank"]),
            files=_sums(raw["files"]),
            world_size=int(raw.get("world_size", 0)),
            report_index=int(raw.get("report_index", 0)),
            metrics=dict(raw.get("metrics") or {}),
            written_at=float(raw.get("written_at", 0.0)),
            group=str(raw.get("group", "")),
            every_rank=bool(raw.get("every_rank", False)),
        )


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Written into a checkpoint directory once Ray Train has registered it (every rank's upload done):
    every file a whole copy holds, with its size and CRC32, so that a checkpoint cut short, emptied, partly
    deleted or overwritten in place is recognised, whatever wrote it and however many ranks did."""

    files: dict[str, FileSum]  # path relative to the checkpoint -> size and CRC32
    metrics: dict[str, Any]  # rank 0's metrics of the report it came with
    reported_at: float  # when Ray Train registered it (orders the checkpoints of a run)
    recovered: bool = False  # registered by raytrain: every rank saved it, and Ray Train never collected it
    # The worker groups whose ranks' parts it was made from: a part of another group in the directory is a
    # later upload under the same name, which this manifest does not describe. Empty: no parts (or older).
    groups: list[str] = dataclasses.field(default_factory=list)
    version: int = 2

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Manifest:
        raw = json.loads(blob)
        return cls(
            files=_sums(raw["files"]),
            metrics=dict(raw.get("metrics") or {}),
            reported_at=float(raw.get("reported_at", 0.0)),
            recovered=bool(raw.get("recovered", False)),
            groups=[str(g) for g in raw.get("groups") or []],
            version=int(raw.get("version", 1)),
        )
