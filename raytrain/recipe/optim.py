"""The optimizer, its schedule and the weight average the recipe trains with (``OptimConfig``).

SGD with Nesterov momentum (the reference trainer's default) or AdamW; the learning rate warms up linearly
from 1% over ``warmup_epochs`` and then follows a cosine to zero, stepped per epoch. With ``--weights``,
the classifier head trains at ``lr`` and the backbone at ``lr * backbone_lr_scale``, or not at all with
``--freeze-backbone``. Weight decay applies to every parameter, biases and normalisation layers' included
(torchvision's reference trainer's default, ``--norm-weight-decay`` unset).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from raytrain.recipe import weights
from raytrain.recipe.config import FitConfig


def schedule(epochs: int, warmup: int) -> Callable[[int], float]:
    """The learning rate, as a share of its peak, after ``e`` epochs."""

    def factor(e: int) -> float:
        if e < warmup:
            return 0.01 + 0.99 * e / warmup
        done = min(e - warmup, epochs - warmup) / max(epochs - warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * done))

    return factor


def _groups(net: nn.Module, cfg: FitConfig) -> list[dict[str, Any]]:
    """Parameter groups: the head's, then the backbone's (none when it is frozen)."""
    model, optim = cfg.model, cfg.optim
    if model.weights is None or not (model.freeze_backbone or model.backbone_lr_scale != 1.0):
        return [{"params": list(net.parameters()), "lr": optim.lr}]
    head_names = set(weights.head(net))
    head, backbone = [], []
    for name, param in net.named_parameters():
        if name in head_names:
            head.append(param)
        elif model.freeze_backbone:
            param.requires_grad_(False)
        else:
            backbone.append(param)
    backbone_group = [{"params": backbone, "lr": optim.lr * model.backbone_lr_scale}] if backbone else []
    return [{"params": head, "lr": optim.lr}, *backbone_group]


def build(net: nn.Module, cfg: FitConfig) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and its per-epoch scheduler for ``net``."""
    optim = cfg.optim
    groups = _groups(net, cfg)
    optimizer: torch.optim.Optimizer
    if optim.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=optim.lr, weight_decay=optim.weight_decay)
    else:
        optimizer = torch.optim.SGD(
            groups, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay, nesterov=optim.momentum > 0
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(optim.epochs, optim.warmup_epochs))
    return optimizer, scheduler


def ema(net: nn.Module, decay: float) -> torch.optim.swa_utils.AveragedModel:
    """An exponential moving average of ``net``'s weights (and a copy of its buffers), updated each step."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    return AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
