"""A rank's batches from Ray Train's shards of the streamed datasets (``pipeline.Streams``): each pass read
on the worker's device, passes started before they are read so that their start-up overlaps other work, and
validation's rows, where they fit, kept after its first pass and replayed.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain.errors import Fatal
from raytrain.recipe.data import memory
from raytrain.recipe.data.memory import Rows
from raytrain.recipe.data.pipeline import ROW_ID, TRAIN, TRAIN_REST, VAL, VALID, Batch
from raytrain.recipe.data.prefetch import prefetched
from raytrain.recipe.data.source import IMAGE, LABEL

if TYPE_CHECKING:
    import torch


def batches(
    shard: Any, *, batch_size: int, device: torch.device, prefetch: int = 2, then: Callable[[], None] | None = None
) -> Iterator[Batch]:
    """Batches on the worker's device, from its Ray Data shard of the current epoch, made ``prefetch``
    ahead by a thread of their own (``prefetch.prefetched``), not by Ray's prefetching: Ray Data's window of
    prefetched blocks asks for the next block before it hands on the one it holds, so a pass's first batch
    waited for its second block to be decoded too (Ray 2.60, ``prefetch_batches_locally``). Parquet that
    cannot be read (a damaged page, a file changed or removed since the check) fails the run at once,
    naming the file, as no retry of the workers could read it either (``raytrain.Fatal``).

    ``then``: called on that thread once the pass is read to its end, while the consumer still has its
    last batches to take: the earliest moment Ray Data lets the shard's next pass start."""
    import torch

    def made() -> Iterator[Batch]:
        try:
            for batch in shard.iter_torch_batches(
                batch_size=batch_size,
                dtypes={IMAGE: torch.uint8, LABEL: torch.int64, VALID: torch.bool, ROW_ID: torch.int64},
                device=device,
                prefetch_batches=0,
                pin_memory=device.type == "cuda",
            ):
                yield Batch(batch[IMAGE], batch[LABEL], batch[VALID], batch[ROW_ID])
        except Fatal as exc:  # a read task's (``source.read_unit``), which Ray's task error carries as its cause
            raise Fatal(str(getattr(exc, "cause", exc))) from None
        if then is not None:
            then()

    return prefetched(made(), prefetch, device)


class _Started:
    """A shard's next pass, started on a thread of its own now and taken later: the thread asks for the
    first batch, which makes Ray Data start the pass's execution (once every rank has asked) and fill it."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self._batches = batches
        self.ended = threading.Event()  # read to its end by its threads before the loop took it
        self._first: list[Batch] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._fill, name="raytrain-next-pass", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            self._first.extend(itertools.islice(self._batches, 1))
        except BaseException as exc:  # raised again where the pass is taken
            self._error = exc

    def take(self) -> Iterator[Batch]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        yield from self._first
        yield from self._batches


class _Beside:
    """Validation's first pass read to its end and kept on the host by a thread of its own, started once
    the pass it is read beside has handed on its first batch (``after_first``), so that it never delays
    that: ``ShardFeed``'s validation held from the first epoch on. Read on the host: its rows are replayed
    from there. A training pass the loop leaves before its end (a preempted epoch, which validates
    nothing: ``stop``) stops it after the batch it is reading (or, where its tasks wait for CPUs the left
    pass holds, leaves it waiting on a daemon thread), so that it takes no more CPU from the last
    checkpoint."""

    def __init__(self, batches: Callable[[], Iterator[Batch]], done: Callable[[], None]) -> None:
        self._batches, self._done = batches, done
        self.done = False  # read to its end, stopped, or failed (set under the feed's lock by ``done``)
        self.rows: Rows | None = None
        self._error: BaseException | None = None
        self._left = threading.Event()  # the loop left the training pass before its end (``stop``)
        self._thread = threading.Thread(target=self._read, name="raytrain-validation", daemon=True)
        self._start = threading.Lock()

    def after_first(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """``batches``, with validation's read started as the first is handed on (at their end, if none)."""
        first = next(batches, None)
        self.start()
        if first is None:
            return
        try:
            yield first
            yield from batches
        except GeneratorExit:  # closed before its end: left
            self.stop()
            raise

    def stop(self) -> None:
        """The loop leaves the training pass before its end: validation's read stops after its batch."""
        self._left.set()

    def start(self) -> None:
        with self._start:
            if self._thread.ident is None:
                self._thread.start()

    def wait(self) -> Rows:
        """The rows, once read; the pass's error where it failed."""
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self.rows is not None
        return self.rows

    def _read(self) -> None:
        try:
            made = self._batches()
            holding = _Holding(made)
            for _ in holding:
                if self._left.is_set():
                    getattr(made, "close", lambda: None)()  # its thread, then Ray Data's iterator, stop in time
                    self._error = RuntimeError("validation's read was stopped: training's pass was left")
                    return
            self.rows = holding.rows
        except BaseException as exc:  # raised again where validation is read
            self._error = exc
        finally:
            self._done()


