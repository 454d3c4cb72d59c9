"""Model factories for `raytrain fit --model tests.user_code.models:NAME`."""

from __future__ import annotations

import torch
from torch import nn


class _DivergesAfter(nn.Module):
    """A small convnet whose outputs turn NaN after a number of training steps: a diverging run."""

    def __init__(self, num_classes: int, steps: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
        )
        self.steps, self.seen = steps, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.training:
            self.seen += 1
            if self.seen > self.steps:
                return out * float("nan")
        return out


def diverges_in_epoch_2(num_classes: int) -> nn.Module:
    """Finite through the first epoch of the embedded digits on one worker (23 steps of 64), NaN after."""
    return _DivergesAfter(num_classes, steps=30)
