"""The Ray Data pipeline that feeds training: read Parquet, split, shuffle, decode, batch.

The driver builds the datasets (lazily; nothing runs until workers iterate). Ray Train splits each one
into equal, disjoint per-worker shards every epoch (``streaming_split(equal=True)``: at most
``world_size - 1`` rows of an epoch are left out to keep ranks in step, different rows each epoch since
the order changes). The training set is reshuffled globally every epoch because each epoch re-executes
the plan, ``random_shuffle`` included.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from raytrain.data import images
from raytrain.data.source import IMAGE, LABEL, DataSource

if TYPE_CHECKING:
    import ray.data
    import torch

TRAIN, VAL = "train", "val"
_BUCKETS = 10_000


def _hash_split(batch: pa.Table, *, keep: str, val_fraction: float) -> pa.Table:
    """Keep the rows of one side of a split decided by a hash of the image bytes.

    Stateless and deterministic: the same image always lands on the same side, in every epoch, on every
    node and in every later run, without materialising or counting the dataset.
    """
    cut = int(val_fraction * _BUCKETS)
    in_val = np.fromiter(
        (zlib.crc32(b) % _BUCKETS < cut for b in batch.column(IMAGE).to_pylist()), dtype=bool, count=len(batch)
    )
    return batch.filter(pa.array(in_val if keep == VAL else ~in_val))


def _decode(batch: pa.Table, *, size: int) -> dict[str, np.ndarray]:
    return {
        IMAGE: images.decode_many(batch.column(IMAGE).to_pylist(), size),
        LABEL: batch.column(LABEL).to_numpy().astype(np.int64),
    }


def build(src: DataSource, *, image_size: int, val_fraction: float) -> dict[str, ray.data.Dataset]:
    """Training and validation datasets of ``{"image": uint8[N,S,S,3], "label": int64[N]}`` batches."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False

    def read(files: tuple[str, ...]) -> ray.data.Dataset:
        return ray.data.read_parquet(list(files), filesystem=src.filesystem, columns=[IMAGE, LABEL])

    if src.val_files:
        train, val = read(src.train_files), read(src.val_files)
    else:
        base = read(src.train_files)
        split: dict[str, Any] = {"batch_format": "pyarrow", "zero_copy_batch": True}
        train = base.map_batches(_hash_split, fn_kwargs={"keep": TRAIN, "val_fraction": val_fraction}, **split)
        val = base.map_batches(_hash_split, fn_kwargs={"keep": VAL, "val_fraction": val_fraction}, **split)
    decode: dict[str, Any] = {"fn_kwargs": {"size": image_size}, "batch_format": "pyarrow", "batch_size": 256}
    return {
        TRAIN: train.random_shuffle().map_batches(_decode, **decode),
        VAL: val.map_batches(_decode, **decode),
    }


def batches(
    shard: Any, *, batch_size: int, device: torch.device, prefetch: int = 2
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images uint8 NHWC, labels int64) on the worker's device, from its shard of the current epoch."""
    import torch

    for batch in shard.iter_torch_batches(
        batch_size=batch_size,
        dtypes={IMAGE: torch.uint8, LABEL: torch.int64},
        device=device,
        prefetch_batches=prefetch,
        pin_memory=device.type == "cuda",
    ):
        yield batch[IMAGE], batch[LABEL]
