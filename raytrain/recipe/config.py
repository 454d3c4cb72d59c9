"""The recipe's configuration: one frozen tree, built once at the CLI edge and passed down unchanged.

The driver fills in the fields marked *resolved* (worker count, image size, class count) from the cluster
and the data before training starts, with :func:`dataclasses.replace`, so every worker and every checkpoint
sees the same fully resolved values. Nothing below the CLI reads flags or the environment. How the run
scales and where it lives are the service's (``raytrain.ScaleConfig``, ``raytrain.RunConfig``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from raytrain.errors import UserError

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
class FitConfig:
    """What the recipe trains: data, model and optimisation."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FitConfig:
        return cls(
            data=DataConfig(**raw["data"]),
            model=ModelConfig(**raw["model"]),
            optim=OptimConfig(**raw["optim"]),
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
