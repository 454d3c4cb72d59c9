"""Ray Train + the streamed Ray Data pipeline: every epoch, 2 workers get disjoint, equal shards that cover it.
(Data held in memory by the ranks: tests/test_memory.py.)"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import queue
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from raytrain.recipe.data import pipeline, shards, source
from tests.conftest import image_table, write_parquet

pytestmark = pytest.mark.ray
EPOCHS = 3


def _collect_rows(config: dict[str, Any]) -> None:
    """A training function that only records which rows (by content hash) this worker saw, in order."""
    import ray.train
    import torch

    shard = ray.train.get_dataset_shard(pipeline.TRAIN)
    for epoch in range(EPOCHS):
        batches = shards.batches(shard, batch_size=7, device=torch.device("cpu"))
        seen = [hashlib.sha1(img.numpy().tobytes()).hexdigest() for images, *_ in batches for img in images]
        ray.train.report({"epoch": epoch, "rank": ray.train.get_context().get_world_rank(), "rows": seen})


def train_rows(table: pa.Table) -> set[str]:
    import numpy as np

    kept = pipeline.hash_split(table, keep=pipeline.TRAIN, val_fraction=0.2)
    decoded = pipeline.decode(kept, size=8)["image"]
    return {hashlib.sha1(np.ascontiguousarray(img).tobytes()).hexdigest() for img in decoded}


def _ids_kept(table: pa.Table, keep: str) -> list[int]:
    """The ids of ``table``'s rows on the ``keep`` side of the hash split, in its order."""
    kept = pipeline.hash_split(table, keep=keep, val_fraction=0.2)
    return pipeline.row_ids(kept.column("image").to_pylist()).tolist()


def _ids_read(passes: Any) -> list[int]:
    """The ids of the rows one pass of ``passes`` (a dataset, or its iterator) hands on, in order."""
    import numpy as np

    return np.concatenate([b[pipeline.ROW_ID] for b in passes.iter_batches(batch_format="numpy")]).tolist()


def _on_workers(
    train_func: Any, table: pa.Table, tmp_path: Path, workers: int = 2, seed: int | None = None
) -> list[Any]:
    """``train_func`` run by Ray Train on ``workers`` workers over ``table``'s streamed datasets (shuffled
    by ``seed``), handed to them as raytrain's runs hand them (``trainer.data_config``): its EPOCHS reports."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain.service.reports import Reports
    from raytrain.service.trainer import data_config

    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", table)))
    streams = pipeline.Streams(src, image_size=8, val_fraction=0.2)
    trainer = TorchTrainer(
        train_func,
        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
        datasets={pipeline.TRAIN: streams.train(seed), pipeline.VAL: streams.val()},
        dataset_config=data_config(workers, whole_for_one=True),
        run_config=ray.train.RunConfig(name="shards", storage_path=str(tmp_path / "runs")),
    )
    with Reports(lambda record: None) as reports:
        trainer.run_config.callbacks.append(reports.callback())
        trainer.fit()
    assert len(reports.events.reports) == EPOCHS
    return reports.events.reports


def test_two_workers_get_disjoint_covering_reshuffled_shards(ray_local: object, tmp_path: Path) -> None:
    table = image_table(300)
    if len(train_rows(table)) % 2:  # an even epoch, so that equal shards can cover it exactly
        table = table.slice(1)
    expected = train_rows(table)
    orders = []
    for report in _on_workers(_collect_rows, table, tmp_path):
        by_rank = {w["rank"]: w["rows"] for w in report.metrics}
        a, b = by_rank[0], by_rank[1]
        assert len(a) == len(b) == len(expected) // 2
        assert set(a).isdisjoint(b)
        assert set(a) | set(b) == expected
        orders.append(a + b)
    assert len({tuple(o) for o in orders}) == EPOCHS, "the order must change every epoch"


def _coordinators() -> set[int]:
    """The processes of Ray Data's split coordinators on this Ray worker's node, by pid: its raylet's
    children whose title is one's (an idle worker that Ray makes one keeps its pid and takes the title)."""
    import psutil

    found = set()
    for child in psutil.Process().parent().children():
        with contextlib.suppress(psutil.Error):
            if " ".join(child.cmdline()).startswith("ray::SplitCoordinator"):
                found.add(child.pid)
    return found


