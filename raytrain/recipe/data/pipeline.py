"""The Ray Data pipeline that feeds training: read Parquet, split, shuffle, decode, batch.

Ray Train splits each dataset into equal, disjoint per-worker shards every epoch
(``streaming_split(equal=True)``: at most ``world_size - 1`` rows of an epoch are left out to keep ranks
in step, different rows each epoch since the order changes). Two modes:

- in memory, when the decoded data fits in a quarter of the cluster's object store (``memory_budget``):
  read, split, decode and shuffle once, keep the result as small blocks in the object store, and each
  epoch only randomise the block order (plus a per-worker shuffle buffer). No file reads, decodes or
  all-to-all shuffles after the first pass, so small datasets do not pay Ray Data's per-epoch start-up.
- streamed otherwise: every epoch re-executes read, split, a global ``random_shuffle`` and decode, so
  data of any size and any on-disk order (sorted by class, say) is reshuffled across the whole set.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raytrain.recipe.data import augment, images, source
from raytrain.recipe.data.source import IMAGE, LABEL, DataSource

if TYPE_CHECKING:
    import ray.data
    import torch

TRAIN, VAL = "train", "val"
# Decoded batches carry this column too: False where the image could not be decoded or the label is null.
# Such rows keep their place in the batch (a black image, label 0) so every rank steps alike; training
# leaves them out of the loss and the metrics, and counts them.
VALID = "valid"
# And this one: a 64-bit id of each row's image bytes (CRC32 and Adler-32), so that a run preempted in the
# middle of an epoch can resume with exactly the rows that epoch has not trained yet (``build(trained=)``).
ROW_ID = "row_id"
TRAIN_REST = "train_rest"  # the rest of a preempted epoch: training rows minus those already trained
_BUCKETS = 10_000
NO_AUGMENT = augment.Augment(preset="none")


def hash_split(batch: pa.Table, *, keep: str, val_fraction: float) -> pa.Table:
    """Keep the rows of one side of a split decided by a hash of the image bytes.

    Stateless and deterministic: the same image always lands on the same side, in every epoch, on every
    node and in every later run, without materialising or counting the dataset.
    """
    cut = int(val_fraction * _BUCKETS)
    in_val = np.fromiter(
        (zlib.crc32(b or b"") % _BUCKETS < cut for b in batch.column(IMAGE).to_pylist()), dtype=bool, count=len(batch)
    )
    return batch.filter(pa.array(in_val if keep == VAL else ~in_val))


def row_ids(blobs: list[bytes | None]) -> np.ndarray:
    """A 64-bit id per image (0 for a missing one), stable across epochs, nodes and runs."""
    ids = np.fromiter(
        ((zlib.crc32(b) << 32) | zlib.adler32(b) if b is not None else 0 for b in blobs),
        dtype=np.uint64,
        count=len(blobs),
    )
    return ids.view(np.int64)


def _untrained(batch: pa.Table, *, trained: np.ndarray) -> pa.Table:
    """The rows whose id is not among ``trained``."""
    ids = row_ids(batch.column(IMAGE).to_pylist())
    return batch.filter(pa.array(~np.isin(ids, trained)))


def decode(batch: pa.Table, *, size: int, aug: augment.Augment | None = None) -> dict[str, np.ndarray]:
    """Decoded rows: validation's resize and centre crop, or with ``aug`` the training augmentation."""
    blobs = batch.column(IMAGE).to_pylist()
    decoded, ok = images.decode_many(blobs, size, augment.per_image(aug, size) if aug and aug.active else None)
    labels = batch.column(LABEL)
    labelled = pc.is_valid(labels).to_numpy(zero_copy_only=False)
    return {
        IMAGE: decoded,
        LABEL: pc.fill_null(labels, 0).to_numpy().astype(np.int64),
        VALID: ok & labelled,
        ROW_ID: row_ids(blobs),
    }


