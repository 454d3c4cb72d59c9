"""The Ray Data pipeline that feeds training when the data does not fit in memory: read Parquet, split,
shuffle, decode, batch.

Every epoch re-executes read, split, a global ``random_shuffle`` and decode, so data of any size and any
on-disk order (sorted by class, say) is reshuffled across the whole set, and Ray Train splits it into equal,
disjoint per-worker shards (``streaming_split(equal=True)``: at most ``world_size - 1`` rows of an epoch are
left out to keep ranks in step, different rows each epoch since the order changes). Data whose decoded
images fit the memory budget (``fits_in_memory``) is held by the ranks themselves instead, with no Ray
Data process at all (``raytrain.recipe.data.memory``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raytrain.errors import Fatal
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


def in_val(blobs: list[bytes | None], val_fraction: float) -> np.ndarray:
    """Which rows the hash split holds out for validation: decided by a hash of the image bytes alone.

    Stateless and deterministic: the same image always lands on the same side, in every epoch, on every
    node and in every later run, without materialising or counting the dataset.
    """
    cut = int(val_fraction * _BUCKETS)
    return np.fromiter((zlib.crc32(b or b"") % _BUCKETS < cut for b in blobs), dtype=bool, count=len(blobs))


def hash_split(batch: pa.Table, *, keep: str, val_fraction: float) -> pa.Table:
    """Keep the rows of one side of the hash split (``in_val``)."""
    held_out = in_val(batch.column(IMAGE).to_pylist(), val_fraction)
    return batch.filter(pa.array(held_out if keep == VAL else ~held_out))


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


# Rows per block that Ray Data decodes: one decoding task per block. Ray's Parquet reader packs row groups
# into blocks of up to 128 MiB, so a whole file of encoded images can arrive as one block, and one task
# would then decode all of it on one core (224 px JPEGs: 440 -> 640 images/s, BENCHMARKS).
_DECODE_ROWS = 256


@dataclass(frozen=True)
class Datasets:
    """The datasets Ray Train shards."""

    train: ray.data.Dataset
    val: ray.data.Dataset
    rest: ray.data.Dataset | None = None  # the preempted epoch's untrained rows, to finish it with

    def for_trainer(self) -> dict[str, ray.data.Dataset]:
        return {TRAIN: self.train, VAL: self.val, **({TRAIN_REST: self.rest} if self.rest is not None else {})}


def train_rows(src: DataSource, val_fraction: float) -> int:
    """About how many rows the training split has: all of ``train/``, or the hash split's share."""
    return int(src.train_rows * (1.0 if src.val_files else 1.0 - val_fraction))


def decoded_bytes(src: DataSource, image_size: int) -> int:
    return (src.train_rows + src.val_rows) * (image_size * image_size * 3 + 16)


def fits_in_memory(src: DataSource, image_size: int, memory_budget: int) -> bool:
    """Whether the ranks hold the decoded data themselves (``memory``), else it streams every epoch."""
    return decoded_bytes(src, image_size) <= memory_budget


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
    aug: augment.Augment = NO_AUGMENT,
    seed: int | None = None,
    trained: np.ndarray | None = None,
) -> Datasets:
    """Training and validation datasets of ``{"image": uint8[N,S,S,3], "label": int64[N], "valid": bool[N],
    "row_id": int64[N]}`` batches, streamed: every epoch reads, shuffles and decodes again.

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
    train_decoding = {**decoding, "fn_kwargs": {"size": image_size, "aug": aug}}
    rest = None
    if trained is not None:
        rest = train.map_batches(_untrained, fn_kwargs={"trained": trained}, **arrow).random_shuffle(seed=shuffle_seed)
        rest = _in_blocks(rest).map_batches(decode, **train_decoding)
    return Datasets(
        train=_in_blocks(train.random_shuffle(seed=shuffle_seed)).map_batches(decode, **train_decoding),
        val=_in_blocks(val).map_batches(decode, **decoding),
        rest=rest,
    )


def _in_blocks(ds: ray.data.Dataset) -> ray.data.Dataset:
    """Streamed data in blocks of ``_DECODE_ROWS``, so that as many tasks decode it as there are CPUs."""
    return ds.repartition(target_num_rows_per_block=_DECODE_ROWS)


class Batch(NamedTuple):
    """One batch on the worker's device."""

    images: torch.Tensor  # uint8 NHWC
    labels: torch.Tensor  # int64
    valid: torch.Tensor  # bool: False for a row left out (undecodable image, null label)
    ids: torch.Tensor  # int64 row ids


def batches(shard: Any, *, batch_size: int, device: torch.device, prefetch: int = 2) -> Iterator[Batch]:
    """Batches on the worker's device, from its Ray Data shard of the current epoch. Parquet that cannot be
    read (a damaged page, a file changed or removed since the check: Ray Data's read task raised) fails the
    run at once, as no retry of the workers could read it either (``raytrain.Fatal``)."""
    import torch

    try:
        for batch in shard.iter_torch_batches(
            batch_size=batch_size,
            dtypes={IMAGE: torch.uint8, LABEL: torch.int64, VALID: torch.bool, ROW_ID: torch.int64},
            device=device,
            prefetch_batches=prefetch,
            pin_memory=device.type == "cuda",
        ):
            yield Batch(batch[IMAGE], batch[LABEL], batch[VALID], batch[ROW_ID])
    except (pa.ArrowException, OSError) as exc:  # Ray's task error is also an instance of the error it carries
        raise Fatal(source.unreadable(None, exc)) from None


class ShardFeed:
    """The recipe's batches from Ray Train's shards of the streamed datasets. Asking for the shards here, as
    the worker starts, lets Ray start their split coordinators while the worker builds its model."""

    def __init__(self, *, batch_size: int, device: torch.device, train: bool, rest: bool) -> None:
        import ray.train

        self._batch_size, self._device = batch_size, device
        self._train = ray.train.get_dataset_shard(TRAIN) if train else None
        self._rest = ray.train.get_dataset_shard(TRAIN_REST) if rest else None
        self._val = ray.train.get_dataset_shard(VAL)

    def train(self, epoch: int, rest: bool = False) -> Iterator[Batch]:
        """This rank's shard of the epoch (Ray Data reshuffles every epoch), or of a preempted epoch's rest."""
        shard = self._rest if rest else self._train
        assert shard is not None, "no such dataset was given to the trainer"
        return batches(shard, batch_size=self._batch_size, device=self._device)

    def val(self) -> Iterator[Batch]:
        return batches(self._val, batch_size=self._batch_size, device=self._device)
