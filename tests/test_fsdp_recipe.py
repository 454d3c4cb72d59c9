"""`raytrain fit --strategy fsdp` end to end on a real local Ray, on CPU with gloo: the recipe's model,
gradients, optimizer state and checkpoints sharded over the ranks (FSDP2)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import raytrain
from raytrain.contracts import rundir
from raytrain.contracts.rundir import Manifest
from raytrain.recipe import checkpoint_files
from tests.conftest import CliResult, assert_user_error, run_cli

pytestmark = pytest.mark.slow


def result_of(storage: Path, name: str) -> dict[str, Any]:
    return json.loads((storage / name / "result.json").read_text())  # type: ignore[no-any-return]


def test_fsdp_trains_as_ddp_on_one_seed_and_evaluates_and_exports_whole(tmp_path: Path) -> None:
    """The same seed and data under ddp and fsdp, 2 workers each (the two runs at once, each with its own
    Ray). FSDP2's gradients are DDP's (tests/test_strategy.py), so training follows the same path up to
    float rounding; validation differs only by BatchNorm's running statistics, which DDP copies from rank
    0 at every step and FSDP2 keeps per rank. The sharded run's checkpoints evaluate and export as whole
    models. (A sharded run resumed at other world sizes, resharded: test_faults_slurm's elastic run, 3 to 2
    to 3 workers, and test_train_func's.)"""
    storage = tmp_path / "runs"
    common = ("--storage", str(storage), "--image-size", "16", "--augment", "none", "--batch-size", "32")

    def fit(name: str, *args: str) -> CliResult:
        out = run_cli("fit", *common, "--name", name, *args)
        assert out.returncode == 0, out.stdout + out.stderr
        return out

    with ThreadPoolExecutor(2) as pool:
        ddp, fsdp = pool.map(
            lambda extra: fit(*extra, "--workers", "2", "--epochs", "2"), [("ddp",), ("fsdp", "--strategy", "fsdp")]
        )
    assert "memory per rank" not in ddp.stdout  # a CPU ddp run is not sized: a second of the driver's saved
    assert re.search(r"^memory per rank, estimated \(resnet18: 11.2 M parameters", fsdp.stdout, re.M), fsdp.stdout
    assert re.search(r"^  fsdp  [\d.]+ MB = parameters [\d.]+ MB, .*<- --strategy$", fsdp.stdout, re.M), fsdp.stdout
    whole, sharded = result_of(storage, "ddp"), result_of(storage, "fsdp")
    for a, b in zip(whole["history"], sharded["history"], strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=0.02), (whole["history"], sharded["history"])
    assert abs(sharded["final"]["val_acc"] - whole["final"]["val_acc"]) <= 0.05, (whole["final"], sharded["final"])

    # Every rank's shard and rank 0's state.pt (no model or optimizer in it), all in the manifest.
    run = storage / "fsdp"
    second = run / "epoch_0002"
    shards = {".metadata", "__0_0.distcp", "__1_0.distcp"}
    manifest = Manifest.from_bytes((second / rundir.MANIFEST).read_bytes())
    assert shards | {checkpoint_files.STATE, checkpoint_files.META} <= set(manifest.files), manifest.files
    state = torch.load(second / checkpoint_files.STATE, weights_only=True)
    assert state["epoch"] == 2 and "model" not in state and "optimizer" not in state
    assert json.loads((second / checkpoint_files.META).read_text())["sharded"] is True
    weights = raytrain.full_weights(str(second))
    assert weights["fc.weight"].shape == (10, 512) and len(weights) == len(
        torch.load(storage / "ddp" / "epoch_0002" / checkpoint_files.STATE, weights_only=True)["model"]
    )

    # Evaluated in one process, the gathered model scores what training measured, within a point or two:
    # its BatchNorm statistics are one rank's for each buffer (DCP saves a replicated tensor once), where
    # each rank validated with its own.
    out = run_cli("evaluate", "--storage", str(storage), "fsdp", "--checkpoint", "last")
    assert out.returncode == 0, out.stderr
    accuracy = float(re.search(r"^accuracy: ([\d.]+)%$", out.stdout, re.M).group(1)) / 100  # type: ignore[union-attr]
    assert abs(accuracy - sharded["final"]["val_acc"]) <= 0.03, (accuracy, sharded["final"])

    # Another strategy is another experiment: refused, the run untouched.
    assert_user_error(run_cli("fit", *common, "--name", "fsdp", "--epochs", "3"), "strategy: 'fsdp' -> the default")

    out = run_cli("export", "--storage", str(storage), "fsdp", "--format", "safetensors", "--checkpoint", "last")
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    exported = load_file(str(run / "export" / "model.safetensors"))
    gathered = raytrain.full_weights(str(second))
    assert exported.keys() == gathered.keys() and all(torch.equal(exported[k], gathered[k]) for k in exported)
