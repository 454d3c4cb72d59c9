"""Ingest alone: raytrain's Ray Data pipeline against a torch DataLoader over the same Parquet.

    python bench/ingest.py DATA.parquet [--passes 3] [--cpus 2] --out ingest.json
    python bench/ingest.py PHOTOS.parquet --image-size 224 --augment crop-flip --out ingest224.json
    python bench/ingest.py PHOTOS.parquet --image-size 224 --augment crop-flip --chained --out chained.json

Streamed: both decode the same images to SxS uint8 batches of 64 with a global shuffle each pass and the
same number of CPUs (Ray Data tasks vs DataLoader worker processes), through the same transform
(raytrain's own: with ``--augment crop-flip`` a random resized crop and flip, else a resize and centre
crop); a single consumer takes the batches as torch tensors. The DataLoader is written as an expert
writes it: one loader for every pass, its workers persistent, each with batches prefetched.

``--chained`` reads the passes one after another as training reads its epochs, each side in its own best
way of starting a pass before the one before it ends: the DataLoader as one iterator over every pass's
batches (bench/torchrun_ddp.py's ``EpochBatches``, timm's ``MultiEpochsDataLoader``: its workers are given
the next pass's batches as soon as the last of this one's are); raytrain as a training rank reads its
shard (``shards.ShardFeed`` over the datasets as Ray Train hands them to one worker, validation held:
each pass starts the next as its last block is read). The first pass of each starts cold; the per-part
split, whose walks of /proc fall between passes, is left out, as work for the next pass goes on then.

In memory: raytrain's mode for data that fits (one rank holding it: read and decoded once by ``--cpus``
threads, then reshuffled, augmented and cut into batches every pass) against the same done by hand
over decoded tensors: decoded once by ``--cpus`` threads, then each pass a permutation cut into batches
(an augmentation, if any, applied per image by ``--cpus`` threads as raytrain's feed does). Each side's
load is timed and counted: the figure is over the load and every pass.

Reports time to first batch, images/s per pass, and the CPU cores the process tree used, by part: the
data workers (decoding), the consumer, Ray's own processes (and those by process: raylet, GCS, actors).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import statistics
import time
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from cpu_profile import snapshot  # next to this file, as the next
from torch.utils.data import DataLoader, DistributedSampler
from torchrun_ddp import Encoded, EpochBatches

from raytrain.recipe.data import augment, idle, images, pipeline, source
from raytrain.recipe.data.augment import Augment

BATCH = 64
DECODE_PRIORITY = idle.NORMAL  # streamed decoding's scheduling policy (--decode-priority)
MARK_EVERY = 8  # batches between a pass's timeline marks after its first batch


def tree_cpu_s() -> float:
    """CPU seconds of this process and every descendant (DataLoader workers; the local Ray's processes)."""
    import psutil

    me = psutil.Process()
    own = me.cpu_times()  # its children that exited (a pass's DataLoader workers) count here once reaped
    total = own.user + own.system + own.children_user + own.children_system
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cpu = p.cpu_times()
            total += cpu.user + cpu.system
    return total


PARTS = ("data workers", "consumer", "Ray's own")
OWN_BY = "Ray's own, by process"  # its key in ``cores_by_part``: cores by what names the process Ray's own
# Ray's daemons, agents and actors, by command line or process title; every other process of the tree is a
# data worker (a DataLoader worker, forked or spawned; a Ray worker: starting, idle or running a task).
_RAY_OWN = re.compile(r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|runtime_env|^ray::(_\w*Actor|\w*Agent)")


def cpu_now() -> tuple[float, dict[int, tuple[str, float]]]:
    """When, and pid -> (command line or title, CPU seconds so far) for this process and its descendants."""
    return time.perf_counter(), {pid: (p.cmd, p.cpu_s) for pid, p in snapshot(os.getpid()).items()}


def cores_by_part(before: tuple[float, dict[int, tuple[str, float]]]) -> dict[str, Any]:
    """The cores each part of the tree used since ``before`` (a ``cpu_now``), over that whole window; a
    process is Ray's own if either snapshot names it so, and Ray's own are also split by what names them
    (``OWN_BY``: raylet, gcs_server, an actor's title, ...). Processes that exited in between are not
    counted (an idle Ray worker the raylet stopped: its CPU leaves the tree's total as well)."""
    t0, was = before
    t1, now = cpu_now()
    me = os.getpid()
    out: dict[str, Any] = dict.fromkeys(PARTS, 0.0)
    own_by: dict[str, float] = {}
    for pid, (cmd, cpu) in now.items():
        was_cmd, was_cpu = was.get(pid, (cmd, 0.0))
        own = _RAY_OWN.search(was_cmd) or _RAY_OWN.search(cmd)
        cores = (cpu - was_cpu) / (t1 - t0)
        out["consumer" if pid == me else "Ray's own" if own else "data workers"] += cores
        if own and pid != me:
            own_by[own.group(0)] = own_by.get(own.group(0), 0.0) + cores
    out[OWN_BY] = own_by
    return out


def timed_pass(batches: Any, *, by_part: bool = True) -> dict[str, Any]:
    """One pass: time to the first batch, images/s over the pass and after its first batch (the steady
    rate, without the pass's start; work done before the first batch and handed on after it counts
    there too), and the CPU cores the process tree used meanwhile: over the pass, until its first
    batch, after it, and between marks (``timeline``: seconds, CPU seconds and images at the start, the
    first batch, every ``MARK_EVERY`` batches after it and the end; each mark a walk of the tree inside
    the clock, on every side alike), with ``by_part`` also by part (two walks of /proc outside the
    pass's clock, their window their own: a pipeline that runs on between passes would gain from them,
    which is why ``pass_overlap.py`` leaves them out)."""
    parts0 = cpu_now() if by_part else None
    t0 = time.perf_counter()  # the clock first: the start's walk is inside it, as every mark's is
    cpu0 = tree_cpu_s()
    timeline = [(0.0, 0.0, 0)]
    n = 0
    for count, batch in enumerate(batches, start=1):
        images = batch["image"] if isinstance(batch, dict) else batch[0]
        n += images.shape[0]
        if count % MARK_EVERY == 1:  # the first batch, then every MARK_EVERY after it
            timeline.append((time.perf_counter() - t0, tree_cpu_s() - cpu0, n))
    total = time.perf_counter() - t0
    cpu_used = tree_cpu_s() - cpu0
    first, cpu_first, at_first = timeline[1] if len(timeline) > 1 else (total, 0.0, n)  # no batch at all
    timeline.append((total, cpu_used, n))
    after = total - first
    out = {
        "first_batch_s": first,
        "images": n,
        "images_per_s": n / total,
        "steady_images_per_s": (n - at_first) / after if after else 0.0,
        "cores": cpu_used / total,
        "cores_to_first_batch": cpu_first / first if first else 0.0,
        "cores_after_first_batch": (cpu_used - cpu_first) / after if after else 0.0,
        "seconds": total,
        "timeline": timeline,
    }
    if parts0 is not None:
        out["cores_by_part"] = cores_by_part(parts0)
    return out


def segments(timeline: list[tuple[float, float, int]]) -> list[tuple[float, float]]:
    """A pass's ``timeline`` as (seconds, cores used) between consecutive marks."""
    return [(t1 - t0, (c1 - c0) / (t1 - t0)) for (t0, c0, _), (t1, c1, _) in itertools.pairwise(timeline) if t1 > t0]


PREFETCH = 4  # batches each DataLoader worker keeps ready (torch's default is 2)


def dataloader(path: str, passes: int, cpus: int, size: int, aug: Augment) -> list[dict[str, float]]:
    """One loader for all passes: its workers start once (in the first pass's time) and stay."""
    ds = Encoded(path, size, 0.0, aug.preset)  # the torchrun peer's dataset: every row, kept encoded
    loader = DataLoader(
        ds, batch_size=BATCH, shuffle=True, num_workers=cpus, persistent_workers=True, prefetch_factor=PREFETCH
    )
    return [timed_pass(loader) for _ in range(passes)]


def dataloader_chained(path: str, passes: int, cpus: int, size: int, aug: Augment) -> list[dict[str, float]]:
    """One loader iterator over every pass's batches (``EpochBatches``): the next pass is under way as this
    one's last batches are handed out."""
    ds = Encoded(path, size, 0.0, aug.preset)
    every = EpochBatches(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0), BATCH, passes)
    batches = iter(
        DataLoader(ds, batch_sampler=every, num_workers=cpus, persistent_workers=True, prefetch_factor=PREFETCH)
    )
    return [timed_pass(itertools.islice(batches, every.per_epoch), by_part=False) for _ in range(passes)]


def by_hand_in_memory(path: str, passes: int, cpus: int, size: int, aug: Augment) -> list[dict[str, float]]:
    """The peer of raytrain's in-memory mode: decode once with ``cpus`` threads (Pillow's decode and resize
    release the GIL), then each pass a random permutation of the decoded tensor cut into batches."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    blobs = pq.read_table(path, columns=["image"]).column("image").to_pylist()
    chunks = [blobs[i : i + 256] for i in range(0, len(blobs), 256)]
    with ThreadPoolExecutor(cpus) as pool:
        decoded = np.concatenate(list(pool.map(lambda c: images.decode_many(c, size)[0], chunks)))
    x = torch.from_numpy(decoded)
    load = {"load_s": time.perf_counter() - t0}

    def batches(pool: Any) -> Any:
        for idx in torch.randperm(len(x)).split(BATCH):
            batch = x[idx]
            if aug.active:  # the batch's images split over the threads
                parts = np.array_split(batch.numpy(), cpus)
                batch = torch.from_numpy(np.concatenate(list(pool.map(lambda p: augment.arrays(p, aug, size), parts))))
            yield {"image": batch}  # as the other sides' batches come: timed_pass counts its rows

    with ThreadPoolExecutor(cpus) as pool:
        return [{**timed_pass(batches(pool)), **load} for _ in range(passes)]


def streamed(path: str, cpus: int, size: int, aug: Augment) -> pipeline.Streams:
    """raytrain's streamed datasets of every row (no validation split worth the name), for ``cpus`` data CPUs:
    the one pipeline both raytrain modes read; decoding at this run's ``--decode-priority``."""
    return pipeline.Streams(
        source.inspect(path),
        image_size=size,
        val_fraction=1e-9,
        aug=aug,
        data_cpus=cpus,
        decode_priority=DECODE_PRIORITY,
    )


def pin_draw(draw: int) -> None:
    """Every streamed dataset built from now on has each task draw ``draw`` items, whatever raytrain's rule
    (``pipeline.draw_size``) would give: to compare the rule with another draw."""
    pipeline.draw_size = lambda units, data_cpus, salts=0: draw


def raytrain_pipeline(path: str, passes: int, cpus: int, size: int, aug: Augment) -> list[dict[str, float]]:
    from raytrain.recipe.data import shards

    train = streamed(path, cpus, size, aug).train()
    cpu = torch.device("cpu")
    # As a training rank reads its shard (shards.batches: Ray's prefetching off, a thread of its own instead).
    return [timed_pass(shards.batches(train, batch_size=BATCH, device=cpu)) for _ in range(passes)]


def raytrain_chained(path: str, passes: int, cpus: int, size: int, aug: Augment) -> list[dict[str, float]]:
    """As a training rank reads its epochs: ``ShardFeed`` over each dataset as Ray Train hands it to a run
    of one worker (``trainer.data_config``: whole since 6440e67, through ``streaming_split`` before),
    validation held, so that each training pass starts the next as its last block is read. Validation
    (no rows here) is read once first, off the clock, as epoch 1 reads it before epoch 2's pass starts."""
    from raytrain.recipe.data import shards
    from raytrain.service.trainer import data_config

    data = streamed(path, cpus, size, aug)
    datasets = {pipeline.TRAIN: data.train(), pipeline.VAL: data.val()}
    (given,) = data_config(1, whole_for_one=True).configure(
        datasets, world_size=1, worker_handles=None, worker_node_ids=None
    )
    feed = shards.ShardFeed(given, batch_size=BATCH, device=torch.device("cpu"), epochs=passes, hold_val=True)
    for _ in feed.val():
        pass
    return [timed_pass(feed.train(epoch), by_part=False) for epoch in range(passes)]


def raytrain_memory(path: str, passes: int, cpus: int, size: int, aug: Augment) -> list[dict[str, float]]:
    """One rank holding the data: its load (read and decode, once), then ``passes`` epochs."""
    from raytrain.recipe.data import memory

    t0 = time.perf_counter()
    spec = memory.Spec(source.inspect(path), size, 1e-9, seed=0, aug=aug)
    share = memory.load(spec, 0, 1, threads=cpus)
    load = {"load_s": time.perf_counter() - t0}
    feed = memory.Feed(share, 0, 0, BATCH, torch.device("cpu"), aug, agree=lambda n: n, threads=cpus)
    return [{**timed_pass(feed.train(epoch)), **load} for epoch in range(passes)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--augment", choices=augment.PRESETS, default="none")
    ap.add_argument("--no-in-memory", action="store_true", help="leave out the in-memory mode (data too large)")
    ap.add_argument("--chained", action="store_true", help="streamed: each pass started before the one before ends")
    ap.add_argument("--decode-rows", type=int, help="streamed: rows a task decodes a block (raytrain's own if unset)")
    ap.add_argument("--draw", type=int, help="streamed: items a task draws, every pass (raytrain's rule if unset)")
    ap.add_argument(
        "--decode-priority",
        choices=(idle.NORMAL, idle.IDLE),
        default=idle.NORMAL,
        help="streamed: decoding's policy (normal: what `raytrain fit --decode-priority auto` gives ranks on GPUs)",
    )
    ap.add_argument(
        "--executor-wait",
        type=float,
        help="streamed: the longest Ray Data's executor waits for its tasks' output between scheduling steps "
        "(a constant of Ray's, 0.1 s, set here, where the passes' executors run: chained ones too, as Ray "
        "Train hands one worker its datasets whole)",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        from ray.data._internal.execution import streaming_executor_state as executor
    except ImportError:  # moved in another Ray: nothing to read or set
        executor = None
    if a.executor_wait is not None:
        if not math.isfinite(a.executor_wait) or a.executor_wait <= 0:  # no wait at all: its loop would spin
            ap.error(f"--executor-wait is {a.executor_wait}; give a wait in seconds above 0, such as 0.02")
        if not hasattr(executor, "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S"):
            ap.error("--executor-wait: this Ray has no WAIT_FOR_TASK_COMPLETION_TIMEOUT_S (Ray 2.60's) to set")
        executor.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = a.executor_wait
    executor_wait = getattr(executor, "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S", None)
    global DECODE_PRIORITY
    DECODE_PRIORITY = a.decode_priority
    aug = Augment(preset=a.augment)
    if a.decode_rows is not None:  # the pipeline's block size, to compare others with it
        pipeline._DECODE_ROWS = a.decode_rows
    if a.draw is not None:  # a task's share of a pass, to compare the rule with another
        pin_draw(a.draw)
    random.seed(0)
    torch.set_num_threads(1)
    from raytrain.service import cluster

    # raytrain's own private local Ray (token auth, 0700 temp dir), as `raytrain fit` starts it.
    with cluster.connect(dashboard=False):
        size = a.image_size
        sides = (dataloader_chained, raytrain_chained) if a.chained else (dataloader, raytrain_pipeline)
        result: dict[str, Any] = {
            "dataloader": sides[0](a.data, a.passes, a.cpus, size, aug),
            "raytrain_streamed": sides[1](a.data, a.passes, a.cpus, size, aug),
        }
        if not a.no_in_memory and not a.chained:
            result["raytrain_in_memory"] = raytrain_memory(a.data, a.passes, a.cpus, size, aug)
            result["by_hand_in_memory"] = by_hand_in_memory(a.data, a.passes, a.cpus, size, aug)
    with open(a.out, "w") as f:
        drawn = pipeline.draw_size(source.inspect(a.data).train_units, a.cpus, salts=pipeline._SALTS)
        settings = {"decode_rows": pipeline._DECODE_ROWS, "draw": drawn, "chained": a.chained}
        settings["executor_wait_s"] = executor_wait
        json.dump({**result, **settings, "decode_priority": a.decode_priority}, f, indent=1)
    for name, runs in result.items():
        print(
            name,
            [
                f"{r['images_per_s']:.0f} img/s (steady {r['steady_images_per_s']:.0f}), first "
                f"{r['first_batch_s']:.2f} s, {r['cores']:.2f} cores ({r['cores_to_first_batch']:.2f} to the "
                f"first batch, {r['cores_after_first_batch']:.2f} after)"
                for r in runs
            ],
        )
        later = runs[1:] or runs  # the first pass also starts the workers
        for r in later:
            print("  cores between marks (s: cores):", " ".join(f"{d:.2f}:{c:.2f}" for d, c in segments(r["timeline"])))
        if "cores_by_part" in later[0]:
            print(
                f"  cores by part, median of passes 2..{len(runs)}:",
                ", ".join(f"{p} {statistics.median(r['cores_by_part'][p] for r in later):.2f}" for p in PARTS),
            )
            names = sorted({name for r in later for name in r["cores_by_part"][OWN_BY]})
            own = {n: statistics.median(r["cores_by_part"][OWN_BY].get(n, 0.0) for r in later) for n in names}
            print(
                f"  Ray's own by process, median of passes 2..{len(runs)}:",
                ", ".join(f"{n} {c:.3f}" for n, c in sorted(own.items(), key=lambda kv: -kv[1])),
            )


if __name__ == "__main__":
    main()
