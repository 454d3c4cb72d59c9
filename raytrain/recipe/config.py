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
from raytrain.recipe.data.augment import DEFAULT as DEFAULT_AUGMENT
from raytrain.recipe.data.augment import Augment

# The embedded dataset is named by this pseudo-URI in configs, run metadata and fingerprints.
EMBEDDED_DATA = "embedded:digits"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the examples come from and how they are turned into tensors.

    uri: Parquet file, directory or pyarrow filesystem URI; ``embedded:digits`` for the built-in data.
    image_column, label_column: the columns holding the encoded images and the labels.
    image_size: side of the square the images are resized to (*resolved*: the data's own, else 224).
    val_fraction: share of examples held out for validation when the data has no validation split.
    num_classes: number of labels (*resolved* from the data).
    classes: the class names, by class id, when the data names them (*resolved*).
    augment: the training augmentation preset, crop-flip, flip or none (*resolved*: the data's hint, else
        crop-flip); auto_augment: an automatic policy on top; random_erase: RandomErasing's probability.
    synthetic: train on one pre-built batch (as many steps as the data would give): the model's speed
        without an input pipeline, for benchmarks. Validation still uses the data.
    """

    uri: str = EMBEDDED_DATA
    image_column: str = "image"
    label_column: str = "label"
    image_size: int | None = None
    val_fraction: float = 0.2
    num_classes: int | None = None
    classes: tuple[str, ...] | None = None
    augment: str | None = None
    auto_augment: str | None = None
    random_erase: float = 0.0
    synthetic: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"--val-fraction {self.val_fraction} is out of range: use a value in (0, 1)")
        if self.image_size is not None and not 4 <= self.image_size <= 4096:
            raise UserError(f"--image-size {self.image_size} is out of range: use 4..4096 pixels")
        if self.classes is not None and not isinstance(self.classes, tuple):
            object.__setattr__(self, "classes", tuple(self.classes))  # from JSON
        self.augmentation()  # checks the choices

    def augmentation(self) -> Augment:
        return Augment(preset=self.augment or DEFAULT_AUGMENT, auto=self.auto_augment, erase=self.random_erase)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """name: a torchvision classification model (``resnet18``) or ``package.module:factory``.

    weights: start from these instead of from scratch: a torchvision weight name (``DEFAULT``,
        ``IMAGENET1K_V1``, ``ResNet18_Weights.IMAGENET1K_V1``), a state dict file, or a raytrain checkpoint
        or run directory; tensors whose shape differs (the classifier head, for another class count) start
        afresh. freeze_backbone: train only the head. backbone_lr_scale: the backbone's learning rate as a
        share of --lr.
    """

    name: str = "resnet18"
    weights: str | None = None
    freeze_backbone: bool = False
    backbone_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.backbone_lr_scale <= 1.0:
            raise UserError(f"--backbone-lr-scale {self.backbone_lr_scale} is out of range: use a share in [0, 1]")
        if (self.freeze_backbone or self.backbone_lr_scale != 1.0) and self.weights is None:
            raise UserError(
                "--freeze-backbone and --backbone-lr-scale fine-tune pretrained weights: give --weights as well"
            )


OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer (SGD with Nesterov momentum, or AdamW) and a per-epoch schedule: linear warm-up from
    1% of --lr over warmup_epochs, then cosine decay. batch_size is per worker; accumulate steps make one
    optimizer step; ema_decay keeps an exponential moving average of the weights, validated and saved too."""

    epochs: int = 10
    batch_size: int = 64
    optimizer: str = "sgd"
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: int = 0
    label_smoothing: float = 0.0
    clip_grad_norm: float | None = None
    accumulate: int = 1
    ema_decay: float | None = None
    compile: bool = False
    amp: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise UserError(f"--epochs {self.epochs} is below 1: train at least one epoch")
        if self.batch_size < 1:
            raise UserError(f"--batch-size {self.batch_size} is below 1: use a positive per-worker batch")
        if not self.lr > 0:
            raise UserError(f"--lr {self.lr} must be positive")
        if self.seed < 0:  # numpy's generators, which deal and order the data, take none below 0
            raise UserError(f"--seed {self.seed} is negative: give a seed of 0 or more")
        if not 0.0 <= self.momentum < 1.0:
            raise UserError(f"--momentum {self.momentum} is out of range: use a value in [0, 1)")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if not 0 <= self.warmup_epochs < self.epochs:
            raise UserError(f"--warmup-epochs {self.warmup_epochs} must be at least 0 and below --epochs {self.epochs}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"--label-smoothing {self.label_smoothing} is out of range: use a value in [0, 1)")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise UserError(f"--clip-grad-norm {self.clip_grad_norm} must be positive (leave it out for no clipping)")
        if self.accumulate < 1:
            raise UserError(f"--accumulate {self.accumulate} is below 1: give the batches per optimizer step")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise UserError(f"--ema-decay {self.ema_decay} is out of range: use a value in (0, 1), e.g. 0.999")


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
        data = {k: v for k, v in dataclasses.asdict(self.data).items() if k != "uri"}
        model = {k: v for k, v in dataclasses.asdict(self.model).items() if k != "name"}
        optim = {k: v for k, v in dataclasses.asdict(self.optim).items() if k != "epochs"}
        return {"data": self.data.uri, "model": self.model.name, **data, **model, **optim}
