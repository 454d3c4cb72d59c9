"""Pretrained weights for fine-tuning (``--weights``): a torchvision weight name, read from the local torch
cache (nothing is downloaded: compute nodes are often offline), a state dict file, or a raytrain checkpoint
or run directory. Tensors whose name and shape match the model's are loaded; the others (the classifier
head, for another number of classes) keep their fresh initialisation.

The driver loads and matches them once, before any worker starts, and fails in seconds when they do not
fit; rank 0 puts them into its model, and DDP hands them to the other ranks.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from raytrain import uri
from raytrain.errors import UserError
from raytrain.recipe import checkpoint_files, models

if TYPE_CHECKING:
    import torch
    from torch import nn

    from raytrain.recipe.config import ModelConfig

_STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


@dataclass(frozen=True)
class Matched:
    """The tensors of the weights that fit the model, and the model's tensors that start afresh."""

    state: dict[str, torch.Tensor]
    fresh: tuple[str, ...]
    total: int  # the model's tensors

    def line(self, spec: str) -> str:
        fresh = f"; starting afresh: {', '.join(self.fresh[:4])}{', ...' if len(self.fresh) > 4 else ''}"
        return f"weights: {spec}: {len(self.state)} of {self.total} tensors loaded" + (fresh if self.fresh else "")


def _torchvision_weights(spec: str, model: str) -> Any | None:
    """The torchvision weights enum member ``spec`` names (for ``model``), or None if it names none."""
    from torchvision.models import get_model_weights, get_weight

    if "_Weights." in spec:
        try:
            return get_weight(spec)
        except (ValueError, KeyError, AttributeError):
            raise UserError(f"--weights {spec}: torchvision has no such weights") from None
    if ":" in model or "/" in spec or spec.endswith(_STATE_DICT_SUFFIXES):
        return None
    try:
        enum = get_model_weights(model)
    except (ValueError, KeyError):  # a model torchvision publishes no weights for
        return None
    if spec == "DEFAULT":
        return enum.DEFAULT
    if spec in enum.__members__:
        return enum[spec]
    return None


def cache_file(weights: Any) -> str:
    """Where torchvision keeps (would keep) these weights: the torch hub cache (``$TORCH_HOME``)."""
    import torch

    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(weights.url).path))


def _unwrap(raw: Any, shown: str) -> dict[str, torch.Tensor]:
    """A state dict from what a file holds: the dict itself, or one under ``model``/``state_dict``; DDP's
    ``module.`` prefix removed."""
    import torch

    if isinstance(raw, dict):
        for key in ("model", "state_dict", "model_state_dict"):
            if isinstance(raw.get(key), dict):
                raw = raw[key]
                break
    if not isinstance(raw, dict) or not raw or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise UserError(
            f"--weights {shown} holds no state dict (a dict of tensors): save one with torch.save(model.state_dict())"
        )
    return {k.removeprefix("module."): v for k, v in raw.items()}


def _torch_load(blob_or_path: Any, shown: str) -> Any:
    import pickle

    import torch

    try:
        return torch.load(blob_or_path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
        raise UserError(f"--weights {shown} is not a readable torch file ({uri.first_line(exc)})") from None


def state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights ``cfg.weights`` names, on the CPU; a one-line UserError when they cannot be had."""
    spec = cfg.weights
    assert spec is not None
    tv = _torchvision_weights(spec, cfg.name)
    if tv is not None:
        path = cache_file(tv)
        if not os.path.isfile(path):
            raise UserError(
                f"--weights {spec}: {tv} is not in the torch cache ({path}) and raytrain downloads nothing; on a "
                f"machine with internet run: python -c \"import torchvision; torchvision.models.get_weight('{tv}')"
                f'.get_state_dict()", then copy {os.path.basename(path)} to {os.path.dirname(path)}/ here '
                "(or set TORCH_HOME to a cache that has it)"
            )
        return _unwrap(_torch_load(path, spec), spec)
    fs, path = uri.resolve(spec)
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        names = "" if ":" in cfg.name else f" ({', '.join(['DEFAULT', *_names(cfg.name)])})"
        raise UserError(
            f"--weights {spec} is neither a file nor a directory nor a torchvision weight name for {cfg.name}{names}"
        )
    if info.type == pafs.FileType.Directory:
        found = checkpoint_files.named_by(fs, path)
        if found is None:
            raise UserError(
                f"--weights {spec} is a directory with no raytrain checkpoint in it: give a checkpoint or run directory"
            )
        try:
            return _unwrap(checkpoint_files.model_weights(fs, found), spec)
        except ValueError as exc:
            raise UserError(f"--weights {spec}: {exc}: give another checkpoint") from None
    import io

    with fs.open_input_stream(path) as f:
        return _unwrap(_torch_load(io.BytesIO(f.read()), spec), spec)


def _names(model: str) -> list[str]:
    from torchvision.models import get_model_weights

    try:
        return list(get_model_weights(model).__members__)
    except (ValueError, KeyError):
        return []


def match(net: nn.Module, state: dict[str, torch.Tensor]) -> Matched:
    """The tensors of ``state`` that fit ``net`` by name and shape."""
    own = net.state_dict()
    fits = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    return Matched(state=fits, fresh=tuple(k for k in own if k not in fits), total=len(own))


def check(cfg: ModelConfig, num_classes: int) -> Matched | None:
    """Load and match the weights in the driver: a UserError in seconds when they do not fit the model."""
    if cfg.weights is None:
        return None
    matched = match(models.build(cfg.name, num_classes), state_dict(cfg))
    if not matched.state:
        raise UserError(
            f"--weights {cfg.weights}: none of its tensors fit --model {cfg.name} (names or shapes differ): "
            "give weights of the same architecture"
        )
    return matched


def head(net: nn.Module) -> list[str]:
    """The names of the parameters of the model's classifier head: its last ``nn.Linear`` (or last 1x1
    convolution, as SqueezeNet's)."""
    from torch import nn

    last = None
    for name, module in net.named_modules():
        if isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1)):
            last = name
    if last is None:
        raise UserError("--freeze-backbone/--backbone-lr-scale: the model has no nn.Linear classifier head to train")
    return [posixpath.join(last, n).replace("/", ".") for n, _ in net.get_submodule(last).named_parameters()]
