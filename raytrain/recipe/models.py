"""Models: torchvision classifiers by name, or a user's own ``package.module:factory``.

A factory is called as ``factory(num_classes=K)`` and must return a ``torch.nn.Module`` that maps a
float batch of shape (N, 3, S, S) to logits of shape (N, K). Weights start from scratch: nothing is
downloaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrain.callables import import_callable
from raytrain.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

# Models whose train-mode forward returns auxiliary outputs need them switched off.
_NO_AUX = {"googlenet", "inception_v3"}
# torchvision's classification models in the version raytrain pins, one name a line (tests/test_finetune.py
# checks the list against the torchvision installed): the driver accepts these names without importing
# torchvision, 1.6 s of CPU on the path to the first step. Any other name, or another torchvision, is checked
# by torchvision itself.
KNOWN_TORCHVISION = "0.29.0"
KNOWN_MODELS_FILE = "torchvision_models.txt"


def known_models() -> frozenset[str]:
    from importlib.resources import files

    return frozenset(files(__package__).joinpath(KNOWN_MODELS_FILE).read_text().split())


def classification_models() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _known(name: str) -> bool:
    """Whether ``name`` is one of the pinned torchvision's models, told without importing torchvision."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchvision").split("+")[0] == KNOWN_TORCHVISION and name in known_models()
    except PackageNotFoundError:
        return False


def check(name: str) -> None:
    """Fail fast, in the driver, on a model name that cannot be built."""
    if ":" in name:
        _factory(name)
    elif not _known(name) and name not in classification_models():
        close = [m for m in classification_models() if m.startswith(name[:4])][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UserError(
            f"unknown model {name!r}{hint}: use a torchvision classification model such as resnet18, "
            "resnet50 or mobilenet_v3_small (list them with `raytrain models`), or package.module:factory"
        )


def _factory(spec: str) -> Any:
    return import_callable(spec, "--model")


def build(name: str, num_classes: int) -> nn.Module:
    from torch import nn

    if ":" in name:
        made = _factory(name)(num_classes=num_classes)
    else:
        import torchvision

        kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
        if name in _NO_AUX:
            kwargs.update(aux_logits=False, init_weights=True)
        made = torchvision.models.get_model(name, **kwargs)
    if not isinstance(made, nn.Module):
        raise UserError(f"--model {name} returned {type(made).__name__}, not a torch.nn.Module")
    return made


def logits(output: Any) -> torch.Tensor:
    """The logits of a forward pass, for models that return a named tuple or a dict."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits  # type: ignore[no-any-return]
    if isinstance(output, dict) and "out" in output:
        return output["out"]  # type: ignore[no-any-return]
    raise TypeError(f"the model returned {type(output).__name__}; return a logits tensor")
