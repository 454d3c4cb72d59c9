"""Ingest alone: raytrain's Ray Data pipeline against a torch DataLoader over the same Parquet.

    python bench/ingest.py DATA.parquet [--passes 3] [--cpus 2] --out ingest.json

Both decode the same PNGs to 32x32 uint8 batches of 64 with a global shuffle each pass and the same
number of CPUs (Ray Data tasks vs DataLoader worker processes); a single consumer takes the batches
as torch tensors. Reports time to first batch and images/s per pass, and raytrain's in-memory mode
(decoded once, then streamed from the object store) for reference.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

BATCH = 64


class ParquetImages(Dataset[tuple[torch.Tensor, int]]):
    """Encoded images held in memory (a Parquet read), decoded per item in the loader's workers."""

    def __init__(self, path: str, size: int) -> None:
        table = pq.read_table(path, columns=["image", "label"])
        self.blobs = table.column("image").to_pylist()
        self.labels = table.column("label").to_pylist()
        self.size = size

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = Image.open(io.BytesIO(self.blobs[i])).convert("RGB").resize((self.size, self.size))
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()), self.labels[i]


def timed_pass(batches: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    first, n = None, 0
    for batch in batches:
        images = batch["image"] if isinstance(batch, dict) else batch[0]
        n += images.shape[0]
        if first is None:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"first_batch_s": first or total, "images": n, "images_per_s": n / total, "seconds": total}


def dataloader(path: str, passes: int, cpus: int) -> list[dict[str, float]]:
    ds = ParquetImages(path, 32)
    out = []
    for _ in range(passes):
        loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=cpus)
        out.append(timed_pass(loader))
    return out


def raytrain_pipeline(path: str, passes: int, memory_budget: int) -> list[dict[str, float]]:
    from raytrain.recipe.data import pipeline, source

    src = source.inspect(path)
    data = pipeline.build(src, image_size=32, val_fraction=1e-9, batch_size=BATCH, memory_budget=memory_budget)
    out = []
    for _ in range(passes):
        it = data.train.iter_torch_batches(batch_size=BATCH, local_shuffle_buffer_size=data.shuffle_buffer)
        out.append(timed_pass(it))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    random.seed(0)
    torch.set_num_threads(1)
    from raytrain.service import cluster

    # raytrain's own private local Ray (token auth, 0700 temp dir), as `raytrain fit` starts it.
    with cluster.connect(dashboard=False):
        result = {
            "dataloader": dataloader(a.data, a.passes, a.cpus),
            "raytrain_streamed": raytrain_pipeline(a.data, a.passes, memory_budget=0),
            "raytrain_in_memory": raytrain_pipeline(a.data, a.passes, memory_budget=2**40),
        }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, runs in result.items():
        print(name, [f"{r['images_per_s']:.0f} img/s, first {r['first_batch_s']:.2f} s" for r in runs])


if __name__ == "__main__":
    main()
