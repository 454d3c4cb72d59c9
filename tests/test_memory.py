"""Data held in memory by the ranks themselves (raytrain.recipe.data.memory): each rank's share, as every
rank of a world would load it, and the batches of its epochs. Real Parquet files, no Ray."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from raytrain.recipe.data import augment, memory, pipeline, source
from tests.conftest import damage_a_page, image_table, write_parquet

CPU = torch.device("cpu")


def spec_of(path: Path, *, seed: int = 0, aug: augment.Augment = pipeline.NO_AUGMENT) -> memory.Spec:
    return memory.Spec(source.inspect(str(path)), image_size=8, val_fraction=0.2, seed=seed, aug=aug)


def shares(spec: memory.Spec, world: int) -> list[memory.Share]:
    return [memory.load(spec, rank, world) for rank in range(world)]


def split_ids(table: pa.Table) -> tuple[set[int], set[int]]:
    """The row ids of the hash split's training and validation rows."""
    ids = pipeline.row_ids(table.column("image").to_pylist())
    held_out = pipeline.in_val(table.column("image").to_pylist(), 0.2)
    return set(ids[~held_out].tolist()), set(ids[held_out].tolist())


def feed(share: memory.Share, rank: int, *, seed: int = 0, batch_size: int = 7, **kw: object) -> memory.Feed:
    return memory.Feed(share, rank, seed, batch_size, CPU, pipeline.NO_AUGMENT, agree=lambda n: n, **kw)  # type: ignore[arg-type]


