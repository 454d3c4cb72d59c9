"""The recipe's per-worker training function, run by Ray Train on every rank.

It reads nothing from the environment: everything comes in the loop config the driver built (the frozen
``FitConfig`` plus where the run lives and what to resume from), from Ray Train's context, and from
raytrain's public worker API (``raytrain.ending_soon``, ``raytrain.all_reduce``) as any user's function can.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel

import raytrain
from raytrain.contracts import metrics as keys
from raytrain.recipe import checkpoint_files, models, optim, strategy
from raytrain.recipe.config import FitConfig, LoopConfig
from raytrain.recipe.data import memory, pipeline, shards
from raytrain.recipe.metrics import EpochMetrics

# ImageNet statistics (of [0, 1] pixels): a reasonable normalisation for models trained from scratch on
# natural images too, and the one torchvision's pretrained weights expect.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
_MEAN = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
_STD = torch.tensor(STD).view(1, 3, 1, 1) * 255
# Past this share of unusable samples in an epoch the data is broken, not noisy: stop rather than train on it.
MAX_UNUSABLE = 0.05

Batch = pipeline.Batch


@dataclass
class EpochTotals:
    """Sums over one rank's share of an epoch, kept on the device until the epoch ends."""

    loss: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor  # samples trained on (or evaluated)
    unusable: torch.Tensor  # samples left out: the image did not decode or the label is null
    dropped: int = 0  # samples of a one-sample batch, left out in training (BatchNorm needs two)
    steps: int = 0
    batches: int = 0  # batches of this epoch behind us, trained or skipped on resume
    ids: list[torch.Tensor] = field(default_factory=list)  # the row ids of those batches
    data_wait_s: float = 0.0
    first_batch_at: float | None = None
    first_step_at: float | None = None
    preempted: bool = False  # stopped early: the job ends soon

    @classmethod
    def zeros(cls, device: torch.device) -> EpochTotals:
        z = torch.zeros((), device=device, dtype=torch.float64)
        return cls(loss=z.clone(), correct=z.clone(), count=z.clone(), unusable=z.clone())

    def add(self, losses: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> None:
        """Per-sample ``losses``; only the ``valid`` samples count."""
        usable = valid.sum()
        self.loss += (losses.detach().double() * valid).sum()
        self.correct += ((logits.argmax(1) == labels) & valid).sum()
        self.count += usable
        self.unusable += labels.shape[0] - usable


def masked_loss(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample cross-entropy, and its mean over the valid samples (0 with no gradient when none is)."""
    losses = F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=smoothing)
    return losses, (losses * valid).sum() / valid.sum().clamp(min=1)


@dataclass
class TrainState:
    """What a checkpoint holds, plus the DDP wrapper used for training steps. A sharded model (``net``
    sharded in place by FSDP2) keeps its weights and optimizer state in the checkpoint's shards, and the
    rest in ``state.pt``."""

    net: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: AveragedModel | None = None  # --ema-decay: the weights' moving average
    ddp: DDP | None = None  # the DDP wrapper, when there is more than one rank
    epoch: int = 0  # epochs completed
    batches_done: int = 0  # batches of epoch ``epoch + 1`` already trained (a preemption checkpoint)
    global_step: int = 0
    trained: np.ndarray | None = None  # rank 0: row ids epoch ``epoch + 1`` trained before this attempt
    compiled: bool = False  # the model is wrapped by torch.compile
    stepped: bool = False  # a training step has run in this attempt (a compiled model has compiled)
    sharded: bool = False  # --strategy fsdp

    def state_dict(self, cfg: FitConfig) -> dict[str, Any]:
        whole = {} if self.sharded else {"model": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {
            **whole,
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "global_step": self.global_step,
            "config": cfg.to_dict(),
            "rng": rng_state(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
        }


def rng_state() -> dict[str, Any]:
    """torch's generators (CPU, and every CUDA device's), as rank 0 has them: every rank starts from the
    same seed, so every rank resumes from the same state."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any] | None) -> None:
    if not state:
        return
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


class Normalize:
    """uint8 NHWC batches on the device -> normalised float NCHW (channels_last on GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.mean, self.std = _MEAN.to(device), _STD.to(device)
        self.channels_last = device.type == "cuda"

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float().sub_(self.mean).div_(self.std)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x.contiguous()


def synthetic_batch(cfg: FitConfig, device: torch.device) -> Batch:
    """One batch of random images and labels on the device, built once per run and trained on every step
    (``--synthetic-data``: the model's speed with no input pipeline). Built once, as a benchmark's peer
    builds its batch: drawing 256 images of 224 px on the CPU takes about 0.15 s, 2% of an H100's epoch."""
    assert cfg.data.image_size is not None and cfg.data.num_classes is not None
    g = torch.Generator().manual_seed(cfg.optim.seed)
    shape = (cfg.optim.batch_size, cfg.data.image_size, cfg.data.image_size, 3)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
    labels = torch.randint(0, cfg.data.num_classes, (cfg.optim.batch_size,), generator=g).to(device)
    valid = torch.ones_like(labels, dtype=torch.bool)
    return pipeline.Batch(images, labels, valid, torch.zeros_like(labels))


def _ahead(batches: Iterator[Batch]) -> Iterator[tuple[Batch, bool]]:
    """Each batch, and whether it is the last one that trains (the next is missing or of one sample)."""
    current = next(batches, None)
    while current is not None:
        following = next(batches, None)
        yield current, following is None or following.labels.shape[0] < 2
        current = following


def train_epoch(
    st: TrainState,
    batches: Iterator[Batch],
    cfg: FitConfig,
    device: torch.device,
    normalize: Normalize,
    skip: int = 0,
    steps: int | None = None,
) -> EpochTotals:
    """One pass over this rank's batches. The first ``skip`` batches (trained before a preemption) are read
    but not trained on; the pass stops early, after an optimizer step and at the same one on every rank,
    if the job is being preempted. With ``--accumulate N`` every N batches (and the epoch's last) make one
    optimizer step, and DDP all-reduces gradients only then. A batch of one sample is left out (BatchNorm
    cannot train on it): every rank's shard has the same number of rows, so every rank leaves out the same step.
    ``steps``: about how many batches the epoch has, for the progress line's ETA."""
    st.model.train()
    totals = EpochTotals.zeros(device)
    opt = cfg.optim
    amp = opt.amp and device.type == "cuda"
    pending = 0  # batches whose gradients wait for an optimizer step
    stream = _ahead(batches)
    while True:
        t0 = time.perf_counter()
        try:
            (images, labels, valid, ids), last = next(stream)
        except StopIteration:
            break
        waited = time.perf_counter() - t0
        totals.data_wait_s += waited
        totals.batches += 1
        totals.ids.append(ids)
        if totals.batches <= skip:
            continue
        if labels.shape[0] < 2:
            totals.dropped += labels.shape[0]
            continue
        if totals.first_batch_at is None:
            totals.first_batch_at = time.time()
        pending += 1
        step = pending == opt.accumulate or last
        with strategy.gradient_sync(st.ddp or st.net, step), _compiled_first(st, not st.stepped):
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                logits = models.logits(st.model(normalize(images)))
                losses, loss = masked_loss(logits, labels, valid, opt.label_smoothing)
            (loss / opt.accumulate).backward()
        if step:
            if opt.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(st.net.parameters(), opt.clip_grad_norm)
            st.optimizer.step()
            st.optimizer.zero_grad(set_to_none=True)
            if st.ema is not None:
                st.ema.update_parameters(st.net)
            pending = 0
        st.stepped = True
        totals.add(losses, logits, labels, valid)
        totals.steps += 1
        if totals.first_step_at is None:
            totals.first_step_at = time.time()
        raytrain.progress(
            totals.batches,
            samples=labels.shape[0],
            steps=steps,
            epoch=st.epoch + 1,
            epochs=opt.epochs,
            data_wait_s=waited,
        )
        # Not after the epoch's last batch: that epoch is whole, and ends with its own checkpoint (and stop).
        if step and not last and raytrain.ending_soon():
            totals.preempted = True
            break
    return totals


@contextlib.contextmanager
def _compiled_first(st: TrainState, first: bool) -> Iterator[None]:
    """The first step of a ``--compile``d model compiles it: a failure there is the machine's, not a bug."""
    if not (first and st.compiled):
        yield
        return
    try:
        yield
    except Exception as exc:  # torch.compile's backends raise many kinds
        raise raytrain.Fatal(
            f"--compile failed on this machine ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}): "
            "train without --compile"
        ) from None


class Feed(Protocol):
    """Where a rank's batches come from: its share held in memory, or Ray Data's streamed shards."""

    def train(self, epoch: int, rest: bool = False) -> Iterator[Batch]: ...

    def val(self) -> Iterator[Batch]: ...

    def ahead(self, epoch: int) -> None:
        """Epoch ``epoch``'s training pass is the next one read: a feed may start it now."""

    def leave(self) -> None:
        """The loop leaves the epoch's pass before its end (a preempted epoch: it checkpoints and returns,
        reading nothing more): a feed stops now what it does beside the pass."""


def feed(loop: LoopConfig, rank: int, world: int, device: torch.device) -> Feed:
    """The rank's data, asked for before anything else: a share in memory is read and decoded now, and
    streamed shards start their coordinators (where several ranks split them), and a fresh start its first
    pass, while the model is built."""
    cfg, spec, threads = loop.config, loop.memory, loop.data_threads
    train = not cfg.data.synthetic
    if spec is None:
        import ray.train

        rest = loop.resume is not None and loop.resume.rows_recorded
        streamed = shards.ShardFeed.of_worker(
            batch_size=cfg.optim.batch_size,
            device=device,
            train=train,
            rest=rest,
            epochs=cfg.optim.epochs,
            hold_val=loop.hold_val,
            ending=lambda: raytrain.ending_reason() is not None,  # ending_soon has said so (no collective)
        )
        if loop.resume is None and ray.train.get_checkpoint() is None:  # a fresh start: epoch 0's pass is read
            streamed.ahead(0)  # first, and starts now, while the model is built
        return streamed

    def smallest(n: int) -> int:
        return int(raytrain.all_reduce({"rows": n}, device, dist.ReduceOp.MIN)["rows"])

    share = memory.load(spec, rank, world, threads=threads, train=train)
    return memory.Feed(
        share, rank, cfg.optim.seed, cfg.optim.batch_size, device, spec.aug, agree=smallest, threads=threads
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Feed, cfg: FitConfig, device: torch.device, normalize: Normalize, lockstep: bool = False
) -> EpochTotals:
    """Every rank over its share of the validation data. ``lockstep`` (a sharded model, whose every
    forward pass is a collective): the ranks agree before each batch on whether any has one left, and a
    rank whose share is done joins with a batch that counts for nothing, so shares of different lengths
    never leave one rank's forward pass waiting for the others."""
    model.eval()
    totals = EpochTotals.zeros(device)
    amp = cfg.optim.amp and device.type == "cuda"
    batches = iter(data.val())
    while True:
        batch = next(batches, None)
        if lockstep and raytrain.all_reduce({"more": float(batch is not None)}, device, dist.ReduceOp.MAX)["more"]:
            images = batch.images if batch is not None else _blank(cfg, device)
        elif batch is not None and not lockstep:
            images = batch.images
        else:
            break
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = models.logits(model(normalize(images)))
        if batch is not None:  # a blank batch joined the others' forward pass, and counts for nothing
            totals.add(masked_loss(logits, batch.labels, batch.valid)[0], logits, batch.labels, batch.valid)
    return totals


def _blank(cfg: FitConfig, device: torch.device) -> torch.Tensor:
    """Two blank images: what a rank whose validation share is done feeds a sharded model meanwhile."""
    assert cfg.data.image_size is not None
    return torch.zeros((2, cfg.data.image_size, cfg.data.image_size, 3), dtype=torch.uint8, device=device)


def restore(loop: LoopConfig, st: TrainState, device: torch.device, rank: int) -> dict[str, Any] | None:
    """Load the newest intact checkpoint into the model, optimizer and scheduler; None on a fresh start.

    Within one ``fit`` Ray's latest checkpoint wins (a worker-group restart); otherwise the one the driver
    found. Rank 0 picks (falling back past damaged checkpoints) and every rank loads the same one.
    """
    import ray.train

    fs, run_dir = loop.run_fs, loop.run_dir
    newest = loop.resume.checkpoint if loop.resume is not None else None
    ray_ckpt = ray.train.get_checkpoint()
    if ray_ckpt is not None:
        newest = ray_ckpt.path
    choice: tuple[checkpoint_files.Found, list[str]] | None = None
    if rank == 0 and newest is not None:
        bound = checkpoint_files.parse_name(Path(newest).name)
        loaded = checkpoint_files.load_newest_intact(fs, run_dir, torch.device("cpu"), not_after=bound)
        choice = (loaded[0], loaded[2]) if loaded else None
    choice = raytrain.broadcast(choice)
    if choice is None:
        return None
    found, skipped = choice
    state = checkpoint_files.load(fs, found, device)
    if st.sharded:  # every rank reads the parts of the shards it holds now, whatever the world size then
        raytrain.load_sharded(st.net, st.optimizer, checkpoint=ray.train.Checkpoint(found.path, filesystem=fs))
    else:
        st.net.load_state_dict(state["model"])
        st.optimizer.load_state_dict(state["optimizer"])
    st.scheduler.load_state_dict(state["scheduler"])
    if st.ema is not None and "ema" in state:
        st.ema.load_state_dict(state["ema"])
    st.epoch, st.batches_done, st.global_step = state["epoch"], state.get("batches_done", 0), state["global_step"]
    set_rng_state(state.get("rng"))
    if rank == 0 and st.batches_done:
        st.trained = checkpoint_files.trained_rows(fs, found)
    return {
        "checkpoint": found.path,
        "epoch": st.epoch,
        "batches_done": st.batches_done,
        "global_step": st.global_step,
        # A sharded optimizer's state is every rank's own part: no one digest to compare with the saved one.
        "optimizer_digest": None if st.sharded else checkpoint_files.digest(st.optimizer.state_dict()),
        "skipped_damaged": skipped,
    }


def train_worker(loop: LoopConfig) -> None:
    """Entry point run by Ray Train on every worker."""
    import ray
    import ray.train
    import ray.train.torch

    cfg = loop.config
    assert cfg.data.num_classes is not None
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(cfg.optim.seed)
    data = feed(loop, rank, world, device)

    net = models.build(cfg.model.name, cfg.data.num_classes)  # the same on every rank: one seed
    # A fresh run from --weights: DDP copies rank 0's to the others; FSDP2 shards each rank's own copy.
    if loop.init_weights is not None and (rank == 0 or cfg.sharded):
        net.load_state_dict(ray.get(loop.init_weights), strict=False)  # matched by the driver
    if device.type == "cuda":
        if not cfg.sharded:  # FSDP2 shards contiguous parameters only; its inputs still come channels_last
            net = net.to(memory_format=torch.channels_last)
        torch.backends.cudnn.benchmark = True  # one image size: cuDNN tunes its kernels once
    if cfg.sharded:  # before the optimizer, which holds the sharded parameters; from host memory: FSDP2
        # moves one unit at a time to the device and keeps this rank's shard of it, never the whole model
        raytrain.shard(net, strategy.blocks(net), bf16=cfg.optim.amp and device.type == "cuda")
    else:
        net = net.to(device)
    optimizer, scheduler = optim.build(net, cfg)
    ema = optim.ema(net, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
    st = TrainState(net=net, model=net, optimizer=optimizer, scheduler=scheduler, ema=ema, sharded=cfg.sharded)
    resumed = restore(loop, st, device, rank)
    # Parameters are in their final place before DDP broadcasts rank 0's copy to the others.
    if world > 1 and not cfg.sharded:
        st.model = st.ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.optim.compile:
        st.model, st.compiled = cast(nn.Module, torch.compile(st.model)), True

    normalize = Normalize(device)
    # A preempted epoch goes on with exactly its untrained rows, when they are known for the very checkpoint
    # loaded here; otherwise (no row ids recorded) the batches it trained are read and skipped.
    at = loop.resume
    rest = bool(resumed and st.batches_done and at and at.rows_recorded and resumed["checkpoint"] == at.checkpoint)
    if rest and isinstance(data, memory.Feed):
        data.trained = raytrain.broadcast(st.trained)  # rank 0 read them from the checkpoint
    first = True
    blocked: float | None = None  # how long the last epoch's checkpoint report held training up
    synthetic = synthetic_batch(cfg, device) if cfg.data.synthetic else None
    while st.epoch < cfg.optim.epochs:
        t0 = time.perf_counter()
        if synthetic is not None:
            batches: Iterator[Batch] = itertools.repeat(synthetic, loop.steps_per_epoch)
        else:
            batches = data.train(st.epoch, rest=rest)
        skip = 0 if rest else st.batches_done
        tr = train_epoch(st, batches, cfg, device, normalize, skip=skip, steps=loop.steps_per_epoch)
        if rest:
            tr.batches += st.batches_done
            rest = False
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time = time.perf_counter() - t0
        st.global_step += tr.steps
        extra: EpochMetrics = {"checkpoint_blocked_s": blocked}
        if first:
            extra["resumed"] = resumed
            extra["startup"] = keys.Startup(first_batch_at=tr.first_batch_at, first_step_at=tr.first_step_at)
            first = False
        if tr.preempted:
            data.leave()  # before the last checkpoint, which work beside the pass would take CPU from
            st.batches_done = tr.batches
            trained = _trained_rows(st, tr, rank, world)
            metrics = epoch_metrics(cfg, st, tr, None, train_time, train_time, device, world)
            preempted: EpochMetrics = {**metrics, **extra, "preempted": raytrain.ending_reason() or "?"}
            _report(preempted, rank, st, cfg, final=True, trained=trained)
            return
        va = evaluate(net, data, cfg, device, normalize, lockstep=cfg.sharded)
        ema_va = evaluate(st.ema.module, data, cfg, device, normalize) if st.ema is not None else None
        st.scheduler.step()
        st.epoch, st.batches_done, st.trained = st.epoch + 1, 0, None
        # Asked after validation, so that a signal that came during it is seen: the checkpoint below is then
        # the job's last (a sharded save keeps to the time left). Otherwise the next epoch's pass starts
        # during the checkpoint, where the feed has not started it as this epoch's ended (``Feed.ahead``).
        ending = st.epoch < cfg.optim.epochs and raytrain.ending_soon(now=True)
        if synthetic is None and not ending:
            data.ahead(st.epoch)
        metrics = epoch_metrics(cfg, st, tr, va, train_time, time.perf_counter() - t0, device, world, ema_va)
        t_report = time.perf_counter()
        _report({**metrics, **extra}, rank, st, cfg, final=False)
        blocked = time.perf_counter() - t_report
        if ending or (st.epoch < cfg.optim.epochs and raytrain.ending_soon(now=True)):  # ending now costs no work
            # The epoch's checkpoint stands; this report only says why the run ends here.
            ray.train.report({**metrics, "epoch": st.epoch + 1, "preempted": raytrain.ending_reason() or "?"})
            return


def epoch_metrics(
    cfg: FitConfig,
    st: TrainState,
    tr: EpochTotals,
    va: EpochTotals | None,
    train_time: float,
    epoch_time: float,
    device: torch.device,
    world: int,
    ema_va: EpochTotals | None = None,
) -> EpochMetrics:
    """The epoch's figures summed (or maxed, for times) over all ranks."""
    none = EpochTotals.zeros(device)  # every rank sums the same names, with or without validation
    val, ema = va or none, ema_va or none
    mine: dict[str, Any] = {
        "train_loss": tr.loss,
        "train_correct": tr.correct,
        "train_count": tr.count,
        "val_loss": val.loss,
        "val_correct": val.correct,
        "val_count": val.count,
        "ema_correct": ema.correct,
        "unusable": tr.unusable + val.unusable,
        "dropped": tr.dropped,
    }
    sums = raytrain.all_reduce({k: float(v) for k, v in mine.items()}, device, dist.ReduceOp.SUM)
    times = {"train_time_s": train_time, "epoch_time_s": epoch_time, "data_wait_s": tr.data_wait_s}
    slowest = raytrain.all_reduce(times, device, dist.ReduceOp.MAX)
    trained, held_out = sums["train_count"], sums["val_count"]
    return {
        "epoch": st.epoch if va is not None else st.epoch + 1,
        "epochs": cfg.optim.epochs,
        "batches_done": st.batches_done,
        "train_loss": sums["train_loss"] / max(trained, 1),
        "train_acc": sums["train_correct"] / max(trained, 1),
        "train_samples": int(trained),
        "val_loss": sums["val_loss"] / held_out if held_out else None,
        "val_acc": sums["val_correct"] / held_out if held_out else None,
        **({"ema_val_acc": sums["ema_correct"] / held_out if held_out else None} if ema_va is not None else {}),
        "val_samples": int(held_out),
        "unusable_samples": int(sums["unusable"]),
        "dropped_samples": int(sums["dropped"]),
        "samples_per_s": trained / max(slowest["train_time_s"], 1e-9),
        "train_time_s": slowest["train_time_s"],
        "epoch_time_s": slowest["epoch_time_s"],
        "data_wait_s": slowest["data_wait_s"],
        "lr": st.optimizer.param_groups[0]["lr"],
        "global_step": st.global_step,
        "world_size": world,
    }


def _trained_rows(st: TrainState, tr: EpochTotals, rank: int, world: int) -> np.ndarray | None:
    """On rank 0: every rank's row ids of the epoch so far (and those of earlier attempts at it)."""
    mine = torch.cat(tr.ids).cpu().numpy() if tr.ids else np.empty(0, dtype=np.int64)
    every: list[Any] = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    if st.trained is not None:
        every.append(st.trained)
    return np.unique(np.concatenate(every)) if rank == 0 else None


def _check_data(metrics: EpochMetrics) -> None:
    """Stop (not retried) when the epoch's data was mostly unusable: that is broken data, not noise."""
    bad = metrics["unusable_samples"]
    seen = bad + metrics["train_samples"] + metrics["val_samples"]
    if bad > MAX_UNUSABLE * max(seen, 1):
        raise raytrain.Fatal(
            f"{bad} of {seen} samples in epoch {metrics['epoch']} have an image that does not decode or no "
            f"label (more than {MAX_UNUSABLE:.0%}): check the data (`raytrain prepare` keeps only images that "
            "decode), then rerun; no checkpoint of this epoch was saved"
        )


def _report(
    metrics: EpochMetrics, rank: int, st: TrainState, cfg: FitConfig, *, final: bool, trained: np.ndarray | None = None
) -> None:
    """Report to Ray Train; rank 0 attaches the checkpoint. An epoch's checkpoint holds training up only
    while rank 0 copies the state into host memory (and, if the epoch before's is still being written,
    until it is): it is written and uploaded while training goes on (``raytrain.save_whole``). A final
    (preemption) checkpoint, and any once the job has said it ends, is written and uploaded before this
    returns, so it is safe then. A diverged model is never checkpointed: with ``--keep`` it would rotate
    the good checkpoints out."""

    _check_data(metrics)
    loss = metrics["train_loss"]
    if not math.isfinite(loss):  # all-reduced: every rank stops here together
        raise raytrain.Fatal(
            f"the training loss is {loss} in epoch {metrics['epoch']}: training diverged, and no checkpoint of "
            f"it was saved; lower --lr (now {cfg.optim.lr}) and start over with --fresh, or resume with the "
            "same settings from the last checkpoint"
        )

    name = checkpoint_files.name(st.epoch, st.batches_done)
    meta: dict[str, Any] = {
        k: v for k, v in metrics.items() if k not in (keys.RESUMED, keys.STARTUP, "checkpoint_blocked_s")
    }
    # What a checkpoint's user needs besides the weights: the model, its input and its outputs' names.
    meta |= {"model": cfg.model.name, "image_size": cfg.data.image_size, "classes": cfg.data.classes}
    if st.sharded:
        _report_sharded(metrics, meta, st, cfg, name, final=final, trained=trained)
        return
    # A final checkpoint comes once the job has said it ends: save_whole writes and uploads it before it
    # returns, after the epoch's save before it.
    write = functools.partial(_write_checkpoint, meta=meta, trained=trained)
    raytrain.save_whole(st.state_dict(cfg) if rank == 0 else None, metrics=dict(metrics), name=name, write=write)
    if final:  # in storage when this returns, whether or not the job has said it ends
        raytrain.wait_sharded()


def _write_checkpoint(
    directory: str, state: dict[str, Any], *, meta: dict[str, Any], trained: np.ndarray | None
) -> None:
    checkpoint_files.write(Path(directory), state, meta, trained)


def _report_sharded(
    metrics: EpochMetrics,
    meta: dict[str, Any],
    st: TrainState,
    cfg: FitConfig,
    name: str,
    *,
    final: bool,
    trained: np.ndarray | None,
) -> None:
    """Every rank reports its shard of the model and optimizer (``raytrain.save_sharded``: written in the
    background); rank 0 adds ``state.pt`` (the rest of the state), ``meta.json`` and the rows trained. A
    final checkpoint is in storage before this returns, or abandoned when the job's time is too short."""

    def add(directory: str) -> None:
        checkpoint_files.write(Path(directory), st.state_dict(cfg), {**meta, "sharded": True}, trained)

    raytrain.save_sharded(st.net, st.optimizer, metrics=dict(metrics), name=name, add_files=add)
    if final:
        raytrain.wait_sharded()