def _validate_held(config: dict[str, Any]) -> None:
    """A training loop of the recipe's shape over ``ShardFeed`` with validation held: the next epoch's pass
    started as training's last block is read, two validations an epoch (the model's and its EMA's);
    records the row ids, and whether a split coordinator started once the worker did (those of runs before
    it may live on)."""
    import ray.train
    import torch

    before = _coordinators()
    feed = shards.ShardFeed.of_worker(
        train=True, rest=False, batch_size=7, device=torch.device("cpu"), epochs=EPOCHS, hold_val=True
    )

    def validation() -> list[tuple[int, int]]:  # each row's id and the sum of its pixels
        return [(int(i), int(img.sum())) for b in feed.val() for i, img in zip(b.ids, b.images, strict=True)]

    for epoch in range(EPOCHS):
        trained = [int(i) for batch in feed.train(epoch) for i in batch.ids]
        val = [validation(), validation()]
        feed.ahead(epoch + 1)
        rank = ray.train.get_context().get_world_rank()
        coordinated = bool(_coordinators() - before)
        ray.train.report({"epoch": epoch, "rank": rank, "trained": trained, "val": val, "coordinated": coordinated})


def test_held_validation_replays_each_ranks_rows_while_the_next_epoch_starts(ray_local: object, tmp_path: Path) -> None:
    """Two ranks keep their first validation pass's rows and replay them (the same rows and pixels) every
    later time, with no pass of its own; the next epoch's training pass, started as the last one's final
    block was read, reads as before (disjoint, covering, reshuffled) and nothing waits on a CPU another
    pass holds."""
    import numpy as np

    table = image_table(300)
    reports = _on_workers(_validate_held, table, tmp_path)
    val_ids = set(_ids_kept(table, pipeline.VAL))
    first: dict[int, list[Any]] = {}
    orders = []
    for report in reports:
        by_rank = {w["rank"]: w for w in report.metrics}
        for rank, worker in by_rank.items():
            for val in worker["val"]:
                assert val == first.setdefault(rank, worker["val"][0])  # the first pass's rows, replayed
        a, b = by_rank[0]["trained"], by_rank[1]["trained"]
        assert len(a) == len(b) > 0 and set(a).isdisjoint(b) and not val_ids & set(a + b)
        orders.append(a + b)
    ids = [{i for i, _ in first[rank]} for rank in (0, 1)]
    assert ids[0].isdisjoint(ids[1]) and len(ids[0] | ids[1]) >= len(val_ids) - 1  # equal shards: one may be left out
    assert ids[0] | ids[1] <= val_ids and np.all([pixels > 0 for rows in first.values() for _, pixels in rows])
    assert len({tuple(o) for o in orders}) == EPOCHS, "the order must change every epoch"
    # Split through coordinators, which rank 0's first ask makes (rank 1 may start after they did).
    assert next(w["coordinated"] for w in reports[0].metrics if w["rank"] == 0)


def test_only_the_recipe_alone_reads_its_datasets_whole(ray_local: object) -> None:
    """A run of one worker reads each dataset whole only for the recipe, whose feed reads through the
    iterator API alone; a function written for Ray Train gets Ray Train's default, a split of one, as
    stock Ray Train hands it (the split's iterator answers ``world_size()``)."""
    import ray.data

    from raytrain.recipe.fit import ImageClassifier
    from raytrain.service.trainer import data_config
    from raytrain.service.workload import TrainFunction

    def shard(whole_for_one: bool, workers: int = 1) -> Any:
        given = data_config(workers, whole_for_one=whole_for_one).configure(
            {pipeline.TRAIN: ray.data.range(4)}, world_size=workers, worker_handles=None, worker_node_ids=None
        )
        return given[0][pipeline.TRAIN]

    assert shard(TrainFunction.whole_for_one).world_size() == 1
    assert not hasattr(shard(ImageClassifier.whole_for_one), "world_size")
    assert shard(ImageClassifier.whole_for_one, workers=2).world_size() == 2


def test_one_rank_reads_each_dataset_whole_in_its_own_process(ray_local: object, tmp_path: Path) -> None:
    """A run of one worker is handed each dataset whole, not split (``trainer.data_config``): no split
    coordinator starts, and the recipe's feed (each epoch's pass started as the last one's final block is
    read, validation's read beside the first epoch) reads every training row once an epoch, in a new order
    each time, and every validation row in the first epoch, replayed later."""
    table = image_table(200)
    reports = _on_workers(_validate_held, table, tmp_path, workers=1, seed=0)  # seeded, as every run is
    train_ids, val_ids = sorted(_ids_kept(table, pipeline.TRAIN)), sorted(_ids_kept(table, pipeline.VAL))
    (first,) = reports[0].metrics
    assert sorted(i for i, _ in first["val"][0]) == val_ids
    orders = []
    for report in reports:
        (worker,) = report.metrics
        assert worker["val"] == [first["val"][0]] * 2 and not worker["coordinated"]
        assert sorted(worker["trained"]) == train_ids
        orders.append(tuple(worker["trained"]))
    assert len(set(orders)) == EPOCHS, "the order must change every epoch"


