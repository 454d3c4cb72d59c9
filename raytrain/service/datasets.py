"""How Ray Train hands a run's datasets to its workers: Ray's ``DataConfig``, with one change.

A dataset already materialized in the object store (the recipe's validation split when the data is kept
in memory) is split by its blocks, equally, as ``streaming_split`` would split it, but without a
``SplitCoordinator``: that actor is a process of its own (about 1.5 s of CPU to start, on the path to
the first batch) that would only ever hand out blocks that never execute again. Every other dataset is
split as Ray splits it, with Ray's defaults (every dataset split, streamed shards near their workers;
``split`` takes actor handles, not node ids, as locality hints, so materialized blocks are split without).
"""

from __future__ import annotations

from typing import Any

import ray.train


class Shards(ray.train.DataConfig):  # type: ignore[misc,unused-ignore]
    def configure(
        self,
        datasets: dict[str, Any],
        world_size: int,
        worker_handles: Any,
        worker_node_ids: list[str] | None,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        from ray.data.dataset import MaterializedDataset

        kept = {k: v for k, v in datasets.items() if isinstance(v, MaterializedDataset)}
        rest = {k: v for k, v in datasets.items() if k not in kept}
        out: list[dict[str, Any]] = [{} for _ in range(world_size)]
        if rest:
            out = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs)
        for name, ds in kept.items():
            for rank, part in enumerate(ds.split(world_size, equal=True)):
                out[rank][name] = part.iterator()
        return out
