"""A user's own Ray Train function, run with ``raytrain fit --train-func tests.user_code.train_func:train_func``.

It resumes from ``ray.train.get_checkpoint()`` (mid-epoch too), checkpoints and returns as soon as
``raytrain.ending_soon()`` says the job ends, and counts the rows of its ``train`` dataset shard when
``--data`` hands it one. Config: epochs, steps (per epoch), lr.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import ray.train
import torch
import torch.nn.functional as F

import raytrain


def _save(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int, metrics: dict[str, Any]
) -> None:
    """Report ``metrics`` with a checkpoint (rank 0 writes it); every rank reports."""
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as directory:
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
            torch.save(state, os.path.join(directory, "state.pt"))
        name = f"epoch_{epoch:04d}" + (f"_step_{step:06d}" if step else "")
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(directory) if rank == 0 else None,
            checkpoint_dir_name=name,
        )


def _rows(shard: Any) -> int:
    return sum(len(batch["label"]) for batch in shard.iter_batches(batch_size=64, batch_format="numpy"))


def train_func(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config.get("lr", 0.05)))
    epoch, step = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, step = state["epoch"], state["step"]
    try:
        shard = ray.train.get_dataset_shard("train")
    except KeyError:  # run without --data
        shard = None
    x = torch.randn(256, 64)
    y = (x[:, :4].argmax(dim=1)).long()
    while epoch < int(config["epochs"]):
        loss = torch.zeros(())
        while step < int(config["steps"]):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            raytrain.progress(
                step, samples=len(x), steps=int(config["steps"]), epoch=epoch + 1, epochs=int(config["epochs"])
            )
            if raytrain.ending_soon():
                _save(model, optimizer, epoch, step, {"epoch": epoch + 1, "stopped_at_step": step})
                return
        epoch, step = epoch + 1, 0
        metrics: dict[str, Any] = {"epoch": epoch, "epochs": int(config["epochs"]), "loss": float(loss)}
        if shard is not None:
            total = raytrain.all_reduce({"rows": _rows(shard)}, torch.device("cpu"), torch.distributed.ReduceOp.SUM)
            metrics["rows"] = int(total["rows"])
        _save(model, optimizer, epoch, 0, metrics)
