"""Cores per GPU: how many CPU cores of JPEG decode and augmentation keep one GPU training at full speed.

    python bench/cores_per_gpu.py --out cores.json                   # on a machine with one CUDA GPU
    python bench/cores_per_gpu.py --out c.json --smoke               # the same code, tiny, on a CPU
    python bench/cores_per_gpu.py --out m.json --loader-only --workers 1 2 \
        --ceiling resnet50=4656 --ceiling vit_b_16=2321                # any host: the model alone

For each model (224 px, batch 256, bf16 autocast, channels_last, SGD with Nesterov momentum, as
bench/plain_loop.py and raytrain's recipe train it):
1. the ceiling: the training step on one pre-built batch, no input pipeline;
2. fed: the same step fed by a DataLoader with k worker processes over ImageNet-shaped JPEGs (224-336
   px, bench/make_data.py --photos), through raytrain's own random-resized-crop and flip to 224
   (bench/ingest.py's dataset), persistent workers, pinned memory, non-blocking copies, for each k.
And the loader alone (no model) with k workers: images/s and the cores its processes used, hence the
per-core rate the model is built on:

    cores per GPU (model)    = ceiling / images per second per core
    cores per GPU (measured) = the least k whose fed rate is >= 95% of the ceiling

``--loader-only`` measures the loader alone, on any host, and models the cores per GPU from ceilings
measured elsewhere (``--ceiling MODEL=IMAGES_PER_S``, a GPU run's): the per-core rate is the host's own,
so the model holds for a GPU node whose cores decode as fast as this host's.

Each rate is over a fixed number of steps after warm-up: the loader's workers started, and as many
batches taken as they had prefetched, before the clock starts; one shuffled stream of batches, so no
pass boundary stalls the workers (the steady rate of a long epoch). The stream runs on past the window by
as many batches as the workers keep prefetched, so they are as far ahead when the clock stops as when it
starts: the batches timed are, on the whole, decoded in the window. (Until 2026-11-27 it ended with the
window, so with many workers most of what was timed had been decoded before the clock started.)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_data
from torchrun_ddp import Encoded

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
FULL_SPEED = 0.95  # a fed rate at least this share of the ceiling counts as keeping the GPU busy


def _photos_part(args: tuple[int, int, int]) -> pa.Table:
    rows, seed, size = args
    return make_data.make_photos(rows, seed, size)


def photos(path: Path, rows: int, size: int) -> Path:
    """``rows`` JPEGs made on every core (bench/make_data.py's photos, one seed per part), one Parquet file."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = max(1, min(os.cpu_count() or 1, rows // 250))
    with multiprocessing.get_context("spawn").Pool(parts) as pool:
        tables = pool.map(_photos_part, [(rows // parts, seed, size) for seed in range(parts)])
    table = pa.concat_tables(tables)
    pq.write_table(table.replace_schema_metadata(tables[0].schema.metadata), path)
    return path


class Step:
    """One training step of ``model`` on a uint8 NHWC batch, as bench/plain_loop.py takes it."""

    def __init__(self, model: str, classes: int) -> None:
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        torch.backends.cudnn.benchmark = True
        net = torchvision.models.get_model(model, weights=None, num_classes=classes).to(self.device)
        self.net = net.to(memory_format=torch.channels_last) if self.cuda else net
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
        self.mean, self.std = MEAN.to(self.device), STD.to(self.device)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        x = images.permute(0, 3, 1, 2).float().sub_(self.mean).div_(self.std)
        x = x.contiguous(memory_format=torch.channels_last) if self.cuda else x.contiguous()
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = F.cross_entropy(self.net(x).float(), labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def cpu_seconds() -> dict[int, float]:
    """CPU seconds of this process and each live descendant (the loader's workers), by pid: a window's
    cost is the growth of these, not the time of earlier loaders' workers reaped meanwhile."""
    me = psutil.Process()
    out = {}
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    return out


def timed(batches: Any, steps: int, warmup: int, step: Any, sync: Any) -> dict[str, float]:
    """images/s and cores (this process and its loader workers) over ``steps`` steps after ``warmup``."""
    for _ in range(warmup):
        step(*next(batches))
    sync()
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    n = 0
    for _ in range(steps):
        images, labels = next(batches)
        step(images, labels)
        n += images.shape[0]
    sync()
    seconds = time.perf_counter() - t0
    used = sum(t - cpu0.get(pid, 0.0) for pid, t in cpu_seconds().items())
    return {"images_per_s": n / seconds, "cores": used / seconds, "seconds": seconds}


PREFETCH = 4  # batches each worker keeps ready


def batches(data: Path, workers: int, size: int, batch: int, steps: int, pin: bool) -> Iterator[Any]:
    """``steps`` shuffled batches as one iterator (a new permutation each time the data runs out), so no
    pass boundary stalls the workers: the steady rate, which is what a long epoch runs at."""
    ds = Encoded(str(data), size, 0.0, "crop-flip")  # the torchrun peer's dataset, raytrain's decode
    sampler = RandomSampler(ds, num_samples=steps * batch)
    return iter(DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers, prefetch_factor=PREFETCH,
                           pin_memory=pin, drop_last=True))  # fmt: skip


def measure(a: argparse.Namespace) -> dict[str, Any]:
    data = photos(a.workdir / f"photos{a.image_size}-{a.rows}.parquet", a.rows, a.image_size)
    res: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "host_cores": os.cpu_count(),
        "torch": torch.__version__,
        "batch": a.batch_size,
        "image_size": a.image_size,
        "loader": {},
        "models": {},
    }
    for k in a.workers:  # the loader alone: its rate and the cores it takes, once what it had ready is taken
        warmup = max(a.warmup, k * PREFETCH)
        it = batches(data, k, a.image_size, a.batch_size, warmup + a.steps + k * PREFETCH, pin=False)
        r = timed(it, a.steps, warmup, lambda *_: None, lambda: None)
        del it  # its workers stop now, not while the next measurement runs
        res["loader"][str(k)] = r
        print(f"loader, {k} workers: {r['images_per_s']:.0f} img/s on {r['cores']:.2f} cores", flush=True)
    for name, rate in a.ceiling:  # measured on a GPU elsewhere: the model's only, nothing fed here
        res["models"][name] = {"ceiling": {"images_per_s": rate, "given": True}, "fed": {}}
    for model in [] if a.loader_only else a.models:
        step = Step(model, classes=10)
        shape = (a.batch_size, a.image_size, a.image_size, 3)
        fixed = (torch.randint(0, 256, shape, dtype=torch.uint8, device=step.device),
                 torch.randint(0, 10, (a.batch_size,), device=step.device))  # fmt: skip
        ceiling = timed(itertools.repeat(fixed), a.steps, a.warmup, step, step.sync)
        out: dict[str, Any] = {"ceiling": ceiling, "fed": {}}
        print(f"{model}: ceiling {ceiling['images_per_s']:.0f} img/s", flush=True)
        for k in a.workers:
            warmup = max(a.warmup, k * PREFETCH)
            it = batches(data, k, a.image_size, a.batch_size, warmup + a.steps + k * PREFETCH, pin=step.cuda)
            r = timed(it, a.steps, warmup, step, step.sync)
            del it
            out["fed"][str(k)] = r
            print(f"{model}, {k} workers: {r['images_per_s']:.0f} img/s", flush=True)
        res["models"][model] = out
    return summarise(res)


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    per_core = statistics.median(r["images_per_s"] / max(r["cores"], 1e-9) for r in res["loader"].values())
    res["loader_images_per_s_per_core"] = per_core
    for m in res["models"].values():
        ceiling = m["ceiling"]["images_per_s"]
        m["cores_model"] = ceiling / per_core
        enough = [int(k) for k, r in m["fed"].items() if r["images_per_s"] >= FULL_SPEED * ceiling]
        m["cores_measured"] = min(enough) if enough else None
    return res


def markdown(res: dict[str, Any]) -> str:
    ks = list(res["loader"])
    lines = [
        f"{res['gpu']}, {res['host_cores']} host cores, torch {res['torch']}; {res['image_size']} px, batch "
        f"{res['batch']}, bf16, channels_last; JPEG decode + crop-flip by DataLoader workers: "
        f"{res['loader_images_per_s_per_core']:.0f} img/s per core (median over k).",
        "",
        "| img/s | " + " | ".join(f"k={k}" for k in ks) + " | ceiling | cores per GPU: model / measured |",
        "|---|" + "---|" * len(ks) + "---|---|",
        "| loader alone | " + " | ".join(f"{res['loader'][k]['images_per_s']:.0f}" for k in ks) + " | | |",
    ]
    for name, m in res["models"].items():
        fed = " | ".join(f"{m['fed'][k]['images_per_s']:.0f}" if k in m["fed"] else "" for k in ks)
        if m["ceiling"].get("given"):  # nothing fed here: the model's column only
            label, measured = f"{name} (ceiling given)", "-"
        else:
            enough = m["cores_measured"]
            label, measured = f"{name}, fed", enough if enough is not None else f"> {ks[-1]}"
        lines.append(f"| {label} | {fed} | {m['ceiling']['images_per_s']:.0f} | "
                     f"{m['cores_model']:.1f} / {measured} |")  # fmt: skip
    return "\n".join(lines)


def _ceiling(text: str) -> tuple[str, float]:
    name, _, number = text.partition("=")
    try:
        rate = float(number)
    except ValueError:
        rate = math.nan
    if not name or not math.isfinite(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODEL=IMAGES_PER_S, e.g. resnet50=4656")
    return name, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"])
    ap.add_argument("--workers", nargs="+", type=int, default=[2, 4, 6, 8, 10, 14])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the code on a CPU")
    ap.add_argument("--loader-only", action="store_true", help="no model trained: the loader alone, on any host")
    ap.add_argument("--ceiling", type=_ceiling, action="append", default=[], metavar="MODEL=IMAGES_PER_S",
                    help="a ceiling measured on a GPU, to model its cores per GPU from this host's loader")  # fmt: skip
    a = ap.parse_args()
    if a.smoke:
        a.models, a.workers, a.rows, a.image_size, a.batch_size, a.steps, a.warmup = (
            ["resnet18"], [1, 2], 300, 64, 16, 20, 2)  # fmt: skip
    elif not torch.cuda.is_available() and not a.loader_only:
        raise SystemExit("bench/cores_per_gpu.py: no CUDA GPU here; run it on a GPU node, or --smoke to check it")
    clash = {name for name, _ in a.ceiling} & set([] if a.loader_only else a.models)
    if clash:
        ap.error(f"--ceiling {', '.join(sorted(clash))}: measured here too; give ceilings with --loader-only")
    res = measure(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(markdown(res))


if __name__ == "__main__":
    main()
