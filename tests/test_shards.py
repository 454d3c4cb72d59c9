"""Ray Train + the streamed Ray Data pipeline: every epoch, 2 workers get disjoint, equal shards that cover it.
(Data held in memory by the ranks: tests/test_memory.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from raytrain.recipe.data import pipeline, source
from tests.conftest import image_table, write_parquet

pytestmark = pytest.mark.ray
EPOCHS = 3


def _collect_rows(config: dict[str, Any]) -> None:
    """A training function that only records which rows (by content hash) this worker saw, in order."""
    import ray.train
    import torch

    shard = ray.train.get_dataset_shard(pipeline.TRAIN)
    for epoch in range(EPOCHS):
        batches = pipeline.batches(shard, batch_size=7, device=torch.device("cpu"))
        seen = [hashlib.sha1(img.numpy().tobytes()).hexdigest() for images, *_ in batches for img in images]
        ray.train.report({"epoch": epoch, "rank": ray.train.get_context().get_world_rank(), "rows": seen})


def train_rows(table: pa.Table) -> set[str]:
    import numpy as np

    kept = pipeline.hash_split(table, keep=pipeline.TRAIN, val_fraction=0.2)
    decoded = pipeline.decode(kept, size=8)["image"]
    return {hashlib.sha1(np.ascontiguousarray(img).tobytes()).hexdigest() for img in decoded}


def test_two_workers_get_disjoint_covering_reshuffled_shards(ray_local: object, tmp_path: Path) -> None:
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain.service.reports import Reports

    table = image_table(300)
    if len(train_rows(table)) % 2:  # an even epoch, so that equal shards can cover it exactly
        table = table.slice(1)
    expected = train_rows(table)
    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", table)))
    data = pipeline.build(src, image_size=8, val_fraction=0.2)
    trainer = TorchTrainer(
        _collect_rows,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        datasets=data.for_trainer(),
        run_config=ray.train.RunConfig(name="shards", storage_path=str(tmp_path / "runs")),
    )
    with Reports(lambda record: None) as reports:
        trainer.run_config.callbacks.append(reports.callback())
        trainer.fit()
    assert len(reports.events.reports) == EPOCHS
    orders = []
    for report in reports.events.reports:
        by_rank = {w["rank"]: w["rows"] for w in report.metrics}
        a, b = by_rank[0], by_rank[1]
        assert len(a) == len(b) == len(expected) // 2
        assert set(a).isdisjoint(b)
        assert set(a) | set(b) == expected
        orders.append(a + b)
    assert len({tuple(o) for o in orders}) == EPOCHS, "the order must change every epoch"


def test_the_rest_of_a_preempted_epoch_is_exactly_its_untrained_rows(ray_local: object, tmp_path: Path) -> None:
    import numpy as np

    table = image_table(200)
    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", table)))
    kept = pipeline.hash_split(table, keep=pipeline.TRAIN, val_fraction=0.2)
    every = pipeline.row_ids(kept.column("image").to_pylist())
    trained = every[::3]  # what the epoch trained before the job ended
    data = pipeline.build(src, image_size=8, val_fraction=0.2, seed=1, trained=trained)
    assert data.rest is not None and pipeline.TRAIN_REST in data.for_trainer()
    rest = np.concatenate([b[pipeline.ROW_ID] for b in data.rest.iter_batches(batch_format="numpy")])
    assert len(rest) == len(set(rest.tolist())) == len(every) - len(trained)
    assert set(rest.tolist()) == set(every.tolist()) - set(trained.tolist())
    full = np.concatenate([b[pipeline.ROW_ID] for b in data.train.iter_batches(batch_format="numpy")])
    assert sorted(full.tolist()) == sorted(every.tolist())  # the later epochs see every row


def test_a_resumed_attempt_shuffles_by_the_epoch_it_starts_at(ray_local: object, tmp_path: Path) -> None:
    """Ray Data numbers executions from 0 in each driver: a run resumed after 2 epochs must not replay
    epoch 1's order, and the same seed and epoch give the same order (with Ray Data keeping order)."""
    import numpy as np
    import ray.data

    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", image_table(200))))
    options = ray.data.DataContext.get_current().execution_options
    keep, options.preserve_order = options.preserve_order, True
    try:

        def first_epoch(epochs_done: int) -> list[int]:
            seed = pipeline.epoch_seed(1, epochs_done)
            data = pipeline.build(src, image_size=8, val_fraction=0.2, seed=seed)
            return np.concatenate([b[pipeline.ROW_ID] for b in data.train.iter_batches(batch_format="numpy")]).tolist()

        fresh, again, resumed = first_epoch(0), first_epoch(0), first_epoch(2)
    finally:
        options.preserve_order = keep
    assert fresh == again
    assert sorted(resumed) == sorted(fresh) and resumed != fresh
