"""The Ray Data pipeline that feeds training when the data does not fit in memory: row groups in a new order every
epoch, their rows mixed a window at a time, decoded, batched.

Every epoch re-executes the reads and the decoding. Nothing waits for the whole set (no global shuffle, whose
barrier held the first batch back and left cores idle, BENCHMARKS.md): the files' row groups come in a new
order, each task draws several, mixes their rows ``_MIX_ROWS`` at a time (large groups a slice of each in turn)
and decodes them, handing on a block of ``_DECODE_ROWS`` rows as soon as it is decoded; Ray Data runs as many
such tasks as it has CPUs, within its back-pressure. It is not a global shuffle: rows stored sorted by class
reach a batch from the few groups a task drew (``raytrain prepare`` writes rows in a random order). Ray Train
splits the stream into equal, disjoint per-worker shards (``streaming_split(equal=True)``: at most
``world_size - 1`` rows of an epoch are left out to keep ranks in step, different rows each epoch since the
order changes); the recipe's run of one worker reads each dataset whole (``trainer.data_config``).
Data whose decoded images fit the memory budget (``fits_in_memory``) is held by the ranks themselves instead,
with no Ray Data process at all (``raytrain.recipe.data.memory``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raytrain.recipe.data import augment, idle, images, source
from raytrain.recipe.data.idle import IDLE, NORMAL
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
# middle of an epoch can resume with exactly the rows that epoch has not trained yet (``Streams.rest``).
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


# Rows a task decodes and hands on at a time: each such block leaves the task as soon as it is decoded (the
# datasets' block size is set to match), so the first batch waits for one block, not for the task's end.
_DECODE_ROWS = 256
# Rows a task mixes before decoding them: the row groups it reads (drawn in a new order every epoch), their
# rows in a random order. Bounded memory: a task holds about this many encoded images.
_MIX_ROWS = 2048
# Tasks an epoch offers each CPU Ray Data has for it, at least: small data is drawn in smaller shares, so that
# every CPU has a task to run and none waits long for the last one.
_TASKS_PER_CPU = 2
# Keys ordered with the row groups every epoch, carrying no rows: where a task draws several items, which
# salts it draws changes every epoch, and with it the mixing of its read.
_SALTS = 8
# A column of the drawn items: a number for each, new every epoch (Ray Data's ``random`` expression, which it
# reseeds each execution of the dataset, from the seed where there is one). It seeds the mixing of each read
# too, so that a draw of the same groups every epoch (a draw of one item, where groups are few) is mixed anew.
_PASS_DRAW = "pass_draw"
# The fewest row groups a task draws, however large they are (read a window at a time): which groups and
# keys it draws changes every epoch, and so does the order it mixes them in.
_MIN_DRAW = 4
# The narrowest draw a large pass is cut into, as a share of a whole one (``draw_size``).
_NARROWEST = 0.75


def draw_size(units: tuple[source.Unit, ...], data_cpus: int, salts: int = 0) -> int:
    """How many items (row groups, and the ``salts`` keys shuffled among them) one task draws: enough for
    ``_MIX_ROWS`` rows, fewer where that would leave some of the ``data_cpus`` CPUs without a task
    (``_TASKS_PER_CPU`` each), and at least ``_MIN_DRAW`` unless that too would (then down to one group a
    task: a task decodes its groups one block after another).

    Data that fills whole draws, with more than one CPU, takes the draw whose pass ends soonest (``pass_items``;
    the larger on a tie, for the wider mix) from a whole one down to ``_NARROWEST`` of it (and not under
    ``_MIN_DRAW``): Ray Data starts a task as a CPU frees up, so a last round of fewer tasks than CPUs, or one
    long task, decoded alone at the end of every pass while the other CPUs waited (BENCHMARKS.md, ingest item
    13). The floor bounds what the mix gives up for it: a task mixes at least that share of ``_MIX_ROWS``."""
    cpus = max(1, data_cpus)
    draw, whole = share_draw(units, cpus)
    if not whole or cpus == 1:  # small data has its tasks per CPU; one CPU has no other to wait
        return draw
    items = len(units) + salts
    narrowest = max(min(draw, _MIN_DRAW), math.ceil(draw * _NARROWEST))
    return min(range(narrowest, draw + 1), key=lambda d: (pass_items(items, d, cpus), -d))


def pass_items(items: int, draw: int, cpus: int) -> int:
    """How long a pass of ``items`` cut into tasks of ``draw`` takes, counted in items, with its tasks started
    a round of ``cpus`` at a time: the rounds before the last, then the last round's longest task, and an item
    for each round's start (its tasks start, read and hand on a first block before decoding at full rate),
    so that a smaller draw is taken only for a tail it shortens by more than its extra rounds cost. An item
    is a row group: the charge is a round's real start-up cost for small groups (64 rows: about 0.09 s of
    decode) and more than it for large ones, which only makes the rule keep larger draws there."""
    tasks = -(-items // draw)
    rounds = -(-tasks // cpus)
    last = items - (tasks - 1) * draw  # the pass's last task's items
    return (rounds - 1) * draw + (draw if tasks - (rounds - 1) * cpus > 1 else last) + rounds


def share_draw(units: tuple[source.Unit, ...], cpus: int) -> tuple[int, bool]:
    """A task's draw from its share of the rows alone (``draw_size``'s first paragraph), and whether that share
    is a whole draw (``_MIX_ROWS`` rows)."""
    rows = sum(u.rows for u in units)
    mean_rows = max(1, rows // max(1, len(units)))
    tasks = _TASKS_PER_CPU * cpus
    share = min(_MIX_ROWS, rows // tasks)
    return max(1, min(_MIN_DRAW, len(units) // tasks), -(-share // mean_rows)), share == _MIX_ROWS


def block_bytes(image_size: int, rows: int) -> int:
    """Ray Data's target block size for the decoded stream: three quarters of a block of ``rows`` decoded
    rows. Ray Data hands a task's output on once it holds more than the target, and cuts only what exceeds
    1.5 times it, so every decoded block leaves its task whole and at once (``_ReadDecode`` decodes whole
    blocks only, and a short one at the task's end); at its default (128 MiB) a task's blocks left together
    when it ended."""
    return int(0.75 * rows * (image_size * image_size * 3 + 17))


def train_rows(src: DataSource, val_fraction: float) -> int:
    """About how many rows the training split has: all of ``train/``, or the hash split's share."""
    return int(src.train_rows * (1.0 if src.val_files else 1.0 - val_fraction))


def _row_bytes(image_size: int) -> int:
    """A decoded row as held: the image, the label and the row id."""
    return image_size * image_size * 3 + 16


def decoded_bytes(src: DataSource, image_size: int) -> int:
    return (src.train_rows + src.val_rows) * _row_bytes(image_size)


def val_bytes(src: DataSource, image_size: int, val_fraction: float) -> int:
    """The validation rows, decoded: all of ``val/``, or about the hash split's share of ``train/``."""
    rows = src.val_rows if src.val_files else src.train_rows - train_rows(src, val_fraction)
    return rows * _row_bytes(image_size)


def fits_in_memory(src: DataSource, image_size: int, memory_budget: int) -> bool:
    """Whether the ranks hold the decoded data themselves (``memory``), else it streams every epoch."""
    return decoded_bytes(src, image_size) <= memory_budget


def epoch_seed(seed: int, epoch: int) -> int:
    """A seed keyed on an epoch as well (``seed`` itself for epoch 0). Ray Data numbers a dataset's
    executions from 0 in each copy of it (each driver's, each worker group's), so a resumed attempt seeds
    its shuffles by the epoch it starts at: its epochs then get orders of their own, not a replay of the
    first epochs'; so does each worker group Ray Train starts within an attempt (after a failure, or
    resized), whose training dataset is made for it (``recipe.fit.TrainFromNewest``)."""
    return seed + (epoch << 32)


@dataclass(frozen=True)
class Streams:
    """The streamed datasets of one data set, each built on its own where it is handed on: a training
    pass's rows (``train``), validation's (``val``), the rest of a preempted epoch (``rest``), as
    ``{"image": uint8[N,S,S,3], "label": int64[N], "valid": bool[N], "row_id": int64[N]}`` batches. Every
    epoch reads and decodes again.

    Nothing waits for the whole set: each epoch shuffles only the list of the files' row groups, and tasks
    take them in that order, a few at a time (``draw_size``), each reading its groups, mixing their rows
    (``_MIX_ROWS`` at a time) and decoding them a block of ``_DECODE_ROWS`` at a time, which leaves the task
    at once (``block_bytes``). Reading and decoding in one task keeps the encoded rows out of Ray's object
    store and the first batch one block's decode after the pass starts; Ray Data runs as many tasks at once
    as it has CPUs, within its back-pressure. Validation rows are read in file order, unmixed.

    ``aug``: the training rows' augmentation (validation rows are resized and centre-cropped).
    ``data_cpus``: the CPUs the workers leave Ray Data, over all nodes (sizes the tasks' draws).
    ``decode_priority``: ``IDLE`` decodes on a thread that gives way to any other that wants its CPU (a
    rank's training thread first; ``recipe.data.idle``), ``NORMAL`` shares the CPUs as Linux does.
    """

    src: DataSource
    image_size: int
    val_fraction: float
    aug: augment.Augment = NO_AUGMENT
    data_cpus: int = 1
    decode_priority: str = NORMAL

    def __post_init__(self) -> None:
        if self.decode_priority not in (IDLE, NORMAL):  # resolved by ``idle.resolve`` before it gets here
            raise ValueError(f"decode_priority is {self.decode_priority!r}; Streams take {IDLE!r} or {NORMAL!r}")

    def train(self, seed: int | None = None) -> ray.data.Dataset:
        """The training rows, each pass in an order of its own that follows ``seed`` and the pass (Ray Data
        reseeds each execution's shuffle); a dataset made for a resumed attempt or a restarted worker group
        is given ``epoch_seed(seed, e)``, ``e`` the epoch its first pass trains
        (``recipe.fit.first_streamed_epoch``)."""
        return self._stream(self.src.train_units, TRAIN, seed)

    def val(self) -> ray.data.Dataset:
        """The validation rows: all of ``val/``, or the hash split's share of ``train/``."""
        return self._stream(self.src.val_units if self.src.val_files else self.src.train_units, VAL, None)

    def rest(self, seed: int | None, trained: np.ndarray) -> ray.data.Dataset:
        """The training rows but ``trained`` (the row ids a preempted epoch already trained), in an order of
        their own."""
        return self._stream(self.src.train_units, TRAIN, seed, trained)

    def _stream(
        self, units: tuple[source.Unit, ...], keep: str, seed: int | None, trained: np.ndarray | None = None
    ) -> ray.data.Dataset:
        import ray.data
        from ray.data import RandomSeedConfig
        from ray.data.expressions import random as per_pass

        ray.data.DataContext.get_current().enable_progress_bars = False
        mixed = keep != VAL
        items = [{"key": i, "path": u.path, "group": u.group} for i, u in enumerate(units)]
        if mixed:
            items += [{"key": len(units) + i, "path": "", "group": -1} for i in range(_SALTS)]
        # A block a row group: every epoch they come in a new order, and each task takes ``draw_size`` of
        # them, a new set every epoch.
        order = ray.data.from_items(items, override_num_blocks=len(items))
        if mixed:
            order = order.randomize_block_order(seed=RandomSeedConfig(seed=seed, reseed_after_execution=True))
            # And a number of each pass's own for every item: Ray Data reseeds ``random`` every execution.
            order = order.with_column(_PASS_DRAW, per_pass(seed=seed))
        reader = _Reader(self.src.filesystem, self.src.columns, self.src.classes, self.val_fraction)
        task = _ReadDecode(
            reader, self.image_size, self.aug if mixed else None, _DECODE_ROWS, self.decode_priority == IDLE
        )
        out = order.map_batches(
            task,
            fn_kwargs={"keep": None if self.src.val_files else keep, "trained": trained, "mix": mixed, "seed": seed},
            batch_format="pyarrow",
            batch_size=draw_size(units, self.data_cpus, salts=_SALTS if mixed else 0),
        )
        out.context.target_max_block_size = block_bytes(self.image_size, task.rows)
        # Ray Data's reservation sets CPUs aside for each operator, and only decoding needs them: with it, 2
        # CPUs decoded as one (1.3 cores busy, 834-909 images/s at 224 px), without it 1.6 and 1010-1062.
        out.context.op_resource_reservation_enabled = False
        return out


@dataclass(frozen=True)
class _Reader:
    """A streamed task's reading: the row groups of one block of the (shuffled) list, ``_MIX_ROWS`` rows at a
    time, kept to one side of the hash split and to the rows a preempted epoch has not trained, mixed."""

    fs: Any
    columns: source.Columns
    classes: tuple[str, ...] | None
    val_fraction: float

    def __call__(
        self, units: pa.Table, *, keep: str | None, trained: np.ndarray | None, mix: bool, seed: int | None
    ) -> Iterator[pa.Table]:
        keys = units.column("key").to_pylist()
        # Mixed by the seed, this epoch's draw of the keys and the numbers the pass gave them (``_PASS_DRAW``),
        # so that a draw of the same groups (each task drawing one, as where groups are few) is mixed anew
        # every epoch (unseeded: by fresh entropy).
        drawn_by = [int(x * (1 << 53)) for x in units.column(_PASS_DRAW).to_pylist()] if mix else []
        entropy = None if seed is None else [seed % (1 << 64), *keys, *drawn_by]
        rng = np.random.default_rng(entropy) if mix else None
        drawn = [
            source.Unit(path, group, 0)
            for path, group in zip(units.column("path").to_pylist(), units.column("group").to_pylist(), strict=True)
            if group >= 0  # not a salt
        ]
        # The drawn groups a slice at a time in turn, so that a window mixes several even when they are large.
        slices = [
            iter(source.read_unit(self.fs, unit, self.columns, self.classes, max(64, _MIX_ROWS // len(drawn))))
            for unit in drawn
        ]
        parts: list[pa.Table] = []
        held = 0
        while slices:
            for left in list(slices):
                table = next(left, None)
                if table is None:
                    slices.remove(left)
                    continue
                if keep is not None:
                    table = hash_split(table, keep=keep, val_fraction=self.val_fraction)
                if trained is not None:
                    table = _untrained(table, trained=trained)
                parts.append(table)
                held += len(table)
                if held >= _MIX_ROWS:
                    yield _mixed(parts, rng)
                    parts, held = [], 0
        if held:
            yield _mixed(parts, rng)


@dataclass(frozen=True)
class _ReadDecode:
    """A streamed task: ``_Reader``'s windows decoded a block of ``rows`` rows at a time."""

    reader: _Reader
    size: int
    aug: augment.Augment | None  # None: validation's resize and centre crop
    rows: int
    at_idle: bool  # decode on a thread of the idle scheduling policy (``idle.stepped``)

    def __call__(self, units: pa.Table, **read: Any) -> Iterator[dict[str, np.ndarray]]:
        blocks = self._blocks(units, **read)
        yield from idle.stepped(blocks) if self.at_idle else blocks

    def _blocks(self, units: pa.Table, **read: Any) -> Iterator[dict[str, np.ndarray]]:
        held: pa.Table | None = None  # rows read, not yet decoded: fewer than ``rows`` between windows
        for window in self.reader(units, **read):
            held = window if held is None else pa.concat_tables([held, window])
            while len(held) >= self.rows:  # whole blocks only, so that each leaves the task as it is made
                yield decode(held.slice(0, self.rows), size=self.size, aug=self.aug)
                held = held.slice(self.rows)
        if held is not None and len(held):
            yield decode(held, size=self.size, aug=self.aug)


def _mixed(parts: list[pa.Table], rng: np.random.Generator | None) -> pa.Table:
    """``parts`` as one table, its rows in ``rng``'s order. The images as large binary first: a window of
    large photos can hold over 2 GiB, past what 32-bit offsets address."""
    table = pa.concat_tables(parts)
    if rng is None:
        return table
    table = table.set_column(0, IMAGE, table.column(IMAGE).cast(pa.large_binary()))
    return table.take(pa.array(rng.permutation(len(table))))


class Batch(NamedTuple):
    """One batch on the worker's device."""

    images: torch.Tensor  # uint8 NHWC
    labels: torch.Tensor  # int64
    valid: torch.Tensor  # bool: False for a row left out (undecodable image, null label)
    ids: torch.Tensor  # int64 row ids
