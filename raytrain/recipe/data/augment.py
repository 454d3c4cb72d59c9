"""Training-time augmentation, in the spirit of torchvision's reference classification trainer.

Training images get a random resized crop (scale 0.08-1 of the area, aspect 3/4-4/3) and a horizontal flip
(``crop-flip``, the reference's default), optionally an automatic policy (``--auto-augment``: the reference's
``ta_wide``, ``ra``, ``augmix``, or AutoAugment's ``imagenet``/``cifar10``/``svhn``) and random erasing.
Validation images are only resized (shorter side) and centre-cropped. It runs in Ray Data's CPU tasks,
beside training, on the decoded original when the data streams; on the decoded image in the rank's own
batch thread when the data is kept in memory (``raytrain.recipe.data.memory``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain.errors import UserError

if TYPE_CHECKING:
    from PIL import Image

PRESETS = ("crop-flip", "flip", "none")
DEFAULT = "crop-flip"
AUTO_POLICIES = ("ta_wide", "ra", "augmix", "imagenet", "cifar10", "svhn")


@dataclass(frozen=True)
class Augment:
    """preset: crop-flip, flip or none; auto: one of ``AUTO_POLICIES`` or None; erase: RandomErasing's p."""

    preset: str = DEFAULT
    auto: str | None = None
    erase: float = 0.0

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise UserError(f"--augment {self.preset!r} is not one of {', '.join(PRESETS)}")
        if self.auto is not None and self.auto not in AUTO_POLICIES:
            raise UserError(f"--auto-augment {self.auto!r} is not one of {', '.join(AUTO_POLICIES)}")
        if not 0.0 <= self.erase <= 1.0:
            raise UserError(f"--random-erase {self.erase} is out of range: give a probability in [0, 1]")

    @property
    def active(self) -> bool:
        return self.preset != "none" or self.auto is not None or self.erase > 0


def _policy(name: str) -> Any:
    from torchvision.transforms import v2

    if name == "ta_wide":
        return v2.TrivialAugmentWide()
    if name == "ra":
        return v2.RandAugment()
    if name == "augmix":
        return v2.AugMix()
    return v2.AutoAugment(v2.AutoAugmentPolicy(name))


def transform(aug: Augment, size: int) -> Callable[[Any], Any]:
    """torchvision's training transform: a PIL image or a uint8 CHW tensor in, a uint8 CHW tensor of ``size``
    out. ``per_image`` uses it where an automatic policy or random erasing is asked for."""
    import torch
    from torchvision.transforms import v2

    ops: list[Any] = []
    if aug.preset == "crop-flip":
        ops.append(v2.RandomResizedCrop(size, antialias=True))
    else:
        ops += [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
    if aug.preset != "none":
        ops.append(v2.RandomHorizontalFlip())
    if aug.auto:
        ops.append(_policy(aug.auto))
    ops += [v2.PILToTensor(), v2.ToDtype(torch.uint8)]
    if aug.erase:
        ops.append(v2.RandomErasing(p=aug.erase))
    return v2.Compose(ops)  # type: ignore[no-any-return]


# RandomResizedCrop's defaults in torchvision's reference trainer: the crop's share of the area, its aspect.
_SCALE = (0.08, 1.0)
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))


def crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """A random resized crop's box (left, top, right, bottom), drawn as torchvision's
    ``RandomResizedCrop.get_params`` draws it: ten tries at a random share of the area and aspect, then
    the centre, its aspect clamped to 3/4-4/3."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*_SCALE)
        aspect = math.exp(rng.uniform(*_LOG_RATIO))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    w, h = width, height  # the centre, its aspect clamped to 3/4-4/3
    if width / height < 3 / 4:
        h = round(width * 4 / 3)
    elif width / height > 4 / 3:
        w = round(height * 4 / 3)
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def _pillow(aug: Augment, size: int, rng: np.random.Generator) -> Callable[[Image.Image], np.ndarray]:
    """The presets on Pillow alone: the crop and its resize in one ``resize(box=...)`` (bilinear, as
    torchvision resizes a PIL image), then the flip. No torch or torchvision in the data tasks: importing
    torchvision costs a new task process over 2 s of CPU, before its first batch."""
    from PIL import Image

    from raytrain.recipe.data.images import fit

    def shape(img: Image.Image) -> np.ndarray:
        if aug.preset == "crop-flip":
            img = img.resize((size, size), Image.Resampling.BILINEAR, box=crop_box(*img.size, rng))
        else:
            img = fit(img, size)
        if aug.preset != "none" and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.array(img, dtype=np.uint8)  # a writable copy, as torch.from_numpy wants

    return shape


def _reseed() -> None:
    """Each Ray Data task draws fresh randomness: torch's generator starts from one fixed seed in every new
    process, so without this every worker process would crop its images alike."""
    import torch

    torch.seed()


def per_image(aug: Augment, size: int, rng: np.random.Generator | None = None) -> Callable[[Image.Image], np.ndarray]:
    """The training transform of one decoded original (a PIL image), as a uint8[size, size, 3] array; one
    per task. The presets draw from ``rng`` (default: fresh entropy); an automatic policy or random
    erasing draws from torch's generator, which a task (no ``rng``) reseeds first and a training process
    (``rng`` given) leaves as its seed made it."""
    if not (aug.auto or aug.erase):
        return _pillow(aug, size, rng if rng is not None else np.random.default_rng())
    if rng is None:
        _reseed()
    fn = transform(aug, size)
    return lambda img: fn(img).permute(1, 2, 0).numpy()


def arrays(batch: np.ndarray, aug: Augment, size: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Augmented uint8[N, S, S, 3] images (already decoded and kept in memory) as uint8[N, size, size, 3]."""
    from PIL import Image

    fn = per_image(aug, size, rng)
    out = np.empty((len(batch), size, size, 3), dtype=np.uint8)
    for i, img in enumerate(batch):
        out[i] = fn(Image.fromarray(img))
    return out