def _augment_decoded(batch: dict[str, np.ndarray], *, size: int, aug: augment.Augment) -> dict[str, np.ndarray]:
    """The training augmentation of rows decoded (and kept in memory) at ``size``."""
    return {**batch, IMAGE: augment.arrays(batch[IMAGE], aug, size)}


# Rows per block of an in-memory training set: small blocks let the per-epoch block order mix rows.
_BLOCK_ROWS = 64
# Rows per block that Ray Data decodes when the data streams: one decoding task per block. Ray's Parquet
# reader packs row groups into blocks of up to 128 MiB, so a whole file of encoded images can arrive as one
# block, and one task would then decode all of it on one core (224 px JPEGs: 440 -> 640 images/s, BENCHMARKS).
_DECODE_ROWS = 256


@dataclass(frozen=True)
class Datasets:
    """The datasets Ray Train shards, and how workers should batch them."""

    train: ray.data.Dataset
    val: ray.data.Dataset
    in_memory: bool
    shuffle_buffer: int | None  # rows each worker shuffles locally (in-memory mode)
    rest: ray.data.Dataset | None = None  # the preempted epoch's untrained rows, to finish it with

    def for_trainer(self) -> dict[str, ray.data.Dataset]:
        return {TRAIN: self.train, VAL: self.val, **({TRAIN_REST: self.rest} if self.rest is not None else {})}


def train_rows(src: DataSource, val_fraction: float) -> int:
    """About how many rows the training split has: all of ``train/``, or the hash split's share."""
    return int(src.train_rows * (1.0 if src.val_files else 1.0 - val_fraction))


def decoded_bytes(src: DataSource, image_size: int) -> int:
    return (src.train_rows + src.val_rows) * (image_size * image_size * 3 + 16)


def fits_in_memory(src: DataSource, image_size: int, memory_budget: int) -> bool:
    """Whether ``build`` keeps the decoded data in the object store (else it streams every epoch)."""
    return decoded_bytes(src, image_size) <= memory_budget


def shuffle_buffer(batch_size: int) -> int:
    """Rows each worker shuffles locally when the data is kept in memory."""
    return 4 * batch_size


def epoch_seed(seed: int, epoch: int) -> int:
    """A seed keyed on an epoch as well (``seed`` itself for epoch 0). Ray Data numbers its executions
    from 0 in each driver, so a resumed attempt seeds its shuffles by the epoch it starts at: its epochs
    then get orders of their own, not a replay of the first epochs'."""
    return seed + (epoch << 32)


