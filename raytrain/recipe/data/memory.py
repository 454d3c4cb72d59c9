"""Data that fits in memory, held by the training ranks themselves: read and decoded once, reshuffled every
epoch, with no Ray Data process at all.

Ray Data would start, for a dataset of a few thousand images, Parquet footer readers, read and decode
tasks, a shuffle, a split coordinator (for several ranks), a dataset manager and its stats actors: some
twenty new processes that cost more CPU before the first step than the data's decoding does (BENCHMARKS.md,
"Start-up"). When the decoded images fit the memory budget (``pipeline.fits_in_memory``) the recipe loads
them this way instead:

- every rank streams the files' row groups once and keeps its share: the training rows are dealt in rounds
  of ``world`` consecutive rows, one to each rank in a random order (seeded by ``--seed``), so every share
  has exactly ``rows // world`` or one more, spread over every file and every part of it (data sorted by
  class trains as well as shuffled data); validation rows go round-robin;
- it decodes its share once, with as many threads as it has CPUs (Pillow decodes outside the GIL);
- every epoch it trains ``rows // world`` rows of its share in a new order (seeded by the seed, the epoch
  and the rank), cut into batches, augmented and handed to the device by a prefetching thread.

Shares stay put for the run: no data moves between ranks, and each step's global batch is a stratified
sample of the whole set. A preempted epoch goes on with exactly the rows it had not trained (``trained``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from raytrain.recipe.data import augment
from raytrain.recipe.data.pipeline import NO_AUGMENT, ROW_ID, VALID, Batch, decode, in_val
from raytrain.recipe.data.prefetch import prefetched
from raytrain.recipe.data.source import IMAGE, LABEL, DataSource, Unit, read_unit

if TYPE_CHECKING:
    import torch

_DECODE_ROWS = 256  # rows one decoding thread takes at a time
PREFETCH = 2  # batches made ahead of the training step


@dataclass(frozen=True)
class Spec:
    """What every rank needs to load its share (the driver makes it; it travels in the loop config)."""

    src: DataSource
    image_size: int
    val_fraction: float
    seed: int  # the run's --seed: deals the shares and orders the epochs
    aug: augment.Augment = NO_AUGMENT


@dataclass(frozen=True)
class Rows:
    """Decoded rows: uint8[N, S, S, 3] images, int64 labels, bool valid, int64 row ids."""

    images: np.ndarray
    labels: np.ndarray
    valid: np.ndarray
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def of(cls, decoded: dict[str, np.ndarray]) -> Rows:
        return cls(decoded[IMAGE], decoded[LABEL], decoded[VALID], decoded[ROW_ID])


@dataclass(frozen=True)
class Share:
    """One rank's rows, and how many training rows every rank trains each epoch."""

    train: Rows
    val: Rows
    epoch_rows: int  # the whole training split's rows // world: the same on every rank


