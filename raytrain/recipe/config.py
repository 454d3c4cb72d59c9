"""The recipe's configuration: one frozen tree, built once at the CLI edge and passed down unchanged.

The driver fills in the fields marked *resolved* (worker count, image size, class count) from the cluster
and the data before training starts, with :func:`dataclasses.replace`, so every worker and every checkpoint
sees the same fully resolved values. Nothing below the CLI reads flags or the environment. How the run
scales and where it lives are the service's (``raytrain.ScaleConfig``, ``raytrain.RunConfig``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from raytrain.errors import UserError
from raytrain.recipe.data.augment import AUTO_POLICIES, PRESETS, Augment
from raytrain.recipe.data.augment import DEFAULT as DEFAULT_AUGMENT
from raytrain.recipe.data.idle import AUTO, PRIORITIES

if TYPE_CHECKING:
    from raytrain.recipe.data.memory import Spec

# The embedded dataset is named by this pseudo-URI in configs, run metadata and fingerprints.
EMBEDDED_DATA = "embedded:digits"


@dataclass(frozen=True)
class Flag:
    """How a config field is set on ``raytrain fit``'s command line. The field's type and default are the
    option's; the dataclass's ``__post_init__`` validates the value (``choices`` for every field here)."""

    help: str = ""
    flag: str | None = None  # default: --<field name, dashed>
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negatable: bool = False  # --x/--no-x rather than a bare --x


def option(default: Any, help: str = "", **how: Any) -> Any:
    """A config field that is also an option of ``raytrain fit``: this is the one place it is defined."""
    return field(default=default, metadata={"cli": Flag(help, **how)})


def _check_choices(section: object) -> None:
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        how, value = f.metadata.get("cli"), getattr(section, f.name)
        if how is not None and how.choices is not None and value is not None and value not in how.choices:
            raise UserError(f"{_flag(f.name, how)} {value!r} is not one of {', '.join(how.choices)}")


def _flag(name: str, how: Flag) -> str:
    return how.flag or "--" + name.replace("_", "-")


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
    stream: stream the data through Ray Data every epoch even when the ranks could hold it decoded (as
        data larger than their memory always does).
    decode_priority: how streamed decoding shares a node's CPUs with training: idle (Linux's SCHED_IDLE:
        decoding gives way to any thread that wants its core, ``recipe.data.idle``), normal, or auto (idle
        for ranks on CPUs on Linux, normal for ranks on GPUs or off Linux).
    """

    uri: str = EMBEDDED_DATA
    image_column: str = option("image", "The column of encoded images.")
    label_column: str = option("label", "The column of class ids or names.")
    image_size: int | None = option(None, "Resize images to this square. Default: the data's.")
    val_fraction: float = option(0.2, "Held-out share when the data has no val/ split.")
    num_classes: int | None = None
    classes: tuple[str, ...] | None = None
    augment: str | None = option(
        None,
        "Training augmentation: random resized crop + horizontal flip, flip only, or none. Default: what the "
        "data's metadata asks for, else crop-flip.",
        choices=PRESETS,
    )
    auto_augment: str | None = option(
        None,
        "An automatic augmentation policy on top (as the reference trainer's --auto-augment).",
        choices=AUTO_POLICIES,
    )
    random_erase: float = option(0.0, "RandomErasing's probability.")
    synthetic: bool = option(
        False,
        "Train on one pre-built batch (the model's speed without input; for benchmarks).",
        flag="--synthetic-data",
    )
    stream: bool = option(
        False,
        "Stream the data through Ray Data every epoch, even when the ranks could hold it (as larger data does).",
    )
    decode_priority: str = option(
        AUTO,
        "How streamed decoding shares the CPUs: idle gives way to training whenever it wants a CPU (Linux's "
        "SCHED_IDLE) and takes the rest; normal shares them as Linux does; auto is idle for ranks on CPUs and "
        "normal for ranks on GPUs (and off Linux, which has no SCHED_IDLE).",
        choices=PRIORITIES,
    )

    def __post_init__(self) -> None:
        _check_choices(self)
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

    name: str = option(
        "resnet18",
        "torchvision classification model, or your factory(num_classes=K) -> nn.Module.",
        flag="--model",
        metavar="NAME|MODULE:FACTORY",
    )
    weights: str | None = option(
        None,
        "Fine-tune from these: a torchvision weight name (DEFAULT, IMAGENET1K_V1, ResNet50_Weights.IMAGENET1K_V2; "
        "from the local torch cache), a state dict file, or a raytrain checkpoint or run. The head is new for the "
        "data's classes. Default: from scratch.",
        metavar="NAME|PATH",
    )
    freeze_backbone: bool = option(False, "With --weights: train only the classifier head.")
    backbone_lr_scale: float = option(1.0, "With --weights: the backbone's lr / --lr.")
    strategy: str = option(
        "ddp",
        "ddp: a whole model on every worker; fsdp: parameters, gradients, optimizer state and checkpoints "
        "sharded over the workers (FSDP2, per block; bf16 on GPU), for a model too large for one GPU.",
        choices=("ddp", "fsdp"),
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if not 0.0 <= self.backbone_lr_scale <= 1.0:
            raise UserError(f"--backbone-lr-scale {self.backbone_lr_scale} is out of range: use a share in [0, 1]")
        if (self.freeze_backbone or self.backbone_lr_scale != 1.0) and self.weights is None:
            raise UserError(
                "--freeze-backbone and --backbone-lr-scale fine-tune pretrained weights: give --weights as well"
            )


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer (SGD with Nesterov momentum, or AdamW) and a per-epoch schedule: linear warm-up from
    1% of --lr over warmup_epochs, then cosine decay. batch_size is per worker; accumulate steps make one
    optimizer step; ema_decay keeps an exponential moving average of the weights, validated and saved too."""

    epochs: int = option(10)
    batch_size: int = option(64, "Per worker.")
    optimizer: str = option("sgd", choices=("sgd", "adamw"))
    lr: float = option(0.02, "Peak learning rate (warm-up, cosine decay).")
    momentum: float = option(0.9, "SGD's (Nesterov) momentum.")
    weight_decay: float = option(5e-4)
    warmup_epochs: int = option(0, "Linear lr warm-up from 1%.")
    label_smoothing: float = option(0.0)
    clip_grad_norm: float | None = option(None, "Clip the gradients' total norm to this.")
    accumulate: int = option(1, "Batches per optimizer step.")
    ema_decay: float | None = option(None, "Keep and validate a moving average of the weights.")
    compile: bool = option(False, "torch.compile the model (fails clearly where the machine cannot).")
    amp: bool = option(True, "bf16 autocast on GPU (no effect on CPU).", negatable=True)
    seed: int = option(0)

    def __post_init__(self) -> None:
        _check_choices(self)
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

    def __post_init__(self) -> None:
        if self.model.strategy == "fsdp":
            for flag, given in (("--ema-decay", self.optim.ema_decay is not None), ("--compile", self.optim.compile)):
                if given:
                    raise UserError(f"{flag} does not go with --strategy fsdp yet: leave it out, or use --strategy ddp")

    @property
    def sharded(self) -> bool:
        """Whether the model, and its checkpoints, are sharded over the ranks (``--strategy fsdp``)."""
        return self.model.strategy == "fsdp"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_options(cls, values: Mapping[str, Any], data: str) -> FitConfig:
        """The config of ``raytrain fit``'s options (``values`` by :attr:`RecipeOption.param`) on ``data``."""
        given = {section: {o.field: values[o.param] for o in OPTIONS if o.section is section} for section in SECTIONS}
        return cls(
            data=DataConfig(uri=data, **given[DataConfig]),
            model=ModelConfig(**given[ModelConfig]),
            optim=OptimConfig(**given[OptimConfig]),
        )

    def with_options(self, changes: Mapping[str, Any]) -> FitConfig:
        """This config with some of ``raytrain fit``'s options (by :attr:`RecipeOption.param`) set to other
        values, each taken as the option's type and checked as the option is: a sweep trial's config."""
        sections = {DataConfig: self.data, ModelConfig: self.model, OptimConfig: self.optim}
        values = {o.param: getattr(sections[o.section], o.field) for o in OPTIONS}
        by_param = {o.param: o for o in OPTIONS}
        for name, value in changes.items():
            values[name] = by_param[name].typed(value)
        return FitConfig.from_options(values, self.data.uri)

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
        different allocation), storage, name, checkpoint retention and how the data reaches the ranks
        (``--stream``, ``--decode-priority``) may change between attempts.
        """
        data = {k: v for k, v in dataclasses.asdict(self.data).items() if k not in ("uri", "stream", "decode_priority")}
        # The strategy decides the checkpoints' format: a run resumes with the one it started with (ddp, the
        # default, is left out, so that runs from before --strategy keep their fingerprint).
        model = {
            k: v
            for k, v in dataclasses.asdict(self.model).items()
            if k != "name" and not (k == "strategy" and v == "ddp")
        }
        optim = {k: v for k, v in dataclasses.asdict(self.optim).items() if k != "epochs"}
        return {"data": self.data.uri, "model": self.model.name, **data, **model, **optim}


@dataclass(frozen=True)
class ResumeAt:
    """Where an attempt resumes: the newest intact checkpoint the driver found, and whether it was taken
    mid-epoch with the ids of the rows that epoch had trained (the epoch then trains exactly the others)."""

    checkpoint: str
    rows_recorded: bool


@dataclass(frozen=True)
class LoopConfig:
    """What the driver hands every worker for one attempt: the resolved config and where things are.

    run_fs, run_dir: the run directory (a pyarrow filesystem and a path in it). resume: None on a fresh
    start. memory: the data the ranks hold themselves, or None when Ray Data streams it. data_threads: the
    threads a rank decodes and augments its share with. init_weights: --weights' tensors in Ray's object
    store (an ObjectRef) for a run that starts afresh, else None.
    """

    config: FitConfig
    run_fs: Any
    run_dir: str
    resume: ResumeAt | None
    memory: Spec | None
    data_threads: int
    steps_per_epoch: int
    init_weights: Any = None
    hold_val: bool = False  # streamed data: the ranks keep their first validation pass's rows and replay them


class RecipeOption(NamedTuple):
    """One field of the recipe's config as an option of ``raytrain fit``."""

    section: type
    field: str
    flag: str  # --lr
    param: str  # lr: click's name for it
    type: type  # int, float, str or bool (a bool is a flag)
    default: Any
    how: Flag

    def typed(self, value: Any) -> Any:
        """VALUE (a sweep's: from JSON, or drawn by Ray Tune) as this option's type, or a UserError."""
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if self.type is bool and isinstance(value, bool):
            return value
        if self.type is int and number and float(value).is_integer():
            return int(value)
        if self.type is float and number:
            return float(value)
        if self.type is str and not isinstance(value, bool | dict | list) and value is not None:
            return str(value)
        wanted = {bool: "true or false", int: "a whole number", float: "a number"}.get(self.type, "a name")
        raise UserError(f"{self.flag} takes {wanted}, not {value!r}")

    def sweepable_by(self, kind: str) -> str | None:
        """Why a sweep cannot draw this option's values with KIND (a ``raytrain.service.sweep_space``
        kind), or None when it can."""
        if self.type is int and kind in ("uniform", "loguniform"):
            return f"{self.flag} takes whole numbers: use int:LO:HI, choice or grid"
        if self.type in (bool, str) and kind not in ("choice", "grid"):
            return f"{self.flag} takes {'true or false' if self.type is bool else 'a name'}: use choice:A,B or grid:A,B"
        return None


SECTIONS: tuple[type, ...] = (ModelConfig, OptimConfig, DataConfig)  # in the order fit -h lists them


def _options() -> tuple[RecipeOption, ...]:
    found = []
    for section in SECTIONS:
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            how = f.metadata.get("cli")
            if how is None:
                continue
            kind = hints[f.name]
            if isinstance(kind, types.UnionType):  # X | None: an option that may be left out
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            flag = _flag(f.name, how)
            found.append(RecipeOption(section, f.name, flag, flag[2:].replace("-", "_"), kind, f.default, how))
    return tuple(found)


OPTIONS = _options()