def test_the_rest_of_a_preempted_epoch_is_exactly_its_untrained_rows(ray_local: object, tmp_path: Path) -> None:
    import numpy as np

    table = image_table(200)
    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", table)))
    every = np.array(_ids_kept(table, pipeline.TRAIN))
    trained = every[::3]  # what the epoch trained before the job ended
    streams = pipeline.Streams(src, image_size=8, val_fraction=0.2)
    rest = _ids_read(streams.rest(1, trained))
    assert len(rest) == len(set(rest)) == len(every) - len(trained)
    assert set(rest) == set(every.tolist()) - set(trained.tolist())
    assert sorted(_ids_read(streams.train(1))) == sorted(every.tolist())  # the later epochs see every row


def test_a_resumed_attempt_shuffles_by_the_epoch_it_starts_at(ray_local: object, tmp_path: Path) -> None:
    """Ray Data numbers executions from 0 in each driver: a run resumed after 2 epochs must not replay
    epoch 1's order, and the same seed and epoch give the same order (with Ray Data keeping order)."""
    import ray.data

    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", image_table(200))))
    options = ray.data.DataContext.get_current().execution_options
    keep, options.preserve_order = options.preserve_order, True
    try:

        def first_epoch(epochs_done: int) -> list[int]:
            seed = pipeline.epoch_seed(1, epochs_done)
            return _ids_read(pipeline.Streams(src, image_size=8, val_fraction=0.2).train(seed))

        fresh, again, resumed = first_epoch(0), first_epoch(0), first_epoch(2)
    finally:
        options.preserve_order = keep
    assert fresh == again
    assert sorted(resumed) == sorted(fresh) and resumed != fresh


