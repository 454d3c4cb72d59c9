"""The peer: a plain PyTorch DDP training script, written the way the seed documents do it.

    torchrun --nproc-per-node 2 bench/torchrun_ddp.py --data DATA.parquet --epochs 3 --out out.json

DistributedSampler + DataLoader + DistributedDataParallel over gloo (nccl on GPU), on the same Parquet
data, rows, model, per-worker batch, optimizer, learning-rate schedule, seed, normalisation and thread
count as `raytrain fit`. Written well for data this size: images are decoded once into memory, so
steps read tensors, not files. Rank 0 prints a line per epoch and writes per-epoch training time,
samples and loss as JSON.

`--stream` is the peer for data that streams (raytrain's `fit --stream`): images stay encoded and
`--loader-workers` DataLoader processes per rank decode them every epoch with raytrain's own transform
(`--augment crop-flip`: the same random resized crop and flip), persistent across epochs with 4 batches
prefetched each, as an expert writes a loader. It also validates every epoch as raytrain does (the
held-out rows, resized and centre-cropped, decoded every epoch by a second such loader), and records each
epoch's time over training and validation. One loader iterator reads every epoch's batches in turn
(`EpochBatches`), so its workers are given the next epoch's batches as soon as the last of an epoch's
are given out (up to 4 a worker ahead of the loop), whatever the loop does meanwhile, validation and
the checkpoint included; validation's batches start while the epoch's last step runs.
`--hold-val`, as raytrain does with streamed validation rows that fit its memory budget: the first
validation's batches are kept and replayed every later epoch.

`--save` checkpoints after every epoch as raytrain does, inside the same loop, and records how long
training was blocked by it: `torch` is what the seed scripts write (rank 0 `torch.save`s the model,
optimizer and schedule into `--save-dir` while the others wait at its barrier); `dcp-async` is PyTorch's
distributed checkpoint as an expert writes it for speed (`torch.distributed.checkpoint.async_save` from
every rank, blocked only while the state is staged, the write in the background; a save waits for the
one before it).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


def split_table(path: str, val_fraction: float, train: bool = True) -> Any:
    """The training rows (or the validation rows), encoded: the same stable hash split as raytrain's."""
    table = pq.read_table(path, columns=["image", "label"])
    cut = int(val_fraction * 10_000)
    return table.filter([(zlib.crc32(b) % 10_000 >= cut) == train for b in table.column("image").to_pylist()])


