"""One Ray Train run of two CPU workers on a local Ray (this machine's 2 cores), for benchmarks that
measure two sides inside one run: rank 0 writes what it measured to a file, which comes back here."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from typing import Any


def run(train_func: Callable[[dict[str, Any]], None], config: dict[str, Any]) -> Any:
    """Run ``train_func`` on two workers (one CPU each, gloo) with ``config`` plus ``out``: the file its
    rank 0 writes its JSON findings to; those findings, parsed."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory(dir="/var/tmp") as storage, tempfile.NamedTemporaryFile(suffix=".json") as out:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            TorchTrainer(
                train_func,
                train_loop_config={**config, "out": out.name},
                scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                run_config=ray.train.RunConfig(storage_path=storage, name="bench"),
            ).fit()
        finally:
            ray.shutdown()
        with open(out.name) as f:
            return json.load(f)
