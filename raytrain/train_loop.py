"""The per-worker training function that Ray Train runs on every rank.

It reads nothing from the environment: everything comes in the loop config the driver built (the frozen
``FitConfig`` plus where the run lives and what to resume from) and from Ray Train's context.
"""

from __future__ import annotations

import math
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raytrain import checkpoint, models
from raytrain.config import FitConfig
from raytrain.data import pipeline

# ImageNet statistics: a reasonable normalisation for models trained from scratch on natural images too.
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


@dataclass
class EpochTotals:
    """Sums over one rank's share of an epoch, kept on the device until the epoch ends."""

    loss: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor
    data_wait_s: float = 0.0
    first_batch_at: float | None = None
    first_step_at: float | None = None

    @classmethod
    def zeros(cls, device: torch.device) -> EpochTotals:
        z = torch.zeros((), device=device, dtype=torch.float64)
        return cls(loss=z.clone(), correct=z.clone(), count=z.clone())

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        n = labels.shape[0]
        self.loss += loss.detach().double() * n
        self.correct += (logits.argmax(1) == labels).sum()
        self.count += n


class Normalize:
    """uint8 NHWC batches on the device -> normalised float NCHW (channels_last on GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.mean, self.std = _MEAN.to(device), _STD.to(device)
        self.channels_last = device.type == "cuda"

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float().sub_(self.mean).div_(self.std)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x.contiguous()


def cosine(epochs: int) -> Any:
    return lambda e: 0.5 * (1.0 + math.cos(math.pi * min(e, epochs) / epochs))


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    shard: Any,
    cfg: FitConfig,
    device: torch.device,
    normalize: Normalize,
) -> EpochTotals:
    model.train()
    totals = EpochTotals.zeros(device)
    amp = cfg.optim.amp and device.type == "cuda"
    batches = pipeline.batches(shard, batch_size=cfg.optim.batch_size, device=device)
    while True:
        t0 = time.perf_counter()
        try:
            images, labels = next(batches)
        except StopIteration:
            break
        totals.data_wait_s += time.perf_counter() - t0
        if totals.first_batch_at is None:
            totals.first_batch_at = time.time()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = models.logits(model(normalize(images)))
            loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        totals.add(loss, logits, labels)
        if totals.first_step_at is None:
            totals.first_step_at = time.time()
    return totals


@torch.no_grad()
def evaluate(model: nn.Module, shard: Any, cfg: FitConfig, device: torch.device, normalize: Normalize) -> EpochTotals:
    model.eval()
    totals = EpochTotals.zeros(device)
    amp = cfg.optim.amp and device.type == "cuda"
    for images, labels in pipeline.batches(shard, batch_size=cfg.optim.batch_size, device=device):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = models.logits(model(normalize(images)))
        totals.add(F.cross_entropy(logits.float(), labels), logits, labels)
    return totals


def _all_reduce(values: list[float], device: torch.device, op: Any) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=op)
    return [float(v) for v in t.tolist()]


def _broadcast(obj: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def restore(
    loop: dict[str, Any],
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    device: torch.device,
    rank: int,
) -> dict[str, Any] | None:
    """Load the newest intact checkpoint into the model, optimizer and scheduler; None on a fresh start.

    Within one ``fit`` Ray's latest checkpoint wins (a worker-group restart); otherwise the one the driver
    found. Rank 0 picks (falling back past damaged checkpoints) and every rank loads the same one.
    """
    import ray.train

    fs, run_dir = loop["run_fs"], loop["run_dir"]
    newest = loop["resume"]
    ray_ckpt = ray.train.get_checkpoint()
    if ray_ckpt is not None:
        newest = ray_ckpt.path
    choice: tuple[checkpoint.Found, list[str]] | None = None
    if rank == 0 and newest is not None:
        bound = checkpoint.parse_name(Path(newest).name)
        loaded = checkpoint.load_newest_intact(fs, run_dir, torch.device("cpu"), not_after=bound)
        choice = (loaded[0], loaded[2]) if loaded else None
    choice = _broadcast(choice)
    if choice is None:
        return None
    found, skipped = choice
    state = checkpoint.load(fs, found, device)
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return {
        "checkpoint": found.path,
        "epoch": state["epoch"],
        "batches_done": state.get("batches_done", 0),
        "global_step": state["global_step"],
        "optimizer_digest": checkpoint.digest(optimizer.state_dict()),
        "skipped_damaged": skipped,
    }


def train_worker(loop: dict[str, Any]) -> None:
    """Entry point run by Ray Train on every worker."""
    import ray.train
    import ray.train.torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    entered_at = time.time()
    cfg: FitConfig = loop["config"]
    assert cfg.data.num_classes is not None and cfg.scale.cpus_per_worker is not None
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(cfg.scale.cpus_per_worker)))
    torch.manual_seed(cfg.optim.seed)

    net = models.build(cfg.model.name, cfg.data.num_classes).to(device)
    if device.type == "cuda":
        net = net.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        net.parameters(),
        lr=cfg.optim.lr,
        momentum=cfg.optim.momentum,
        weight_decay=cfg.optim.weight_decay,
        nesterov=cfg.optim.momentum > 0,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(cfg.optim.epochs))
    resumed = restore(loop, net, optimizer, scheduler, device, rank)
    start = resumed["epoch"] if resumed else 0
    global_step = resumed["global_step"] if resumed else 0
    # Parameters are in their final place before DDP broadcasts rank 0's copy to the others.
    model: nn.Module = DDP(net, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else net

    normalize = Normalize(device)
    train_shard = ray.train.get_dataset_shard(pipeline.TRAIN)
    val_shard = ray.train.get_dataset_shard(pipeline.VAL)
    where = {
        "rank": rank,
        "hostname": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "device": str(device),
    }

    for epoch in range(start, cfg.optim.epochs):
        t0 = time.perf_counter()
        tr = train_epoch(model, optimizer, train_shard, cfg, device, normalize)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time = time.perf_counter() - t0
        va = evaluate(net, val_shard, cfg, device, normalize)
        scheduler.step()
        epoch_time = time.perf_counter() - t0
        sums = _all_reduce(
            [float(x) for x in (tr.loss, tr.correct, tr.count, va.loss, va.correct, va.count)],
            device,
            dist.ReduceOp.SUM,
        )
        slowest = _all_reduce([train_time, epoch_time, tr.data_wait_s], device, dist.ReduceOp.MAX)
        steps = math.ceil(float(tr.count) / cfg.optim.batch_size)
        global_step += steps
        metrics = {
            "epoch": epoch + 1,
            "epochs": cfg.optim.epochs,
            "train_loss": sums[0] / max(sums[2], 1),
            "train_acc": sums[1] / max(sums[2], 1),
            "train_samples": int(sums[2]),
            "val_loss": sums[3] / max(sums[5], 1),
            "val_acc": sums[4] / max(sums[5], 1),
            "val_samples": int(sums[5]),
            "samples_per_s": sums[2] / max(slowest[0], 1e-9),
            "train_time_s": slowest[0],
            "epoch_time_s": slowest[1],
            "data_wait_s": slowest[2],
            "lr": optimizer.param_groups[0]["lr"],
            "global_step": global_step,
            "world_size": world,
            "worker": where,
            "resumed": resumed if epoch == start else None,
            "startup": {"worker_at": entered_at, "first_batch_at": tr.first_batch_at, "first_step_at": tr.first_step_at}
            if epoch == start
            else None,
        }
        _report(metrics, rank, epoch + 1, net, optimizer, scheduler, cfg, global_step)


def _report(
    metrics: dict[str, Any],
    rank: int,
    epoch: int,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    cfg: FitConfig,
    global_step: int,
) -> None:
    """Report the epoch's metrics; rank 0 attaches the checkpoint (uploaded by Ray while training goes on)."""
    import ray.train

    name = checkpoint.name(epoch)
    if rank != 0:
        ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
        return
    staging = Path(tempfile.mkdtemp(prefix="rt-ckpt-"))
    state = {
        "model": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "batches_done": 0,
        "global_step": global_step,
        "config": cfg.to_dict(),
    }
    meta = {k: v for k, v in metrics.items() if k not in ("worker", "resumed", "startup")}
    checkpoint.write(staging, state, meta)
    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint.from_directory(str(staging)),
        checkpoint_dir_name=name,
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
    )