def rows_of(batches: object) -> list[int]:
    return [int(i) for b in batches for i in b.ids]  # type: ignore[attr-defined]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shares_are_disjoint_within_one_row_and_cover_both_splits(tmp_path: Path, world: int) -> None:
    table = image_table(301)
    train, val = split_ids(table)
    parts = shares(spec_of(write_parquet(tmp_path / "d.parquet", table)), world)
    mine = [set(p.train.ids.tolist()) for p in parts]
    assert set().union(*mine) == train and sum(len(m) for m in mine) == len(train)
    assert max(map(len, mine)) - min(map(len, mine)) <= 1
    assert {p.epoch_rows for p in parts} == {len(train) // world}
    held = [set(p.val.ids.tolist()) for p in parts]
    assert set().union(*held) == val and sum(len(h) for h in held) == len(val)
    for p in parts:  # decoded as validation decodes: the images at their size, every one usable
        assert p.train.images.shape[1:] == (8, 8, 3) and p.train.valid.all()


def test_a_dataset_sorted_by_class_gives_every_rank_every_class_evenly(tmp_path: Path) -> None:
    table = image_table(600, classes=3)
    table = table.sort_by("label")  # 200 of class 0, then 200 of 1, then 200 of 2
    for p in shares(spec_of(write_parquet(tmp_path / "d.parquet", table)), 4):
        counts = np.bincount(p.train.labels, minlength=3)
        assert counts.min() >= counts.sum() / 3 - 2, counts  # rounds of 4 rows deal one to each rank


def test_a_validation_split_of_its_own_is_dealt_round_robin(tmp_path: Path) -> None:
    write_parquet(tmp_path / "d/train/a.parquet", image_table(40, seed=1))
    write_parquet(tmp_path / "d/val/a.parquet", image_table(9, seed=2))
    parts = shares(spec_of(tmp_path / "d"), 2)
    assert sorted(len(p.train) for p in parts) == [20, 20] and {p.epoch_rows for p in parts} == {20}
    assert sorted(len(p.val) for p in parts) == [4, 5]


def test_every_epoch_trains_the_same_count_on_every_rank_in_a_new_order(tmp_path: Path) -> None:
    parts = shares(spec_of(write_parquet(tmp_path / "d.parquet", image_table(203))), 2)
    epochs = [[rows_of(feed(p, rank).train(epoch)) for rank, p in enumerate(parts)] for epoch in range(3)]
    for ranks in epochs:
        assert len(ranks[0]) == len(ranks[1]) == parts[0].epoch_rows
        assert set(ranks[0]).isdisjoint(ranks[1])
    assert len({tuple(e[0]) for e in epochs}) == 3, "the order must change every epoch"
    again = rows_of(feed(parts[0], 0).train(1))
    assert again == epochs[1][0], "the same seed, epoch and rank give the same order (a resumed attempt)"
    other_seed = rows_of(feed(parts[0], 0, seed=9).train(1))
    assert other_seed != again


def test_the_rest_of_a_preempted_epoch_is_exactly_its_untrained_rows(tmp_path: Path) -> None:
    parts = shares(spec_of(write_parquet(tmp_path / "d.parquet", image_table(200))), 2)
    trained = np.concatenate([rows_of(feed(p, r).train(4))[:21] for r, p in enumerate(parts)])  # 3 batches each
    counts: list[int] = []

    def agree(n: int) -> int:  # the smallest over the ranks, as the collective gives it
        counts.append(n)
        return min(len(p.train) - 21 for p in parts)

    rest = [rows_of(memory.Feed(p, r, 0, 7, CPU, pipeline.NO_AUGMENT, agree, trained=trained).train(4, rest=True))
            for r, p in enumerate(parts)]  # fmt: skip
    everything = set(parts[0].train.ids.tolist()) | set(parts[1].train.ids.tolist())
    assert len(rest[0]) == len(rest[1]) == parts[0].epoch_rows - 21
    assert set(rest[0]) | set(rest[1]) | set(trained.tolist()) <= everything
    assert not (set(rest[0]) | set(rest[1])) & set(trained.tolist())
    assert len(set(rest[0]) | set(rest[1])) + len(trained) >= 2 * parts[0].epoch_rows
    assert counts == [len(p.train) - 21 for p in parts]


def test_augmented_batches_follow_the_seed_and_keep_labels_with_their_images(tmp_path: Path) -> None:
    spec = spec_of(write_parquet(tmp_path / "d.parquet", image_table(60, size=12)), aug=augment.Augment())
    share = memory.load(spec, 0, 1)

    def epoch(e: int) -> list[torch.Tensor]:
        f = memory.Feed(share, 0, 0, 16, CPU, spec.aug, agree=lambda n: n, threads=2)
        return list(f.train(e))

    a, b, c = epoch(0), epoch(0), epoch(1)
    assert all((x.images == y.images).all() and (x.ids == y.ids).all() for x, y in zip(a, b, strict=True))
    assert not all((x.images == y.images).all() for x, y in zip(a, c, strict=True))
    by_id = dict(zip(share.train.ids.tolist(), share.train.labels.tolist(), strict=True))
    assert all(by_id[int(i)] == int(label) for x in a for i, label in zip(x.ids, x.labels, strict=True))
    assert sum(len(x.labels) for x in a) == share.epoch_rows and a[0].images.dtype == torch.uint8


def test_an_error_in_the_batch_thread_is_raised_in_training_and_leaving_early_stops_it(tmp_path: Path) -> None:
    share = memory.load(spec_of(write_parquet(tmp_path / "d.parquet", image_table(100))), 0, 1)
    before = threading.active_count()
    batches = feed(share, 0, batch_size=4).train(0)
    next(batches)
    batches.close()  # a preempted epoch leaves its loop after a few batches
    assert threading.active_count() == before

    broken = memory.Rows(share.train.images[:3], share.train.labels, share.train.valid, share.train.ids)
    with pytest.raises(IndexError):  # images for 3 rows only: the thread fails at the fourth
        list(memory.batches(broken, np.arange(8), batch_size=2, device=CPU))
    assert threading.active_count() == before


def test_a_damaged_page_fails_the_run_at_once_naming_the_file(tmp_path: Path) -> None:
    """Its footer is fine, so the data check passes; the rank that reads the page stops the run: no retry
    of the workers could read it (raytrain.Fatal), and the line says which file and what to do."""
    import pyarrow.parquet as pq

    from raytrain.errors import Fatal

    path = tmp_path / "d.parquet"
    pq.write_table(image_table(200), path, row_group_size=50)
    damage_a_page(path, column=0)
    spec = spec_of(path)  # checked: footers and labels are readable
    with pytest.raises(Fatal, match=rf"^data file {path} cannot be read \(Couldn't deserialize thrift.*: a page of it"):
        memory.load(spec, 0, 1)


def test_a_damaged_label_page_is_found_by_the_check(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from raytrain.errors import UserError

    path = tmp_path / "d.parquet"
    pq.write_table(image_table(200), path, row_group_size=50)
    damage_a_page(path, column=1)
    with pytest.raises(UserError, match=rf"^data file {path} cannot be read .*replace it, or leave it out of --data"):
        source.inspect(str(path))


def test_a_file_removed_after_the_check_fails_the_run_at_once(tmp_path: Path) -> None:
    from raytrain.errors import Fatal

    write_parquet(tmp_path / "d/part-0.parquet", image_table(60))
    gone = write_parquet(tmp_path / "d/part-1.parquet", image_table(60, seed=1))
    spec = spec_of(tmp_path / "d")
    gone.unlink()
    with pytest.raises(Fatal, match=rf"^data file {gone} was removed after the data was checked: put it back"):
        memory.load(spec, 0, 1)


@pytest.mark.parametrize("store_bytes", [1 << 30, 1])
def test_data_that_streams_is_refused_a_plan_that_leaves_its_reads_no_whole_cpu(
    tmp_path: Path, store_bytes: int
) -> None:
    # Held by the ranks (a large object store), the data needs no Ray Data task; streamed (an object store
    # too small to hold it), its first read would wait forever for a whole CPU the workers left no node.
    from raytrain.errors import UserError
    from raytrain.recipe.config import DataConfig, FitConfig
    from raytrain.recipe.fit import ImageClassifier
    from raytrain.service import runs
    from raytrain.service.cluster import NodeInfo
    from raytrain.service.config import ScaleConfig
    from raytrain.service.placement import make_plan

    data = write_parquet(tmp_path / "d.parquet", image_table(40))
    workload = ImageClassifier(cfg=FitConfig(data=DataConfig(uri=str(data), image_size=8)))
    workload = workload.prepare(runs.Storage.open(str(tmp_path / "runs")))
    one = NodeInfo(node_id="n1", hostname="node1", ip="10.0.0.1", cpus=2, gpus=0, object_store_bytes=store_bytes)
    plan = make_plan([one], ScaleConfig(workers=2, device="cpu", cpus_per_worker=0.75))
    if store_bytes > 1:
        workload.check_plan(plan, dry_run=False)
        return
    with pytest.raises(UserError, match=r"so it streams through Ray Data, .* leave at most 0\.5 CPUs free"):
        workload.check_plan(plan, dry_run=False)
