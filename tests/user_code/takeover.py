"""A training function during which another driver takes the run over (as a driver that wrongly judged
this one gone would): after its first checkpoint, rank 0 rewrites the run's lock to name someone else,
then the function tries to report a second checkpoint. Config: run_dir (the run directory)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import ray.train

from raytrain.contracts.rundir import LOCK

OTHER = {"nonce": "0123456789abcdef", "host": "node9", "pid": 4242, "slurm_job": "77", "since": "20261124T000000Z"}


def _report(epoch: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "state.txt").write_text(f"epoch {epoch}")
        ray.train.report(
            {"epoch": epoch},
            checkpoint=ray.train.Checkpoint.from_directory(directory),
            checkpoint_dir_name=f"epoch_{epoch:04d}",
        )


def train_func(config: dict[str, Any]) -> None:
    import json

    _report(1)
    if ray.train.get_context().get_world_rank() == 0:
        lock = Path(config["run_dir"]) / LOCK
        lock.write_text(json.dumps(OTHER))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    _report(2)
    os.environ["RAYTRAIN_TEST_REACHED"] = "1"  # never: the second report must fail