def build(
    src: DataSource,
    *,
    image_size: int,
    val_fraction: float,
    batch_size: int,
    memory_budget: int,
    aug: augment.Augment = NO_AUGMENT,
    seed: int | None = None,
    trained: np.ndarray | None = None,
) -> Datasets:
    """Training and validation datasets of ``{"image": uint8[N,S,S,3], "label": int64[N], "valid": bool[N],
    "row_id": int64[N]}`` batches.

    ``aug``: the training rows' augmentation (validation rows are resized and centre-cropped).
    ``seed``: the shuffles follow it and the epoch within the attempt (Ray Data reseeds on each
    execution); a resumed attempt passes ``epoch_seed(seed, epochs done)``. ``trained``: the row ids a preempted epoch
    already trained; ``rest`` then holds the others, shuffled by the same seed.
    """
    import ray.data
    from ray.data import RandomSeedConfig

    ray.data.DataContext.get_current().enable_progress_bars = False
    shuffle_seed = RandomSeedConfig(seed=seed, reseed_after_execution=True)

    arrow: dict[str, Any] = {"batch_format": "pyarrow", "zero_copy_batch": True}

    def read(files: tuple[str, ...]) -> ray.data.Dataset:
        cols = src.columns
        ds = ray.data.read_parquet(list(files), filesystem=src.filesystem, columns=[cols.image, cols.label])
        if cols.canonical:
            return ds
        return ds.map_batches(source.canonical, fn_kwargs={"columns": cols, "classes": src.classes}, **arrow)

    if src.val_files:
        train, val = read(src.train_files), read(src.val_files)
    else:
        base = read(src.train_files)
        train = base.map_batches(hash_split, fn_kwargs={"keep": TRAIN, "val_fraction": val_fraction}, **arrow)
        val = base.map_batches(hash_split, fn_kwargs={"keep": VAL, "val_fraction": val_fraction}, **arrow)
    decoding: dict[str, Any] = {
        "fn_kwargs": {"size": image_size},
        "batch_format": "pyarrow",
        "batch_size": _DECODE_ROWS,
    }
    untrained: dict[str, Any] = {"fn_kwargs": {"trained": trained}}
    if fits_in_memory(src, image_size, memory_budget):
        cached = train.map_batches(decode, **decoding).random_shuffle(seed=shuffle_seed)
        cached = cached.repartition(max(1, train_rows(src, val_fraction) // _BLOCK_ROWS)).materialize()

        def augmented(ds: ray.data.Dataset) -> ray.data.Dataset:
            if not aug.active:
                return ds
            return ds.map_batches(_augment_decoded, fn_kwargs={"size": image_size, "aug": aug}, batch_format="numpy")

        rest = None
        if trained is not None:
            rest = cached.map_batches(_decoded_untrained, **untrained, batch_format="numpy")
            rest = augmented(rest.randomize_block_order(seed=shuffle_seed))
        return Datasets(
            train=augmented(cached.randomize_block_order(seed=shuffle_seed)),
            val=val.map_batches(decode, **decoding).materialize(),
            in_memory=True,
            shuffle_buffer=shuffle_buffer(batch_size),
            rest=rest,
        )
    train_decoding = {**decoding, "fn_kwargs": {"size": image_size, "aug": aug}}
    rest = None
    if trained is not None:
        rest = train.map_batches(_untrained, **untrained, **arrow).random_shuffle(seed=shuffle_seed)
        rest = _in_blocks(rest).map_batches(decode, **train_decoding)
    return Datasets(
        train=_in_blocks(train.random_shuffle(seed=shuffle_seed)).map_batches(decode, **train_decoding),
        val=_in_blocks(val).map_batches(decode, **decoding),
        in_memory=False,
        shuffle_buffer=None,
        rest=rest,
    )


def _in_blocks(ds: ray.data.Dataset) -> ray.data.Dataset:
    """Streamed data in blocks of ``_DECODE_ROWS``, so that as many tasks decode it as there are CPUs."""
    return ds.repartition(target_num_rows_per_block=_DECODE_ROWS)


def _decoded_untrained(batch: dict[str, np.ndarray], *, trained: np.ndarray) -> dict[str, np.ndarray]:
    """The decoded rows whose id is not among ``trained``."""
    keep = ~np.isin(batch[ROW_ID], trained)
    return {k: v[keep] for k, v in batch.items()}


class Batch(NamedTuple):
    """One batch on the worker's device."""

    images: torch.Tensor  # uint8 NHWC
    labels: torch.Tensor  # int64
    valid: torch.Tensor  # bool: False for a row left out (undecodable image, null label)
    ids: torch.Tensor  # int64 row ids


def batches(
    shard: Any,
    *,
    batch_size: int,
    device: torch.device,
    shuffle_buffer: int | None = None,
    shuffle_seed: int | None = None,
    prefetch: int = 2,
) -> Iterator[Batch]:
    """Batches on the worker's device, from its shard of the current epoch (shuffled locally, in memory
    mode, by ``shuffle_seed``)."""
    import torch

    for batch in shard.iter_torch_batches(
        batch_size=batch_size,
        local_shuffle_buffer_size=shuffle_buffer,
        local_shuffle_seed=shuffle_seed if shuffle_buffer else None,
        dtypes={IMAGE: torch.uint8, LABEL: torch.int64, VALID: torch.bool, ROW_ID: torch.int64},
        device=device,
        prefetch_batches=prefetch,
        pin_memory=device.type == "cuda",
    ):
        yield Batch(batch[IMAGE], batch[LABEL], batch[VALID], batch[ROW_ID])
