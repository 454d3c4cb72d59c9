"""Training-time augmentation, in the spirit of torchvision's reference classification trainer.

Training images get a random resized crop (scale 0.08-1 of the area, aspect 3/4-4/3) and a horizontal flip
(``crop-flip``, the reference's default), optionally an automatic policy (``--auto-augment``: the reference's
``ta_wide``, ``ra``, ``augmix``, or AutoAugment's ``imagenet``/``cifar10``/``svhn``) and random erasing.
Validation images are only resized (shorter side) and centre-cropped. It all runs in Ray Data's CPU tasks,
beside training: on the decoded original when the data streams, on the cached decoded image when it is
kept in memory.
"""

from __future__ import annotations

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
    """The training transform: a PIL image or a uint8 CHW tensor in, a uint8 CHW tensor of ``size`` out."""
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


def _reseed() -> None:
    """Each Ray Data task draws fresh randomness: torch's generator starts from one fixed seed in every new
    process, so without this every worker process would crop its images alike."""
    import torch

    torch.seed()


def per_image(aug: Augment, size: int) -> Callable[[Image.Image], np.ndarray]:
    """The training transform of one decoded original (a PIL image, or a uint8 CHW tensor), as a
    uint8[size, size, 3] array; one per task."""
    _reseed()
    fn = transform(aug, size)
    return lambda img: fn(img).permute(1, 2, 0).numpy()


def arrays(batch: np.ndarray, aug: Augment, size: int) -> np.ndarray:
    """Augmented uint8[N, S, S, 3] images (already decoded and kept in memory) as uint8[N, size, size, 3]."""
    import torch

    fn = per_image(aug, size)  # it takes uint8 CHW tensors as it takes PIL images
    out = np.empty((len(batch), size, size, 3), dtype=np.uint8)
    for i, img in enumerate(torch.from_numpy(np.ascontiguousarray(batch)).permute(0, 3, 1, 2)):
        out[i] = fn(img)
    return out
