"""A user's FSDP2 training function, run with ``raytrain fit --train-func tests.user_code.fsdp_train:train_func``.

The model is sharded over every rank (``raytrain.shard``: parameters, gradients and optimizer state each
held once across the ranks), checkpointed from every rank (``raytrain.save_sharded``) and resumed at
whatever world size the run has now (``raytrain.load_sharded``). It checkpoints and returns as soon as
``raytrain.ending_soon()`` says the job ends, and counts the rows of its ``train`` dataset shard when
``--data`` hands it one. Each report carries ``loss``, the loss over the whole of its fixed data, the same
on every rank and at every world size, so a resumed run can be seen to go on where it was. Config:
epochs, steps (per epoch), lr; die_once (a path: rank 1 kills itself right after its first epoch's
checkpoint is in storage, once, leaving the file behind; what a node failure at the worst moment does);
slow_last_save (seconds: the save after the job said it ends is slowed by that much, as a large model's on
busy storage would be).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import ray.train
import torch
import torch.nn.functional as F

import raytrain


class Net(torch.nn.Module):
    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(64, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth)
        )
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _rows(shard: Any) -> int:
    return sum(len(batch["label"]) for batch in shard.iter_batches(batch_size=64, batch_format="numpy"))


def _slow_last_save(seconds: float) -> None:
    """Slow DCP's writes down by ``seconds`` once the job ends soon (they run in DCP's background thread)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def slowed(self: Any, plan: Any, planner: Any) -> Any:
        if raytrain.ending_in() is not None:
            time.sleep(seconds)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = slowed  # type: ignore[method-assign]


def train_func(config: dict[str, Any]) -> None:
    if config.get("slow_last_save"):
        _slow_last_save(float(config["slow_last_save"]))
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)
    net = Net()
    model = raytrain.shard(net, blocks=net.blocks)  # each block, then the rest, over every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(config.get("lr", 1e-3)))
    progress = raytrain.load_sharded(model, optimizer) or {"epoch": 0, "step": 0}  # resharded to this world
    epoch, step = progress["epoch"], progress["step"]
    try:
        shard = ray.train.get_dataset_shard("train")
    except KeyError:  # run without --data
        shard = None
    x = torch.randn(240, 64, generator=torch.Generator().manual_seed(0))
    y = x[:, :4].argmax(dim=1)
    mine = slice(rank, None, world)  # this rank's rows of every step's batch

    def loss_over_all() -> float:  # a collective: the sharded forward pass runs on every rank
        with torch.no_grad():
            return float(F.cross_entropy(model(x), y))

    resumed_at = loss_over_all()
    while epoch < int(config["epochs"]):
        while step < int(config["steps"]):
            loss = F.cross_entropy(model(x[mine]), y[mine])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            raytrain.progress(step, samples=len(x), steps=int(config["steps"]), epoch=epoch + 1)
            if raytrain.ending_soon():
                metrics = {"epoch": epoch + 1, "epochs": int(config["epochs"]), "stopped_at_step": step}
                metrics |= {"loss": loss_over_all(), "resumed_at": resumed_at}
                raytrain.save_sharded(model, optimizer, metrics=metrics, extra={"epoch": epoch, "step": step})
                return
        epoch, step = epoch + 1, 0
        metrics = {"epoch": epoch, "epochs": int(config["epochs"]), "loss": loss_over_all(), "resumed_at": resumed_at}
        if shard is not None:
            total = raytrain.all_reduce({"rows": _rows(shard)}, torch.device("cpu"), torch.distributed.ReduceOp.SUM)
            metrics["rows"] = int(total["rows"])
        ending = raytrain.ending_soon(now=True)  # at the epoch's end: then this save is the last
        raytrain.save_sharded(
            model, optimizer, metrics=metrics, extra={"epoch": epoch, "step": 0}, name=f"epoch_{epoch:04d}"
        )
        if ending:
            return
        if config.get("die_once") and not os.path.exists(config["die_once"]):
            raytrain.wait_sharded()  # saves go on in the background: rank 1 dies once every rank's is stored
            torch.distributed.barrier()
            if rank == 1:
                open(config["die_once"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
