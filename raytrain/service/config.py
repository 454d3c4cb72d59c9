"""What the service needs to know about a run, whatever trains in it: how to scale it and where it lives.

Both are frozen and built once at the CLI edge (or by a user's own driver code); the driver fills in the
*resolved* fields from the cluster before any worker starts, with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from raytrain.errors import UserError

Device = Literal["auto", "gpu", "cpu"]
FILE_NAME_MAX = 255  # bytes in one file name, on every filesystem raytrain meets
TRACKERS = ("mlflow",)
NAME_MAX = FILE_NAME_MAX - len(".replaced-20261124T000000Z-0a1b")  # a run's name, and --fresh's suffix (runs.aside)


@dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    """How many workers, on what, and how long collectives may block before failing.

    workers: number of training workers (*resolved*: every GPU of the cluster, else one CPU worker per node);
        with ``min_workers``, the most.
    min_workers: elastic (``--workers MIN:MAX``): after a failure (a lost node) training goes on with as many
        workers as the nodes left hold, down to this many, and grows back when nodes return.
    device: ``gpu`` (one GPU per worker, NCCL), ``cpu`` (gloo) or ``auto`` (gpu when the cluster has GPUs).
    cpus_per_worker: CPUs reserved per worker (*resolved*); the rest of each node is left to Ray Data.
    pg_timeout_s: torch.distributed process-group timeout (Ray's default is 1800 s).
    pinned: each rank on the node the plan names; False: Ray places the workers where there is room (a
        sweep's trials, which share the cluster, each packed where the others left room).
    """

    workers: int | None = None
    min_workers: int | None = None
    device: Device = "auto"
    cpus_per_worker: float | None = None
    pg_timeout_s: int = 300
    pinned: bool = True

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise UserError(f"--workers {self.workers} is below 1: ask for at least one worker")
        if self.min_workers is not None and not (1 <= self.min_workers <= (self.workers or 0)):
            raise UserError(
                f"--workers {self.min_workers}:{self.workers} is not a range: give MIN:MAX with 1 <= MIN <= MAX"
            )
        if self.cpus_per_worker is not None and not self.cpus_per_worker > 0:
            raise UserError(f"--cpus-per-worker {self.cpus_per_worker} must be positive")
        if self.pg_timeout_s < 10:
            raise UserError(f"--pg-timeout {self.pg_timeout_s} s is too short: use at least 10 s")


@dataclass(frozen=True)
class Tracker:
    """Where a run's metrics go: ``mlflow`` at ``uri`` (None: ``MLFLOW_TRACKING_URI``, else a file store
    beside the runs, ``<storage>/mlruns``), in ``experiment`` (None: ``MLFLOW_EXPERIMENT_NAME``, else
    ``raytrain``)."""

    kind: Literal["mlflow"] = "mlflow"
    uri: str | None = None
    experiment: str | None = None

    @classmethod
    def parse(cls, text: str) -> Tracker:
        """``--tracker mlflow`` or ``mlflow=URI``."""
        kind, _, uri = text.partition("=")
        if kind not in TRACKERS:
            raise UserError(f"--tracker {text}: {kind!r} is not a tracker raytrain logs to: give mlflow or mlflow=URI")
        return cls(uri=uri or None)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """storage: checkpoint root on shared storage; name: run directory under it; keep: checkpoints kept;
    max_failures: worker failures (a process killed, a node lost, an error) Ray Train restarts the
    workers from the newest checkpoint after, before the run fails; share_group: a Unix group whose
    members may resume and read the run (without it, a run directory is its owner's alone, and one that
    is not yours, or that others may write, is refused); tracker: where its parameters, metrics and best
    checkpoint are logged too (``raytrain.service.tracking``)."""

    storage: str
    name: str
    fresh: bool = False
    keep: int = 3
    max_failures: int = 3
    share_group: str | None = None
    tracker: Tracker | None = None

    @property
    def group_id(self) -> int | None:
        """The gid of ``share_group`` (checked in ``__post_init__``), or None."""
        return grp.getgrnam(self.share_group).gr_gid if self.share_group else None

    def __post_init__(self) -> None:
        if self.max_failures < 0:
            raise UserError(f"--max-failures {self.max_failures} is below 0: use 0 to fail at the first error")
        if not self.name or "/" in self.name or "\0" in self.name or self.name.startswith("."):
            raise UserError(f"--name {self.name!r} is not a usable run name: use letters, digits, '-' or '_'")
        if len(self.name.encode()) > NAME_MAX:
            raise UserError(
                f"--name is {len(self.name.encode())} bytes long, more than the {NAME_MAX} a run name may have (a "
                f"file name's {FILE_NAME_MAX}, less what --fresh adds when it moves the run aside): pick a shorter one"
            )
        if self.keep < 1:
            raise UserError(f"--keep {self.keep} is below 1: keep at least the latest checkpoint")
        if self.share_group is not None:
            try:
                gid = grp.getgrnam(self.share_group).gr_gid
            except KeyError:
                raise UserError(f"--share-group {self.share_group}: no such group (getent group lists them)") from None
            if gid not in os.getgroups() and gid != os.getgid():
                raise UserError(
                    f"--share-group {self.share_group}: you are not a member of it (id -Gn lists your groups)"
                )


def fingerprint(experiment: dict[str, Any]) -> str:
    """A short digest of the settings that define an experiment."""
    blob = json.dumps(experiment, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