def load(path: str, size: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The training rows, decoded once."""
    table = split_table(path, val_fraction)
    imgs = np.stack([
        np.asarray(Image.open(io.BytesIO(b)).convert("RGB").resize((size, size), Image.Resampling.BILINEAR), np.uint8)
        for b in table.column("image").to_pylist()
    ])  # fmt: skip
    return torch.from_numpy(imgs), torch.from_numpy(table.column("label").to_numpy().astype(np.int64))


class Encoded(Dataset[tuple[torch.Tensor, int]]):
    """The training (or validation) rows kept encoded, each decoded as the loader's workers ask for it."""

    def __init__(self, path: str, size: int, val_fraction: float, augment: str, train: bool = True) -> None:
        table = split_table(path, val_fraction, train)
        self.blobs, self.labels = table.column("image").to_pylist(), table.column("label").to_pylist()
        self.size, self.augment = size, augment
        self.fn: Any = None  # made in each loader worker

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from raytrain.recipe.data import augment, images

        if self.fn is None:  # the very functions raytrain's decode uses
            aug, size = augment.Augment(preset=self.augment), self.size
            self.fn = (
                augment.per_image(aug, size)
                if aug.active
                else lambda img: np.asarray(images.fit(img, size), dtype=np.uint8).copy()
            )
        return torch.from_numpy(self.fn(images.open_rgb(self.blobs[i]))), self.labels[i]


class EpochBatches(Sampler[list[int]]):
    """Every epoch's batches in turn, as one stream that a single loader iterator reads: its workers are
    given the next epoch's batches as soon as the last of this one's are, never idle at an epoch's end
    (timm's ``MultiEpochsDataLoader`` does the same). Each epoch's order is the sampler's for that epoch,
    cut into batches as a loader over it would cut them."""

    def __init__(self, sampler: DistributedSampler[Any], batch_size: int, epochs: int) -> None:
        self.sampler, self.batch_size, self.epochs = sampler, batch_size, epochs
        self.per_epoch = math.ceil(len(sampler) / batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for epoch in range(self.epochs):
            self.sampler.set_epoch(epoch)
            yield from BatchSampler(self.sampler, self.batch_size, drop_last=False)

    def __len__(self) -> int:
        return self.per_epoch * self.epochs


class Saver:
    """A checkpoint after each epoch, timed as training sees it: from the call until training may go on."""

    def __init__(self, how: str, root: str, model: torch.nn.Module, opt: Any, sched: Any, rank: int) -> None:
        self.how, self.root, self.model, self.opt, self.sched, self.rank = how, root, model, opt, sched, rank
        self.pending: Any = None  # dcp-async: the save in flight
        self.group = dist.new_group(backend="gloo") if how == "dcp-async" else None  # its own, as DCP advises

    def __call__(self, epoch: int) -> float | None:
        if self.how == "none":
            return None
        start = time.perf_counter()
        path = os.path.join(self.root, f"peer-r{dist.get_world_size()}-epoch{epoch}")
        if self.how == "torch":
            if self.rank == 0:
                net = self.model.module if isinstance(self.model, DDP) else self.model
                state = {"model": net.state_dict(), "optimizer": self.opt.state_dict(),
                         "scheduler": self.sched.state_dict(), "epoch": epoch}  # fmt: skip
                torch.save(state, path + ".pt")
            dist.barrier()
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            if self.pending is not None:
                self.pending.result()
            model_state, opt_state = get_state_dict(self.model, self.opt)
            state = {"model": model_state, "optimizer": opt_state, "epoch": epoch}
            self.pending = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
        return time.perf_counter() - start

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.result()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--val-fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0, help="model initialisation (and data order, by default)")
    ap.add_argument("--shuffle-seed", type=int, help="data order: the DistributedSampler's seed (default --seed)")
    ap.add_argument("--synthetic", action="store_true", help="train on one pre-built batch")
    ap.add_argument("--model", default="resnet18", help="torchvision model name")
    ap.add_argument("--save", choices=["none", "torch", "dcp-async"], default="none", help="checkpoint each epoch")
    ap.add_argument("--save-dir", help="where --save writes (default: beside --out)")
    ap.add_argument("--stream", action="store_true", help="decode every epoch in DataLoader workers")
    ap.add_argument("--loader-workers", type=int, default=2, help="with --stream: DataLoader processes per rank")
    ap.add_argument("--augment", choices=["none", "crop-flip"], default="none", help="with --stream")
    ap.add_argument("--hold-val", action="store_true", help="with --stream: keep the first validation's batches")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.augment != "none" and not a.stream:
        ap.error("--augment needs --stream (data decoded once cannot be augmented anew every epoch)")

    started = float(os.environ.get("BENCH_T0", time.time()))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(a.seed)

    data: Dataset[Any] = (
        Encoded(a.data, a.image_size, a.val_fraction, a.augment)
        if a.stream
        else TensorDataset(*load(a.data, a.image_size, a.val_fraction))
    )
    sampler = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=a.seed if a.shuffle_seed is None else a.shuffle_seed
    )
    workers = {"num_workers": a.loader_workers, "persistent_workers": True, "prefetch_factor": 4} if a.stream else {}
    every = EpochBatches(sampler, a.batch_size, a.epochs)
    if a.stream:  # one iterator over every epoch's batches, its workers at work from here on
        stream = iter(DataLoader(data, batch_sampler=every, pin_memory=cuda, **workers))
    else:
        loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler)
    val_loader = None
    if a.stream:
        val_data = Encoded(a.data, a.image_size, a.val_fraction, "none", train=False)
        val_sampler = DistributedSampler(val_data, num_replicas=world, rank=rank, shuffle=False)
        val_loader = DataLoader(val_data, batch_size=a.batch_size, sampler=val_sampler, pin_memory=cuda, **workers)
    net = torchvision.models.get_model(a.model, weights=None, num_classes=10).to(device)
    # As Ray Train's prepare_model and raytrain do: no DDP wrapper (and no all-reduce) for a world of one.
    model = DDP(net, device_ids=[local_rank] if cuda else None) if world > 1 else net
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: 0.5 * (1 + math.cos(math.pi * min(e, a.epochs) / a.epochs))
    )
    mean, std = MEAN.to(device), STD.to(device)
    fixed = next(stream if a.stream else iter(loader)) if a.synthetic else None

    save = Saver(a.save, a.save_dir or os.path.dirname(os.path.abspath(a.out)), model, opt, sched, rank)
    epochs, first_step = [], None
    held: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # with --hold-val: validation's batches
    for epoch in range(a.epochs):
        if not a.stream:
            sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count, wait = 0, 0.0
        batches = stream if a.stream else iter(loader)
        val_batches = None
        for i in range(every.per_epoch):
            tw = time.perf_counter()
            x, y = fixed if fixed is not None else next(batches)
            if val_loader is not None and held is None and i == every.per_epoch - 1:
                val_batches = iter(val_loader)  # its workers start on it while the last step runs
            wait += time.perf_counter() - tw
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = x.permute(0, 3, 1, 2).float().sub_(mean).div_(std).contiguous()
            loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.detach().double() * y.shape[0]
            count += y.shape[0]
            if first_step is None:
                first_step = time.time() - started
        if cuda:
            torch.cuda.synchronize()
        train_time = time.perf_counter() - t0
        val_correct = torch.zeros((), dtype=torch.float64, device=device)
        if val_loader is not None:
            model.eval()
            with torch.no_grad():
                keep: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if a.hold_val and held is None else None
                for x, y in held if held is not None else val_batches or val_loader:
                    if keep is not None:
                        keep.append((x, y))
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    x = x.permute(0, 3, 1, 2).float().sub_(mean).div_(std).contiguous()
                    val_correct += (model(x).argmax(1) == y).sum()
            if cuda:
                torch.cuda.synchronize()
            held = keep if keep is not None else held
        elapsed = torch.tensor([train_time, wait, time.perf_counter() - t0], dtype=torch.float64)
        sums = torch.tensor([loss_sum.item(), float(count)], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
        sched.step()
        blocked = save(epoch + 1)
        epochs.append({"epoch": epoch + 1, "train_time_s": elapsed[0].item(), "data_wait_s": elapsed[1].item(),
                       "epoch_time_s": elapsed[2].item(),
                       "train_samples": int(sums[1]), "train_loss": sums[0].item() / sums[1].item(),
                       "checkpoint_blocked_s": blocked})  # fmt: skip
        if rank == 0:
            print(f"epoch {epoch + 1}/{a.epochs} loss {epochs[-1]['train_loss']:.4f}", flush=True)
    save.finish()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"epochs": epochs, "first_step_s": first_step, "world_size": world}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
