"""`--strategy ddp|fsdp`: the units FSDP2 shards, the memory each strategy costs a rank, a GPU run that
cannot fit refused before anything starts, and FSDP2's gradients against DDP's on real ranks."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain.errors import UserError
from raytrain.recipe import models, strategy
from raytrain.recipe.config import DataConfig, FitConfig, ModelConfig, OptimConfig
from tests.conftest import assert_user_error, run_cli


@pytest.mark.parametrize(
    ("model", "unit", "count"),
    [("resnet18", "BasicBlock", 8), ("vit_b_16", "EncoderBlock", 12), ("mobilenet_v3_small", "", 13)],
)
def test_each_block_of_a_torchvision_model_is_a_unit(model: str, unit: str, count: int) -> None:
    with torch.device("meta"):
        net = models.build(model, 10)
    found = strategy.blocks(net)
    assert len(found) == count and all(type(b).__name__ == unit for b in found if unit), [type(b) for b in found]
    assert strategy.blocks(torch.nn.Linear(3, 4)) == []  # any other model: one unit


def config(model: str = "resnet18", optimizer: str = "sgd", chosen: str = "ddp") -> FitConfig:
    return FitConfig(
        data=DataConfig(num_classes=10, image_size=32),
        model=ModelConfig(name=model, strategy=chosen),
        optim=OptimConfig(optimizer=optimizer),
    )


def test_the_estimate_counts_state_once_per_rank_under_ddp_and_shared_under_fsdp() -> None:
    net = models.build("resnet18", 10)
    params = sum(p.numel() for p in net.parameters())
    largest = max(sum(p.numel() for p in b.parameters()) for b in strategy.blocks(net))
    est = strategy.estimate(config(optimizer="adamw"), gpu=True)
    assert (est.params, est.largest_unit, est.optimizer_slots, est.compute_bytes) == (params, largest, 2, 2)
    # DDP: parameters, gradients and the buckets DDP reduces them in, and AdamW's two moments, whole.
    assert est.total("ddp", 4) == 4 * params * (1 + 1 + 1 + 2)
    assert est.per_rank("ddp", 1)["gradient buckets"] == 0  # one rank: no DDP
    # FSDP over 4 ranks: a quarter of each, plus the largest block gathered in bf16 twice (the one
    # computing, the one prefetched) and its float32 gradients.
    sharded = est.per_rank("fsdp", 4)
    assert sharded["parameters"] == -(-4 * params // 4) and sharded["optimizer state"] == -(-8 * params // 4)
    assert sharded["gathered units"] == 2 * 2 * largest + 4 * largest
    assert est.total("fsdp", 4) < est.total("ddp", 4) / 2
    assert strategy.estimate(config(), gpu=False).compute_bytes == 4  # CPU: float32 throughout


def test_a_gpu_run_whose_model_state_exceeds_a_gpus_memory_is_refused_with_what_to_do() -> None:
    """2 B parameters with AdamW: 40 GB per rank under ddp; 4.4 GB over 8 ranks under fsdp, 16.4 GB over 2."""
    est = strategy.Estimate("big", params=2_000_000_000, largest_unit=50_000_000, optimizer_slots=2, compute_bytes=2)
    gib = 2**30
    strategy.check_fits(est, "ddp", 8, gpu_bytes=None)  # memory unknown: nothing refused
    strategy.check_fits(est, "ddp", 8, gpu_bytes=80 * gib)
    strategy.check_fits(est, "fsdp", 2, gpu_bytes=24 * gib)
    with pytest.raises(UserError, match=r"--strategy ddp needs about 40.0 GB per GPU for big's .* a GPU's 34.4 GB: "):
        strategy.check_fits(est, "ddp", 8, gpu_bytes=32 * gib)
    with pytest.raises(UserError, match=r"use --strategy fsdp \(about 4.4 GB per GPU over 8 workers; see --dry-run"):
        strategy.check_fits(est, "ddp", 8, gpu_bytes=32 * gib)
    too_big = r"need about 16.4 GB per GPU even sharded over 2 workers .* more --workers, or a smaller --model"
    for chosen in ("ddp", "fsdp"):
        with pytest.raises(UserError, match=too_big):
            strategy.check_fits(est, chosen, 2, gpu_bytes=8 * gib)


def fake_nvidia_smi(folder: Path, mib: list[int]) -> dict[str, str]:
    """``nvidia-smi`` as the query raytrain makes answers on a node with GPUs of ``mib`` MiB."""
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    answer = "\\n".join(str(m) for m in mib)
    smi.write_text(f'#!/bin/sh\n[ "$1" = --query-gpu=memory.total ] || exit 9\nprintf "{answer}\\n"\n')
    smi.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_gpu_memory_is_the_smallest_gpu_nvidia_smi_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in fake_nvidia_smi(tmp_path / "bin", [81559, 40960]).items():
        monkeypatch.setenv(name, value)
    assert strategy.gpu_memory() == 40960 * 2**20
    (tmp_path / "bin" / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 60\n")  # a wedged GPU's
    start = time.monotonic()
    assert strategy.gpu_memory(timeout_s=1) is None and time.monotonic() - start < 5
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert strategy.gpu_memory() is None


def test_a_frozen_backbone_counts_gradients_and_optimizer_state_of_the_head_only() -> None:
    cfg = FitConfig(
        data=DataConfig(num_classes=10, image_size=32),
        model=ModelConfig(name="resnet18", weights="DEFAULT", freeze_backbone=True),
    )
    est = strategy.estimate(cfg, gpu=True)
    assert est.trainable == 512 * 10 + 10  # fc
    assert est.per_rank("ddp", 2)["gradients"] == 4 * est.trainable < est.per_rank("ddp", 2)["parameters"]


def test_a_dry_run_prints_each_strategys_memory_and_a_ddp_run_too_large_for_its_gpus_is_refused(tmp_path: Path) -> None:
    """ViT-H/14 with AdamW on 4 GPUs of 8 GiB: its state fits them sharded, not whole."""
    slurm = {"SLURM_JOB_ID": "41", "SLURM_CPUS_ON_NODE": "8", "SLURM_GPUS_ON_NODE": "4"}
    env = {**slurm, **fake_nvidia_smi(tmp_path / "bin", [8192] * 4)}
    args = ("fit", "--dry-run", "--model", "vit_h_14", "--optimizer", "adamw", "--storage", str(tmp_path / "runs"))
    est = strategy.estimate(config("vit_h_14", "adamw"), gpu=True)
    ddp, fsdp = (strategy.size(est.total(s, 4)) for s in ("ddp", "fsdp"))
    assert est.total("fsdp", 4) < 8 * 2**30 < est.total("ddp", 4)
    refused = run_cli(*args, env=env)
    assert_user_error(refused, f"--strategy ddp needs about {ddp} per GPU", f"use --strategy fsdp (about {fsdp} per")
    out = run_cli(*args, "--strategy", "fsdp", env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index(
        f"memory per rank, estimated (vit_h_14: {est.params / 1e6:.1f} M parameters; activations not counted):"
    )
    assert lines[at + 1].startswith(f"  ddp   {ddp} = parameters ") and "gradient buckets" in lines[at + 1]
    assert lines[at + 2].startswith(f"  fsdp  {fsdp} = parameters ") and lines[at + 2].endswith("<- --strategy")
    assert '"strategy": "fsdp"' in out.stdout


def _grads_of_both(config: dict[str, Any]) -> None:
    """On each rank: the same ResNet under DDP and under FSDP2 (``raytrain.shard``, per block), one batch
    of this rank's own; the largest gap between their gradients, relative to the gradient."""
    import ray.train
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import raytrain

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    whole = models.build("resnet18", 10)
    sharded = copy.deepcopy(whole)
    ddp = DistributedDataParallel(whole)
    raytrain.shard(sharded, strategy.blocks(sharded))
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    for model in (ddp, sharded):
        F.cross_entropy(model(x), y).backward()
    gaps = {}
    for (name, a), (other, b) in zip(whole.named_parameters(), sharded.named_parameters(), strict=True):
        assert name == other and a.grad is not None and b.grad is not None
        full = b.grad.full_tensor()  # type: ignore[attr-defined]
        gaps[name] = float((a.grad - full).abs().max() / a.grad.abs().max().clamp(min=1e-12))
    # Validation shares of different lengths (rank 0: 3 batches, rank 1: 1): every forward pass of the
    # sharded model is a collective, so the ranks go in lockstep rather than leave rank 0's waiting.
    from raytrain.recipe import train_loop

    class Uneven:
        def val(self) -> Any:
            for _ in range(3 if rank == 0 else 1):
                images = torch.randint(0, 256, (4, 16, 16, 3), dtype=torch.uint8, generator=g)
                labels = torch.randint(0, 10, (4,), generator=g)
                yield train_loop.Batch(images, labels, torch.ones(4, dtype=torch.bool), labels)

    cfg = FitConfig(data=DataConfig(num_classes=10, image_size=16), model=ModelConfig(strategy="fsdp"))
    cpu = torch.device("cpu")
    uneven: Any = Uneven()
    totals = train_loop.evaluate(sharded, uneven, cfg, cpu, train_loop.Normalize(cpu), lockstep=True)
    counted = raytrain.all_reduce({"count": float(totals.count)}, cpu, torch.distributed.ReduceOp.SUM)["count"]
    if rank == 0:  # (Ray Train's result keeps the metrics of reports with a checkpoint only)
        found = {"worst": max(gaps.values()), "params": len(gaps), "evaluated": counted}
        Path(config["out"]).write_text(json.dumps(found))


@pytest.mark.slow
def test_fsdp2_gradients_are_ddps_and_validation_goes_in_lockstep(ray_local: object, tmp_path: Path) -> None:
    """gloo cannot average: FSDP2's reduce-scatter sums, then raytrain.shard divides, as DDP's all-reduce
    does; the gradients agree to float32 rounding. Validation of the sharded model on shares of different
    lengths ends on every rank, counting every sample once."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    out = tmp_path / "out.json"
    trainer = TorchTrainer(
        _grads_of_both,
        train_loop_config={"out": str(out)},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="grads"),
        torch_config=TorchConfig(timeout_s=120),  # collectives out of step fail in 2 minutes, not 30
    )
    result = trainer.fit()
    assert result.error is None, result.error
    found = json.loads(out.read_text())
    assert found["params"] == 62 and found["worst"] < 1e-5, found
    assert found["evaluated"] == 16, found  # every real sample, none of the blank ones