def _owned(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` in host memory of its own: a batch on the host can be a view of a block in Ray's object
    store, which a kept view would pin there for as long as it is kept."""
    return tensor.numpy().copy() if tensor.device.type == "cpu" else tensor.cpu().numpy()


class _Holding:
    """Validation's batches as a pass reads them, kept on the host: once the pass is read to its end they
    are the rows every later validation replays."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self._batches = batches
        self._parts: list[tuple[np.ndarray, ...]] = []
        self.rows: Rows | None = None  # set once the pass is read to its end

    def __iter__(self) -> Iterator[Batch]:
        for batch in self._batches:
            self._parts.append(tuple(_owned(t) for t in batch))
            yield batch
        if self._parts:
            self.rows = Rows(*(np.concatenate(column) for column in zip(*self._parts, strict=True)))
        else:  # a shard of no rows (fewer validation rows than ranks)
            self.rows = Rows(*(np.empty(0, dtype) for dtype in (np.uint8, np.int64, np.bool_, np.int64)))
        self._parts = []


class ShardFeed:
    """The recipe's batches from Ray Train's shards of the streamed datasets (a rank of one reads them
    whole, ``trainer.data_config``). Asking for the shards here, as the worker starts, lets Ray start their
    split coordinators while the worker builds its model.

    A pass is started before it is asked for, so that its start-up and first blocks overlap other work instead
    of holding up its first batch. Ray Data starts a split's next execution once every rank has asked for it
    (a whole dataset's, when asked), and a rank asks once it has read the current one to its end; so a
    training pass the loop reads starts what follows it the moment its last block is read (while the last
    steps still train): validation's pass, or, where validation is held, the next epoch's training pass; the
    loop starts the next epoch's otherwise, once validation is read (``ahead``). Passes are started one ahead
    of the loop only: a started pass read to its end before the loop takes it (a shard of a few batches)
    starts the next once the loop takes it. A started pass must be the next one read: its tasks hold their
    CPUs while nothing reads their output, so another pass read first could wait for those CPUs forever.
    Nothing is started past ``epochs``, nor once the job is known to be ending (``ending``: on this rank,
    without a collective); a job found ending after a pass was started leaves it unread, which costs the data
    CPUs its first blocks.

    ``hold_val``: the rank keeps the decoded validation rows of its first validation pass on the host and
    replays them every later time (the driver's choice, the same on every rank: they fit the memory
    budget). Validation's resize and centre crop give the same rows every epoch, so decoding them again
    would be work for nothing; and once no validation pass is read through Ray Data, the next epoch's
    training pass is the next one read after an epoch's, and starts while that one's last steps train.
    That first validation pass is read beside the run's first training pass (``_Beside``), from that
    pass's first batch on: its tasks take the data CPUs as training's pass leaves them, instead of once
    the loop has read training to its end, and the second epoch's pass starts as soon as both are read
    to their ends instead of after validation was. Both passes are being read, so the tasks of each go
    on and free their CPUs: neither waits for ever for CPUs the other holds (with one data CPU,
    validation's tasks ran as training's own were done, while the loop still trained on their last
    blocks, in the runs traced: BENCHMARKS.md). The next training pass starts only once
    validation's rows are all held (if the training pass ends first, as validation's ends), never beside
    validation's pass."""

    def __init__(
        self,
        shards: dict[str, Any],
        *,
        batch_size: int,
        device: torch.device,
        epochs: int,
        hold_val: bool = False,
        ending: Callable[[], bool] = lambda: False,
    ) -> None:
        self._batch_size, self._device, self._epochs, self._ending = batch_size, device, epochs, ending
        self._train, self._rest, self._val = shards.get(TRAIN), shards.get(TRAIN_REST), shards[VAL]
        # Passes under way, by dataset and epoch (validation's: the next one asked for, epoch None); started
        # by the loop's thread or by a pass's own as it ends.
        self._started: dict[tuple[str, int | None], _Started] = {}
        self._lock = threading.Lock()
        self._holding: _Holding | None = None  # validation's pass that is kept (``hold_val``)
        self._hold_val = hold_val
        self._beside: _Beside | None = None  # validation's first pass, read beside the first training pass
        self._after_val: int | None = None  # a training epoch read to its end before validation was held

    @classmethod
    def of_worker(cls, *, train: bool, rest: bool, **how: Any) -> ShardFeed:
        """The feed of this Ray Train worker's shards: validation's, and training's or a preempted epoch's
        rest where the trainer was given them."""
        import ray.train

        names = [VAL, *[TRAIN] * train, *[TRAIN_REST] * rest]
        return cls({name: ray.train.get_dataset_shard(name) for name in names}, **how)

    def _batches(self, name: str, epoch: int | None, shard: Any) -> Iterator[Batch]:
        then = None if name == VAL else lambda: self._ended(name, epoch)
        return batches(shard, batch_size=self._batch_size, device=self._device, then=then)

    def _pass(self, name: str, epoch: int | None, shard: Any) -> Iterator[Batch]:
        with self._lock:
            started = self._started.pop((name, epoch), None)
        if started is None:
            return self._batches(name, epoch, shard)
        if started.ended.is_set():  # read to its end already: what follows it starts now
            self._after_training(epoch)
        return started.take()

    def _ended(self, name: str, epoch: int | None) -> None:
        """A training pass is read to its end (on its batches' thread): what follows it starts now if the
        loop reads it, else once the loop takes it (``_pass``), so that passes start one ahead only."""
        with self._lock:
            waiting = self._started.get((name, epoch))
            if waiting is not None:
                waiting.ended.set()
                return
        self._after_training(epoch)

    def _start(self, name: str, epoch: int | None, shard: Any) -> None:
        with self._lock:
            if (name, epoch) not in self._started:
                self._started[name, epoch] = _Started(self._batches(name, epoch, shard))

    def _after_training(self, epoch: int | None) -> None:
        """Epoch ``epoch``'s training pass is read to its end: start the pass read next (with validation
        being read beside it, once validation's rows are held: ``_val_held``)."""
        if self._ending():
            return
        with self._lock:
            if self._beside is not None and not self._beside.done:
                self._after_val = epoch
                return
        if self._beside is None and self._held() is None:
            self._start(VAL, None, self._val)
        elif self._held() is not None and epoch is not None:  # not where validation's read failed
            self.ahead(epoch + 1)

    def _val_held(self) -> None:
        """Validation's pass read beside training is read to its end (or failed: the loop raises its error
        where it reads validation): the training pass that ended meanwhile has its successor started now."""
        with self._lock:
            assert self._beside is not None
            self._beside.done = True
            epoch, self._after_val = self._after_val, None
        if epoch is not None and self._held() is not None and not self._ending():
            self.ahead(epoch + 1)

    def _held(self) -> Rows | None:
        """Validation's rows, once a pass of them has been read to its end and kept (``hold_val``)."""
        if self._beside is not None:
            return self._beside.rows if self._beside.done else None
        return self._holding.rows if self._holding is not None else None

    def train(self, epoch: int, rest: bool = False) -> Iterator[Batch]:
        """This rank's shard of the epoch (Ray Data reshuffles every epoch), or of a preempted epoch's rest."""
        shard, name = (self._rest, TRAIN_REST) if rest else (self._train, TRAIN)
        assert shard is not None, "no such dataset was given to the trainer"
        if not (self._hold_val and self._holding is None and self._beside is None):
            return self._pass(name, epoch, shard)
        import torch

        # Set before the pass is taken, which may find it read to its end already (``_after_training``).
        self._beside = _Beside(
            lambda: batches(self._val, batch_size=self._batch_size, device=torch.device("cpu")), self._val_held
        )
        return self._beside.after_first(self._pass(name, epoch, shard))

    def val(self) -> Iterator[Batch]:
        # Every rank reads a kept pass to its end (``evaluate``), so every rank holds its rows or none does.
        assert self._holding is None or self._holding.rows is not None, "validation's kept pass was left unread"
        rows = self._beside.wait() if self._beside is not None else self._held()
        if rows is not None:
            return memory.batches(rows, np.arange(len(rows)), batch_size=self._batch_size, device=self._device)
        batches = self._pass(VAL, None, self._val)
        if not self._hold_val:
            return batches
        self._holding = _Holding(batches)
        return iter(self._holding)

    def leave(self) -> None:
        """The loop leaves the epoch's pass before its end: validation's read beside it stops."""
        if self._beside is not None:
            self._beside.stop()

    def ahead(self, epoch: int) -> None:
        """The loop reads epoch ``epoch``'s training pass next: start it now."""
        if self._train is not None and epoch < self._epochs:
            self._start(TRAIN, epoch, self._train)
