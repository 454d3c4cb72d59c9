"""The run configuration: one frozen tree, built once at the CLI edge and passed down unchanged.

The driver fills in the fields marked *resolved* (worker count, image size, class count) from the cluster
and the data before training starts, with :func:`dataclasses.replace`, so every worker and every checkpoint
sees the same fully resolved values. Nothing below the CLI reads flags or the environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from raytrain.errors import UserError

Device = Literal["auto", "gpu", "cpu"]

# The embedded dataset is named by this pseudo-URI in configs, run metadata and fingerprints.
EMBEDDED_DATA = "embedded:digits"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the examples come from and how they are turned into tensors.

    uri: Parquet file, directory or pyarrow filesystem URI; ``embedded:digits`` for the built-in data.
    image_size: side of the square the images are resized to (*resolved*: the data's own hint, else 224).
    val_fraction: share of examples held out for validation when the data has no ``val/`` split.
    num_classes: number of labels (*resolved* from the data).
    synthetic: train on one pre-built batch (as many steps as the data would give): the model's speed
        without an input pipeline, for benchmarks. Validation still uses the data.
    """

    uri: str = EMBEDDED_DATA
    image_size: int | None = None
    val_fraction: float = 0.2
    num_classes: int | None = None
    synthetic: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"--val-fraction {self.val_fraction} is out of range: use a value in (0, 1)")
        if self.image_size is not None and not 4 <= self.image_size <= 4096:
            raise UserError(f"--image-size {self.image_size} is out of range: use 4..4096 pixels")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """name: a torchvision classification model (``resnet18``) or ``package.module:factory``."""

    name: str = "resnet18"


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """SGD with Nesterov momentum and a per-epoch cosine schedule; batch_size is per worker."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    amp: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise UserError(f"--epochs {self.epochs} is below 1: train at least one epoch")
        if self.batch_size < 1:
            raise UserError(f"--batch-size {self.batch_size} is below 1: use a positive per-worker batch")
        if not self.lr > 0:
            raise UserError(f"--lr {self.lr} must be positive")


@dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    """How many workers, on what, and how long collectives may block before failing.

    workers: number of training workers (*resolved*: every GPU of the cluster, else one CPU worker per node).
    device: ``gpu`` (one GPU per worker, NCCL), ``cpu`` (gloo) or ``auto`` (gpu when the cluster has GPUs).
    cpus_per_worker: CPUs reserved per worker (*resolved*); the rest of each node is left to Ray Data.
    pg_timeout_s: torch.distributed process-group timeout (Ray's default is 1800 s).
    """

    workers: int | None = None
    device: Device = "auto"
    cpus_per_worker: float | None = None
    pg_timeout_s: int = 300

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise UserError(f"--workers {self.workers} is below 1: ask for at least one worker")
        if self.cpus_per_worker is not None and not self.cpus_per_worker > 0:
            raise UserError(f"--cpus-per-worker {self.cpus_per_worker} must be positive")
        if self.pg_timeout_s < 10:
            raise UserError(f"--pg-timeout {self.pg_timeout_s} s is too short: use at least 10 s")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """storage: checkpoint root on shared storage; name: run directory under it; keep: checkpoints kept."""

    storage: str
    name: str
    fresh: bool = False
    keep: int = 3

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise UserError(f"--name {self.name!r} is not a usable run name: use letters, digits, '-' or '_'")
        if self.keep < 1:
            raise UserError(f"--keep {self.keep} is below 1: keep at least the latest checkpoint")


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """Everything one ``raytrain fit`` needs."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    run: RunConfig
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FitConfig:
        return cls(
            data=DataConfig(**raw["data"]),
            model=ModelConfig(**raw["model"]),
            optim=OptimConfig(**raw["optim"]),
            scale=ScaleConfig(**raw["scale"]),
            run=RunConfig(**raw["run"]),
            dry_run=bool(raw.get("dry_run", False)),
        )

    def experiment(self) -> dict[str, Any]:
        """The settings that define the experiment: a run may only be resumed with these unchanged.

        Epochs (a run may be extended), the worker count and device (a requeued job may land on a
        different allocation), storage, name and checkpoint retention may change between attempts.
        """
        return {
            "data": self.data.uri,
            "image_size": self.data.image_size,
            "val_fraction": self.data.val_fraction,
            "synthetic": self.data.synthetic,
            "model": self.model.name,
            "batch_size": self.optim.batch_size,
            "lr": self.optim.lr,
            "momentum": self.optim.momentum,
            "weight_decay": self.optim.weight_decay,
            "amp": self.optim.amp,
            "seed": self.optim.seed,
        }

    def fingerprint(self) -> str:
        blob = json.dumps(self.experiment(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
