"""A stock Ray Train script, written the way Ray's PyTorch docs write one: no raytrain import.

    python stock_train.py --workers 3 --epochs 4 --storage /shared/runs --name stock

``ray.init()`` joins whatever cluster ``RAY_ADDRESS`` names (on a raytrain cluster: the job's, with token
auth already set up); the model and data are tiny and made here, so it runs anywhere without downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time

import ray
import ray.train
import torch
import torch.nn.functional as F
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model


def _until_registered(index: str, deadline_s: float = 120.0) -> None:
    """Wait until Ray Train's index of the run (``checkpoint_manager_snapshot.json``) lists a checkpoint."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with open(index) as f:
                if json.load(f).get("checkpoint_results"):
                    return
        except (OSError, ValueError):
            pass  # not written yet, or being replaced
        time.sleep(0.1)
    raise TimeoutError(f"{index} listed no checkpoint within {deadline_s:.0f} s")


def train_func(config: dict) -> None:  # type: ignore[type-arg]
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    rank = ray.train.get_context().get_world_rank()
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "model.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        start = state["epoch"]
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(512, 8, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    for epoch in range(start, config["epochs"]):
        if config.get("die_once") and rank == 1 and epoch == 1 and not os.path.exists(config["die_once"]):
            open(config["die_once"], "w").close()  # a fault, once: rank 1 dies in epoch 2, once Ray Train
            _until_registered(config["index"])  # has registered epoch 1's checkpoint
            os.kill(os.getpid(), signal.SIGKILL)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with tempfile.TemporaryDirectory() as directory:
            if rank == 0:
                torch.save({"model": model.state_dict(), "epoch": epoch + 1}, os.path.join(directory, "model.pt"))
            ray.train.report(
                {"epoch": epoch + 1, "loss": loss.item()},
                checkpoint=Checkpoint.from_directory(directory) if rank == 0 else None,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage", default=os.path.expanduser("~/ray_results"))
    parser.add_argument("--name", default="stock")
    args = parser.parse_args()
    ray.init()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"lr": 0.1, "epochs": args.epochs},
        scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": args.cpus_per_worker}),
        run_config=RunConfig(
            storage_path=os.path.abspath(args.storage),
            name=args.name,
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    print(f"stock script done: epoch {result.metrics['epoch']}, loss {result.metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
