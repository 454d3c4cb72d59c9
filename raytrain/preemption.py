"""Knowing, inside the training loop, that the job is about to end, so a checkpoint can be taken at once.

Two channels, both set by ``slurm/ray_cluster.sbatch`` when Slurm signals the job before its time limit:
Ray's own node drain (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``), which
``ray.train.get_preemption_info()`` reports; and, because ``drain-node`` is a hidden CLI that may change,
a flag file in the job's private directory on the head node, which rank 0 reads. Both checks are
collectives, run at the same step on every rank, so every rank stops at the same step.

Checking costs a barrier, so it runs about every ``target_s`` (5) seconds of training, as often as Ray's
own watcher polls for drains: the first steps are timed, the slowest rank's pace is agreed on by all,
and that sets the interval in steps.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from raytrain.collectives import all_reduce

RAY, FLAG = "ray-drain", "flag-file"
_CALIBRATION_STEPS = 5


class PreemptionWatch:
    """After each training step, says (collectively) whether the job is being preempted."""

    def __init__(self, flag_path: str | None, rank: int, device: torch.device, target_s: float = 5.0) -> None:
        self.flag_path = flag_path
        self.rank = rank
        self.device = device
        self.target_s = target_s
        self.every = 1  # until calibrated
        self.via: str | None = None
        self._steps = 0
        self._started: float | None = None

    def after_step(self) -> bool:
        self._steps += 1
        if self._steps == 1:
            self._started = time.perf_counter()
        elif self._steps == 1 + _CALIBRATION_STEPS and self._started is not None:
            (pace,) = all_reduce(
                [(time.perf_counter() - self._started) / _CALIBRATION_STEPS], self.device, dist.ReduceOp.MAX
            )
            self.every = max(1, min(1000, round(self.target_s / max(pace, 1e-6))))
        return self._steps % self.every == 0 and self.requested()

    def requested(self) -> bool:
        """Collective: True on every rank once either channel says the job is ending."""
        if self.via:
            return True
        import ray.train

        get_info: Any = getattr(ray.train, "get_preemption_info", None)
        from_ray = get_info is not None and get_info() is not None
        flagged = self.rank == 0 and bool(self.flag_path) and os.path.exists(str(self.flag_path))
        ray_vote, flag_vote = all_reduce([float(from_ray), float(flagged)], self.device, dist.ReduceOp.MAX)
        if ray_vote > 0:
            self.via = RAY
        elif flag_vote > 0:
            self.via = FLAG
        return self.via is not None