class _Dealer:
    """Deals a stream of rows to ``world`` ranks: each round of ``world`` consecutive rows gives one to each
    rank, in an order drawn by ``seed``; the same on every rank, whatever the row groups' sizes."""

    def __init__(self, seed: int, world: int) -> None:
        self._rng = np.random.default_rng([seed, world])
        self._world = world
        self._left = np.empty(0, dtype=np.int64)

    def take(self, n: int) -> np.ndarray:
        """The ranks of the next ``n`` rows."""
        if n > len(self._left):
            rounds = -(-(n - len(self._left)) // self._world)
            more = self._rng.permuted(np.tile(np.arange(self._world), (rounds, 1)), axis=1).ravel()
            self._left = np.concatenate([self._left, more])
        out, self._left = self._left[:n], self._left[n:]
        return out


def _row_groups(src: DataSource, units: tuple[Unit, ...]) -> Iterator[pa.Table]:
    """Every row group of ``units`` as canonical ``image``/``label`` columns, in order (``read_unit``: a
    file that cannot be read fails the run at once, naming it)."""
    for unit in units:
        yield from read_unit(src.filesystem, unit, src.columns, src.classes)


def _decoded(parts: list[pa.Table], size: int, threads: int) -> Rows:
    """``parts`` decoded at ``size`` (resized and centre-cropped), in order, by ``threads`` threads."""
    empty = pa.table({IMAGE: pa.array([], pa.binary()), LABEL: pa.array([], pa.int64())})
    table = pa.concat_tables(parts) if parts else empty
    chunks = [table.slice(i, _DECODE_ROWS) for i in range(0, max(len(table), 1), _DECODE_ROWS)]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        out = list(pool.map(lambda chunk: decode(chunk, size=size), chunks))
    return Rows.of({k: np.concatenate([o[k] for o in out]) for k in out[0]})


def load(spec: Spec, rank: int, world: int, *, threads: int = 1, train: bool = True) -> Share:
    """This rank's share of the data, decoded (``train=False``: the validation rows only)."""
    src = spec.src
    dealer = _Dealer(spec.seed, world)
    mine_train: list[pa.Table] = []
    mine_val: list[pa.Table] = []
    train_rows = val_seen = 0

    def keep_val(table: pa.Table) -> None:
        nonlocal val_seen
        ordinal = val_seen + np.arange(len(table))
        mine_val.append(table.filter(pa.array(ordinal % world == rank)))
        val_seen += len(table)

    for table in _row_groups(src, src.train_units):
        if src.val_files:
            is_val = np.zeros(len(table), dtype=bool)
        else:
            is_val = in_val(table.column(IMAGE).to_pylist(), spec.val_fraction)
            keep_val(table.filter(pa.array(is_val)))
        training = table.filter(pa.array(~is_val))
        train_rows += len(training)
        if train:
            mine_train.append(training.filter(pa.array(dealer.take(len(training)) == rank)))
    for table in _row_groups(src, src.val_units):
        keep_val(table)
    size = spec.image_size
    return Share(
        train=_decoded(mine_train, size, threads),
        val=_decoded(mine_val, size, threads),
        epoch_rows=train_rows // world,
    )


def epoch_order(share: Share, *, seed: int, epoch: int, rank: int, trained: np.ndarray | None = None) -> np.ndarray:
    """The order this rank trains its share in epoch ``epoch`` (counted from 0): all of it, or the rows
    not in ``trained`` (the rest of a preempted epoch). The caller cuts every rank's to the same length."""
    order = np.random.default_rng([seed, epoch, rank]).permutation(len(share.train))
    if trained is not None:
        order = order[~np.isin(share.train.ids[order], trained)]
    return order


def batches(
    rows: Rows,
    order: np.ndarray,
    *,
    batch_size: int,
    device: torch.device,
    aug: augment.Augment | None = None,
    seed: tuple[int, ...] = (0,),
    threads: int = 1,
) -> Iterator[Batch]:
    """``rows`` in ``order``, in batches on ``device``, made (and with ``aug``, augmented) ``PREFETCH``
    batches ahead by a thread of their own; ``seed`` keys the augmentation's randomness."""
    import torch

    size = rows.images.shape[1] if len(rows) else 0
    pin = device.type == "cuda"
    pool = ThreadPoolExecutor(max_workers=threads) if aug is not None and aug.active and threads > 1 else None

    def augmented(images: np.ndarray, key: tuple[int, ...]) -> np.ndarray:
        assert aug is not None
        if pool is None:
            return augment.arrays(images, aug, size, rng=np.random.default_rng(key))
        parts = np.array_split(images, threads)
        done = pool.map(
            lambda i: augment.arrays(parts[i], aug, size, rng=np.random.default_rng((*key, i))), range(len(parts))
        )
        return np.concatenate(list(done))

    def made() -> Iterator[tuple[torch.Tensor, ...]]:
        for n, at in enumerate(range(0, len(order), batch_size)):
            idx = order[at : at + batch_size]
            images = rows.images[idx]
            if aug is not None and aug.active:
                images = augmented(images, (*seed, n))
            tensors = tuple(
                torch.from_numpy(np.ascontiguousarray(a))
                for a in (images, rows.labels[idx], rows.valid[idx], rows.ids[idx])
            )
            yield tuple(t.pin_memory() for t in tensors) if pin else tensors

    try:
        for images, labels, valid, ids in prefetched(made(), PREFETCH, device):
            yield Batch(*(t.to(device, non_blocking=pin) for t in (images, labels, valid, ids)))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


@dataclass
class Feed:
    """The recipe's batches from a rank's share: each epoch's training order, and the validation rows."""

    share: Share
    rank: int
    seed: int
    batch_size: int
    device: torch.device
    aug: augment.Augment
    agree: Callable[[int], int]  # the smallest of a number over all ranks (a collective)
    trained: np.ndarray | None = None  # the row ids a preempted epoch trained before this attempt
    threads: int = 1

    def train(self, epoch: int, rest: bool = False) -> Iterator[Batch]:
        """Epoch ``epoch`` (from 0): ``epoch_rows`` rows of the share in a new order; with ``rest``, the rows
        of it that an earlier attempt did not train (as many on every rank: a collective)."""
        trained = self.trained if rest else None
        order = epoch_order(self.share, seed=self.seed, epoch=epoch, rank=self.rank, trained=trained)
        rows = self.share.epoch_rows if trained is None else min(self.share.epoch_rows, self.agree(len(order)))
        return batches(
            self.share.train,
            order[:rows],
            batch_size=self.batch_size,
            device=self.device,
            aug=self.aug,
            seed=(self.seed, epoch, self.rank),
            threads=self.threads,
        )

    def val(self) -> Iterator[Batch]:
        val = self.share.val
        return batches(val, np.arange(len(val)), batch_size=self.batch_size, device=self.device)

    def ahead(self, epoch: int) -> None:
        """Nothing to start: an epoch's batches are cut from the share as they are read."""

    def leave(self) -> None:
        """Nothing runs beside a pass: an epoch's batches are cut from the share as they are read."""