def test_each_worker_group_gets_a_training_dataset_seeded_by_the_epoch_it_resumes_in(
    ray_local: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe hands Ray Train its training dataset as a callable, which Ray Train calls (in its
    controller, after pickling it there) each time it starts the workers: after a restart from the
    checkpoint of epoch 2, the first pass has the order a run resumed there has, not epoch 1's again; after
    a mid-epoch checkpoint whose rest is a dataset of its own, the next epoch's order. Storage that fails
    then keys the order on where the driver resumed."""
    import numpy as np
    import ray.cloudpickle
    import ray.data

    from raytrain import fsio
    from raytrain.recipe import checkpoint_files
    from raytrain.recipe.config import DataConfig, FitConfig, OptimConfig
    from raytrain.recipe.fit import ImageClassifier
    from raytrain.service import runs
    from raytrain.service.cluster import ClusterInfo, NodeInfo
    from raytrain.service.config import RunConfig, ScaleConfig
    from raytrain.service.placement import make_plan
    from raytrain.service.workload import Placed

    table = image_table(200)
    data = DataConfig(uri=str(write_parquet(tmp_path / "d.parquet", table)), image_size=8, stream=True)
    storage = runs.Storage.open(str(tmp_path / "runs"))
    workload = ImageClassifier(cfg=FitConfig(data=data, optim=OptimConfig(seed=1))).prepare(storage)
    run = runs.open_run(storage, RunConfig(storage=storage.uri, name="r"), experiment={}, intact=lambda f, p: True)
    node = NodeInfo(node_id="n1", hostname="node1", ip="10.0.0.1", cpus=2, gpus=0, object_store_bytes=1 << 30)
    plan = make_plan([node], ScaleConfig(workers=1, device="cpu", cpus_per_worker=1))
    built: list[str] = []  # the streams each place builds: only those it hands on
    stream = pipeline.Streams._stream
    monkeypatch.setattr(pipeline.Streams, "_stream", lambda self, *a: built.append(a[1]) or stream(self, *a))
    datasets = workload.datasets(Placed(plan=plan, cluster=ClusterInfo((node,), "local", True), run=run))
    assert set(datasets) == {pipeline.TRAIN, pipeline.VAL} and isinstance(datasets[pipeline.VAL], ray.data.Dataset)
    assert built == [pipeline.VAL]
    train = ray.cloudpickle.loads(ray.cloudpickle.dumps(datasets[pipeline.TRAIN]))  # as the controller has it
    streams = train.streams  # the run's data, image size and split
    Path(run.path).mkdir(parents=True, exist_ok=True)

    def checkpoint(epoch: int, batches: int = 0, trained: Any = None) -> None:
        (Path(run.path) / checkpoint_files.name(epoch, batches)).mkdir()
        checkpoint_files.write(Path(run.path) / checkpoint_files.name(epoch, batches), {"epoch": epoch}, {}, trained)

    def storage_fails(call: Any, what: str, timeout_s: float | None = None) -> Any:
        raise fsio.StorageError(f"{what}: storage did not answer")

    options = ray.data.DataContext.get_current().execution_options
    keep, options.preserve_order = options.preserve_order, True
    try:

        def first_pass(epochs_done: int) -> list[int]:  # of a run resumed after that many epochs
            return _ids_read(streams.train(pipeline.epoch_seed(1, epochs_done)))

        fresh = _ids_read(train())
        assert built == [pipeline.VAL, pipeline.TRAIN]
        checkpoint(2)
        restarted = _ids_read(train())
        trained = np.array(_ids_kept(table, pipeline.TRAIN)[:40])
        checkpoint(2, 5, trained)
        after_rest = _ids_read(train())
        with monkeypatch.context() as patched:
            patched.setattr(fsio, "bounded", storage_fails)
            unread = _ids_read(train())
        expected = [first_pass(0), first_pass(2), first_pass(3), first_pass(0)]
        # A driver resuming from that mid-epoch checkpoint hands over the epoch's rest too, keyed on its epoch.
        built.clear()
        resumed = dataclasses.replace(run, existed=True)
        again = workload.datasets(Placed(plan=plan, cluster=ClusterInfo((node,), "local", True), run=resumed))
        assert set(again) == {pipeline.TRAIN, pipeline.VAL, pipeline.TRAIN_REST} and built == [
            pipeline.VAL,
            pipeline.TRAIN,
        ]
        rest = _ids_read(again[pipeline.TRAIN_REST])
        assert rest == _ids_read(streams.rest(pipeline.epoch_seed(1, 2), trained))
        assert sorted(rest) == sorted(set(_ids_kept(table, pipeline.TRAIN)) - set(trained.tolist()))
    finally:
        options.preserve_order = keep
    assert [fresh, restarted, after_rest, unread] == expected
    assert len({tuple(o) for o in expected}) == 3 and len({tuple(sorted(o)) for o in expected}) == 1


def test_a_seeded_stream_of_one_row_group_is_mixed_anew_every_epoch(ray_local: object, tmp_path: Path) -> None:
    """Data in one row group: one task reads all of it every pass, the same draw each time. The seed and the
    epoch (Ray Data's execution of the dataset) key its mix, so each pass has an order of its own, and a
    new build with the same seed gives the same orders again."""

    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", image_table(200))))
    assert len(src.train_units) == 1

    def orders() -> list[tuple[int, ...]]:
        passes = pipeline.Streams(src, image_size=8, val_fraction=0.2).train(3).iterator()
        return [tuple(_ids_read(passes)) for _ in range(EPOCHS)]

    first = orders()
    assert len(set(first)) == EPOCHS and len({tuple(sorted(o)) for o in first}) == 1
    assert orders() == first


def test_a_read_mixes_row_groups_in_bounded_windows_anew_for_each_draw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed read task holds at most a window of rows (``_MIX_ROWS`` and the group that reached it),
    mixes the rows of the groups in it, reads every row once, and mixes by its seed, the epoch's draw of
    row groups and the numbers the pass gave them: the same draw and numbers, the same order; another draw,
    or the same draw with a later pass's numbers, another."""
    import numpy as np
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(image_table(400), path, row_group_size=50)
    src = source.inspect(str(path))
    monkeypatch.setattr(pipeline, "_MIX_ROWS", 120)
    read = pipeline._Reader(src.filesystem, src.columns, src.classes, 0.2)

    def windows(order: list[int], numbers: float = 0.5) -> list[pa.Table]:
        units = [src.train_units[i] for i in order]
        table = pa.table(
            {
                "key": order,
                "path": [u.path for u in units],
                "group": [u.group for u in units],
                pipeline._PASS_DRAW: [numbers] * len(order),
            }
        )
        return list(read(table, keep=None, trained=None, mix=True, seed=1))

    drawn = windows([3, 0, 6, 1, 7, 2, 5, 4])
    assert [len(w) for w in drawn] == [150, 150, 100]  # 3 groups of 50 reach 120; what is left
    rows = [r for w in drawn for r in pipeline.row_ids(w.column("image").to_pylist()).tolist()]
    every = pipeline.row_ids(image_table(400).column("image").to_pylist()).tolist()
    assert sorted(rows) == sorted(every)
    position = {r: i for i, r in enumerate(every)}  # file order: row i is in group i // 50
    first = [position[r] // 50 for r in pipeline.row_ids(drawn[0].column("image").to_pylist()).tolist()]
    assert set(first) == {3, 0, 6} and first != sorted(first) and len(set(first[:10])) > 1  # mixed
    again = windows([3, 0, 6, 1, 7, 2, 5, 4])
    assert [w.column("label").to_pylist() for w in again] == [w.column("label").to_pylist() for w in drawn]
    other = windows([0, 3, 6, 1, 7, 2, 5, 4])  # the same groups in the first window, drawn in another order
    assert sorted(other[0].column("label").to_pylist()) == sorted(drawn[0].column("label").to_pylist())
    assert other[0].column("image").to_pylist() != drawn[0].column("image").to_pylist()
    assert np.isin(pipeline.row_ids(other[0].column("image").to_pylist()), rows).all()
    later = windows([3, 0, 6, 1, 7, 2, 5, 4], numbers=0.25)  # the same draw in another pass
    assert sorted(later[0].column("label").to_pylist()) == sorted(drawn[0].column("label").to_pylist())
    assert later[0].column("image").to_pylist() != drawn[0].column("image").to_pylist()


def test_tasks_are_drawn_for_every_data_cpu_and_hand_on_each_decoded_block_at_once(
    ray_local: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's decoded blocks leave it one by one (at Ray Data's default block size they left together, at
    the task's end, holding the first batch back), and small data is drawn in shares that give each CPU
    for data a task or two, large data in whole rounds of tasks."""
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(image_table(400), path, row_group_size=50)
    src = source.inspect(str(path))
    assert pipeline.draw_size(src.train_units, data_cpus=1) == 4  # 200 rows: the least a task draws
    big = tuple(source.Unit("f", g, 64) for g in range(100))
    assert pipeline.draw_size(big, data_cpus=1) == 32  # 2,048 rows to mix
    assert pipeline.draw_size(big, data_cpus=8) == 7  # 6,400 rows / (2 x 8 CPUs) = 400 rows: 7 groups of 64
    assert pipeline.draw_size(big, data_cpus=24) == 3  # 133 rows: 3 groups, under the 4 that mixing prefers
    assert pipeline.draw_size(big, data_cpus=64) == 1  # fewer groups than CPUs: a group a task
    # Data that fills whole draws: the draw whose pass ends soonest, its last round not one long task alone.
    salts = pipeline._SALTS  # a training pass's, shuffled among its groups

    def drawn(groups: int, rows: int, cpus: int, salts: int = salts) -> int:
        return pipeline.draw_size(tuple(source.Unit("f", g, rows) for g in range(groups)), cpus, salts=salts)

    assert drawn(235, 64, 1) == 32  # 15,040 rows, one CPU: whole draws (32 groups), one after another
    assert drawn(235, 64, 2) == 31  # 8 tasks, 4 rounds of 2: not 7 whole and one of 19 items
    assert drawn(235, 64, 2, salts=0) == 30  # validation's pass: the groups alone, no salt keys
    assert drawn(185, 64, 2) == 32  # whole draws end in a task of one item: kept
    assert drawn(130, 64, 2) == 24 and drawn(130, 64, 2, salts=0) == 32  # training's at the floor: 3/4 of 32
    assert drawn(2500, 64, 32) == 27 and drawn(1000, 128, 8) == 14 and drawn(185, 400, 16) == 6
    asked: dict[int, int] = {}  # the data CPUs each pass's draw was asked for, by the salt keys it counted

    def spy(units: tuple[source.Unit, ...], data_cpus: int, salts: int = 0) -> int:
        asked[salts] = data_cpus
        return 4

    with monkeypatch.context() as patched:
        patched.setattr(pipeline, "draw_size", spy)
        streams = pipeline.Streams(src, image_size=8, val_fraction=0.2, data_cpus=2)
        streams.train(0), streams.val()
    assert asked == {pipeline._SALTS: 2, 0: 2}  # training's pass counts its salt keys, validation's none
    monkeypatch.setattr(pipeline, "_DECODE_ROWS", 16)
    train = pipeline.Streams(src, image_size=8, val_fraction=0.2).train(0)
    blocks = [len(b[pipeline.ROW_ID]) for b in train.iter_batches(batch_size=None, batch_format="numpy")]
    assert max(blocks) == 16 and sum(blocks) == len(train_rows(image_table(400)))
    assert sum(b < 16 for b in blocks) <= 4  # a short block only at the end of each of the 4 tasks


class _FakeShard:
    """A dataset shard that logs when a pass is asked for its first batch (what starts Ray Data's execution),
    and puts the line on ``starts`` too, for a test to wait on; and logs when a pass is read past its end."""

    def __init__(
        self,
        name: str,
        log: list[str],
        starts: queue.Queue[str],
        fail: bool = False,
        gate: Any = None,
        pause: Any = None,
        rows: int = 2,
    ) -> None:
        self.name, self.log, self.starts, self.fail, self.passes = name, log, starts, fail, 0
        self.gate = gate  # a threading.Event each pass waits for before its first batch
        self.pause = pause  # ... and after it
        self.rows = rows  # at most 10

    def iter_torch_batches(self, **_: Any) -> Any:
        import torch

        self.passes += 1
        at = self.passes
        self.log.append(f"{self.name} {at} starts")
        self.starts.put(self.log[-1])
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "the test never opened the gate"
        if self.fail:
            from raytrain.errors import Fatal

            raise Fatal(f"data file {self.name} cannot be read")
        for i in range(self.rows):  # a row a batch, told apart by the pass and the batch
            row = 10 * at + i
            image = torch.full((1, 2, 2, 3), row, dtype=torch.uint8)
            yield {
                "image": image,
                "label": torch.tensor([row]),
                "valid": torch.tensor([True]),
                "row_id": torch.tensor([row]),
            }
            if i == 0 and self.pause is not None:
                assert self.pause.wait(timeout=30), "the test never ended the pause"
        self.log.append(f"{self.name} {at} ends")


def _fake_feed(
    epochs: int, hold_val: bool = False, ending: Any = lambda: False, train: Any = None, **val: Any
) -> tuple[shards.ShardFeed, list[str], queue.Queue[str]]:
    """A feed of fake shards; ``train`` and ``val``: how each is made (``_FakeShard``'s options)."""
    import torch

    log: list[str] = []
    starts: queue.Queue[str] = queue.Queue()
    fakes = {
        pipeline.TRAIN: _FakeShard("train", log, starts, **(train or {})),
        pipeline.VAL: _FakeShard("val", log, starts, **val),
    }
    cpu = torch.device("cpu")
    feed = shards.ShardFeed(fakes, batch_size=2, device=cpu, epochs=epochs, hold_val=hold_val, ending=ending)
    return feed, log, starts


def _starts(log: list[str]) -> list[str]:
    return [line for line in log if line.endswith("starts")]


def test_a_streamed_feed_starts_each_pass_as_the_one_before_is_read_and_never_early() -> None:
    """Validation's pass starts once a training pass is read to its end, while its last batch is still to
    be taken; the next epoch's only once the loop says it is next, after validation's pass (a pass started
    earlier could keep the CPUs another pass needs); none past the last epoch; an error in a pass started
    ahead is raised where the pass is read."""
    feed, log, starts = _fake_feed(epochs=2)
    epoch = feed.train(0)
    next(epoch)  # the batches' thread, two ahead, reads the pass to its end
    assert [starts.get(timeout=30) for _ in range(2)] == ["train 1 starts", "val 1 starts"]
    assert log[:3] == ["train 1 starts", "train 1 ends", "val 1 starts"]  # not before training's end
    assert len(list(epoch)) == 1  # the last batch, taken after validation's pass started
    assert len(list(feed.val())) == 2 and _starts(log) == ["train 1 starts", "val 1 starts"]  # the one started
    feed.ahead(1)
    assert starts.get(timeout=30) == "train 2 starts"
    assert len(list(feed.train(1))) == 2 and _starts(log).count("train 2 starts") == 1
    assert starts.get(timeout=30) == "val 2 starts"  # once the loop took epoch 2's pass, read to its end
    assert log.index("train 2 ends") < log.index("val 2 starts")
    feed.ahead(2)  # past the last epoch: nothing starts
    assert (pipeline.TRAIN, 2) not in feed._started and _starts(log)[-1] == "val 2 starts"
    assert len(list(feed.val())) == 2  # epoch 2's validation, the pass started
    from raytrain.errors import Fatal

    feed._train = _FakeShard("broken", log, starts, fail=True)
    feed.ahead(1)
    feed._started[pipeline.TRAIN, 1]._thread.join()  # it failed on its thread ...
    with pytest.raises(Fatal, match=r"^data file broken cannot be read$"):  # ... and says so where it is read
        list(feed.train(1))


def test_a_feed_holding_validation_reads_it_beside_the_first_epoch_and_then_starts_each_epoch_as_one_ends() -> None:
    """With ``hold_val``, validation's one pass is read beside the first training pass, while that pass is
    still being read, once it has handed on its first batch, and kept; nothing starts beside either; every
    validation (the EMA model's too) replays the rows with no pass; the next epoch's pass starts as an
    epoch's last block is read, one pass ahead of the loop only, never past the last epoch."""
    import threading

    import torch

    paused = threading.Event()
    feed, log, starts = _fake_feed(epochs=3, hold_val=True, train={"pause": paused})
    epoch = feed.train(0)
    assert next(epoch).ids.tolist() == [10] and starts.get(timeout=30) == "train 1 starts"
    assert starts.get(timeout=30) == "val 1 starts"  # once training's first batch was in ...
    assert feed._beside is not None and _joined(feed._beside._thread)  # ... and read to its end
    assert "train 1 ends" not in log and "train 2 starts" not in log  # beside training, which goes on
    paused.set()
    assert len(list(epoch)) == 1 and starts.get(timeout=30) == "train 2 starts"  # as training's last is read
    first = list(feed.val())
    assert [b.ids.tolist() for b in first] == [[10, 11]]
    replayed = list(feed.val())  # the EMA model's validation: no pass
    for column in range(4):
        assert torch.equal(torch.cat([b[column] for b in replayed]), torch.cat([b[column] for b in first]))
    feed.ahead(1)  # as the loop does after validation: started already, not again
    assert feed._started[pipeline.TRAIN, 1].ended.wait(timeout=30)  # read to its end before the loop took it
    assert "train 3 starts" not in log  # ... so the pass after it waits for the loop: one ahead only
    epoch = feed.train(1)
    assert starts.get(timeout=30) == "train 3 starts"
    assert len(list(epoch)) == 2 and (pipeline.VAL, None) not in feed._started  # held: no pass to start
    assert [b.ids.tolist() for b in feed.val()] == [[10, 11]] and log.count("val 1 starts") == 1
    feed.ahead(2)  # started already: not again
    assert len(list(feed.train(2))) == 2 and log.count("train 3 starts") == 1
    assert (pipeline.TRAIN, 3) not in feed._started and _starts(log)[-1] == "train 3 starts"  # past the last


def test_the_second_epoch_waits_for_validation_read_beside_the_first_to_be_held() -> None:
    """A first training pass read to its end while validation's is still being read starts nothing beside
    it (a started pass nobody reads would hold the CPUs validation's tasks need): the next epoch's starts
    as validation's rows are all held."""
    import threading

    gate = threading.Event()
    feed, log, starts = _fake_feed(epochs=3, hold_val=True, gate=gate)
    epoch = feed.train(0)
    assert next(epoch).ids.tolist() == [10] and starts.get(timeout=30) == "train 1 starts"
    assert starts.get(timeout=30) == "val 1 starts"
    assert len(list(epoch)) == 1  # training read to its end while validation's pass waits at the gate ...
    assert "train 2 starts" not in log and feed._after_val == 0  # ... so the next epoch's waits for it
    gate.set()
    assert starts.get(timeout=30) == "train 2 starts"  # started as validation's rows were all held
    assert log.index("val 1 ends") < log.index("train 2 starts")
    assert [b.ids.tolist() for b in feed.val()] == [[10, 11]]


def test_validation_read_beside_training_that_fails_is_raised_where_it_is_read_and_starts_nothing() -> None:
    """A validation pass read beside training that fails (an unreadable file) fails the loop where it
    reads validation, with the pass's error, not the training beside it; no next training pass starts."""
    import threading

    from raytrain.errors import Fatal

    paused = threading.Event()
    feed, log, starts = _fake_feed(epochs=3, hold_val=True, train={"pause": paused}, fail=True)
    epoch = feed.train(0)
    assert next(epoch).ids.tolist() == [10] and starts.get(timeout=30) == "train 1 starts"
    assert starts.get(timeout=30) == "val 1 starts" and "train 1 ends" not in log  # beside training
    assert feed._beside is not None and _joined(feed._beside._thread)
    paused.set()
    assert len(list(epoch)) == 1  # training's pass is not the one that fails
    with pytest.raises(Fatal, match=r"^data file val cannot be read$"):
        feed.val()
    assert _starts(log) == ["train 1 starts", "val 1 starts"]  # the next epoch's pass was not started


@pytest.mark.parametrize("how", ["leave", "close"])
def test_validation_read_beside_a_training_pass_the_loop_leaves_stops_with_it(how: str) -> None:
    """A first epoch the loop leaves before its end (preempted: it says so with ``leave`` before its last
    checkpoint, validating nothing) stops validation's read beside it after the batch it is reading, and
    starts nothing; so does a training pass closed before its end."""
    import threading

    paused, gate = threading.Event(), threading.Event()
    feed, log, starts = _fake_feed(epochs=3, hold_val=True, train={"pause": paused}, gate=gate, rows=10)
    epoch = feed.train(0)
    assert next(epoch).ids.tolist() == [10] and starts.get(timeout=30) == "train 1 starts"
    assert starts.get(timeout=30) == "val 1 starts"
    if how == "leave":
        feed.leave()  # as the loop does on a preempted epoch
    else:
        paused.set()
        epoch.close()
    gate.set()
    paused.set()
    beside = feed._beside
    assert beside is not None and _joined(beside._thread)
    assert beside.done and beside.rows is None
    assert "val 1 ends" not in log and _starts(log) == ["train 1 starts", "val 1 starts"]


def _joined(thread: Any) -> bool:
    thread.join(timeout=30)
    return not thread.is_alive()


def test_a_feed_starts_nothing_once_the_job_is_known_to_be_ending() -> None:
    """A training pass read to its end starts nothing after it once the rank knows the job ends (a
    preemption met in the epoch's last steps: the run checkpoints and returns, reading no other pass)."""
    feed, log, _ = _fake_feed(epochs=3, ending=lambda: True)
    assert len(list(feed.train(0))) == 2
    assert not feed._started and log == ["train 1 starts", "train 1 ends"]


class _Gated:
    """A task that yields a block, then makes the second only once ``gate`` exists (or half a
    minute has passed): its labels say whether the gate was open, i.e. whether the consumer had the first
    block's batch before the second block was made."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def __call__(self, _: Any) -> Any:
        import os
        import time

        import numpy as np

        def block(label: int) -> dict[str, Any]:  # of 16 rows, as the recipe's at 64 px
            return {"image": np.zeros((16, 64, 64, 3), np.uint8), "label": np.full(16, label),
                    "valid": np.ones(16, bool), "row_id": np.arange(16)}  # fmt: skip

        yield block(0)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        yield block(int(os.path.exists(self.gate)))


def test_a_pass_hands_on_its_first_batch_before_its_next_block_is_made(ray_local: object, tmp_path: Path) -> None:
    """The first batch of a pass leaves as soon as its block is made: Ray's own prefetching asked for the
    next block first, so a pass's first batch waited for two blocks to be decoded."""
    import ray.data
    import torch

    gate = tmp_path / "gate"
    data = ray.data.range(1, override_num_blocks=1).map_batches(_Gated(str(gate)), batch_size=None)
    data.context.target_max_block_size = pipeline.block_bytes(64, 16)  # each block leaves its task at once
    read = shards.batches(data.streaming_split(1, equal=True)[0], batch_size=16, device=torch.device("cpu"))
    first = next(read)
    gate.touch()
    second = list(read)
    assert first.labels.tolist() == [0] * 16
    assert [b.labels.tolist() for b in second] == [[1] * 16], "the first batch waited for the block after it"


def test_a_damaged_page_met_while_streaming_stops_the_run_naming_its_file(ray_local: object, tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    import torch

    from raytrain.errors import Fatal
    from tests.conftest import damage_a_page

    path = tmp_path / "d.parquet"
    pq.write_table(image_table(200), path, row_group_size=50)
    src = source.inspect(str(path))
    damage_a_page(path, column=0)
    train = pipeline.Streams(src, image_size=8, val_fraction=0.2).train(0)
    with pytest.raises(Fatal, match=rf"^data file {path} cannot be read \(Couldn't deserialize thrift.*: a page of it"):
        for _ in shards.batches(train.iterator(), batch_size=16, device=torch.device("cpu")):
            pass
