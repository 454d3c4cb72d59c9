"""Fine-tuning weights and the optimisation options, as narrow units (no Ray)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torchvision

from raytrain.errors import UserError
from raytrain.recipe import checkpoint_files, optim, weights
from raytrain.recipe.config import FitConfig, ModelConfig, OptimConfig


def test_warm_up_then_cosine() -> None:
    f = optim.schedule(epochs=10, warmup=2)
    assert [round(f(e), 3) for e in (0, 1, 2, 6, 10)] == [0.01, 0.505, 1.0, 0.5, 0.0]
    assert optim.schedule(epochs=4, warmup=0)(0) == 1.0


def test_a_frozen_backbone_trains_only_the_head_and_a_scaled_one_slower() -> None:
    net = torchvision.models.resnet18(num_classes=3)
    frozen = FitConfig(model=ModelConfig(weights="x.pt", freeze_backbone=True), optim=OptimConfig(lr=0.1))
    opt, _ = optim.build(net, frozen)
    assert [len(g["params"]) for g in opt.param_groups] == [2]
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(net.fc.weight), id(net.fc.bias)}
    assert not net.conv1.weight.requires_grad and net.fc.weight.requires_grad

    net = torchvision.models.resnet18(num_classes=3)
    scaled = FitConfig(model=ModelConfig(weights="x.pt", backbone_lr_scale=0.1), optim=OptimConfig(optimizer="adamw"))
    opt, _ = optim.build(net, scaled)
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.02, 0.002])
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(net.parameters()))


def test_torchvision_weights_come_from_the_torch_cache_and_the_head_starts_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    named = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    path = Path(weights.cache_file(named))
    assert path.parent == tmp_path / "torch/hub/checkpoints" and path.name.startswith("resnet18-")
    path.parent.mkdir(parents=True)
    imagenet = torchvision.models.resnet18()  # 1000 classes, as the real file's
    torch.save(imagenet.state_dict(), path)

    cfg = ModelConfig(weights="IMAGENET1K_V1")
    matched = weights.check(cfg, num_classes=10)
    assert matched is not None and matched.fresh == ("fc.weight", "fc.bias") and matched.total == 122
    assert matched.line("IMAGENET1K_V1") == (
        "weights: IMAGENET1K_V1: 120 of 122 tensors loaded; starting afresh: fc.weight, fc.bias"
    )
    assert torch.equal(matched.state["conv1.weight"], imagenet.conv1.weight.detach())
    by_full_name = weights.state_dict(ModelConfig(weights="ResNet18_Weights.IMAGENET1K_V1"))
    assert by_full_name.keys() == weights.state_dict(ModelConfig(weights="DEFAULT")).keys()

    os.remove(path)
    with pytest.raises(UserError, match=r"is not in the torch cache .* copy resnet18-\w+\.pth to "):
        weights.state_dict(cfg)


def test_weights_from_a_state_dict_file_or_a_raytrain_checkpoint(tmp_path: Path) -> None:
    net = torchvision.models.resnet18(num_classes=4)
    wrapped = {"model": {f"module.{k}": v for k, v in net.state_dict().items()}}  # as a DDP script saves it
    torch.save(wrapped, tmp_path / "w.pt")
    loaded = weights.state_dict(ModelConfig(weights=str(tmp_path / "w.pt")))
    assert loaded.keys() == net.state_dict().keys()

    ckpt = tmp_path / "run" / checkpoint_files.name(2)
    ckpt.mkdir(parents=True)
    checkpoint_files.write(ckpt, {"model": net.state_dict(), "epoch": 2}, {"epoch": 2})
    for given in (tmp_path / "run", ckpt):  # a run (its newest checkpoint) or one checkpoint
        state = weights.state_dict(ModelConfig(weights=str(given)))
        assert torch.equal(state["fc.weight"], net.fc.weight.detach())
    (ckpt / checkpoint_files.STATE).write_bytes(b"damaged")
    with pytest.raises(UserError, match="no raytrain checkpoint in it"):  # the size no longer matches
        weights.state_dict(ModelConfig(weights=str(ckpt)))


def test_the_head_is_the_last_linear_layer() -> None:
    assert weights.head(torchvision.models.resnet18()) == ["fc.weight", "fc.bias"]
    assert weights.head(torchvision.models.mobilenet_v3_small()) == ["classifier.3.weight", "classifier.3.bias"]
    assert weights.head(torchvision.models.squeezenet1_0()) == ["classifier.1.weight", "classifier.1.bias"]


def test_a_compile_that_fails_on_its_first_step_says_so_in_one_line() -> None:
    from raytrain.errors import Fatal
    from raytrain.recipe.train_loop import TrainState, _compiled_first

    net = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    st = TrainState(net=net, model=net, optimizer=sgd, scheduler=None, compiled=True)
    failed = r"^--compile failed on this machine \(RuntimeError: no working C\+\+ compiler\): train without --compile$"
    with pytest.raises(Fatal, match=failed), _compiled_first(st, True):
        raise RuntimeError("no working C++ compiler\n(the backend's long explanation)")
    with pytest.raises(RuntimeError, match="a later step's own error"), _compiled_first(st, False):
        raise RuntimeError("a later step's own error")


def test_every_optimisation_option_is_part_of_the_experiment_a_resume_must_repeat() -> None:
    base = FitConfig().experiment()
    for change in (
        {"optimizer": "adamw"},
        {"warmup_epochs": 2},
        {"label_smoothing": 0.1},
        {"clip_grad_norm": 1.0},
        {"accumulate": 4},
        {"ema_decay": 0.999},
        {"compile": True},
        {"momentum": 0.8},
    ):
        changed = FitConfig(optim=OptimConfig(**change)).experiment()  # type: ignore[arg-type]
        assert {k for k in base if base[k] != changed[k]} == set(change)
    assert FitConfig(optim=OptimConfig(epochs=90)).experiment() == base  # a run may be extended


def test_the_driver_knows_the_pinned_torchvisions_models_without_importing_it() -> None:
    """The driver checks --model against a list taken from torchvision 0.29.0 (importing torchvision costs
    1.6 s of CPU before the first step): it must be exactly what that torchvision lists."""
    from importlib.metadata import version

    from raytrain.recipe import models

    assert version("torchvision").split("+")[0] == models.KNOWN_TORCHVISION, "pyproject pins another torchvision"
    assert set(models.classification_models()) == models.known_models()
