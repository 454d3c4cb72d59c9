"""Knowing, inside a training function, that the job is about to end, so a checkpoint can be taken at once.

``raytrain.ending_soon()`` is the one call a training function makes for it (the built-in recipe's loop
included); it works in any Ray Train function on a raytrain cluster, run through ``raytrain`` or not.

Two channels, both set by ``slurm/ray_cluster.sbatch`` when Slurm signals the job before its time limit:
Ray's own node drain (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``), which
``ray.train.get_preemption_info()`` reports; and, because ``drain-node`` is a hidden CLI that may change,
a flag file in the job's private directory on the head node, which rank 0 reads. Both checks are
collectives, run at the same step on every rank, so every rank stops at the same step.

Checking costs a barrier, so it runs about every ``target_s`` (5) seconds of training, as often as Ray's
own watcher polls for drains: the first steps are timed, the slowest rank's pace is agreed on by all,
and that sets the interval in steps.

Both channels carry a deadline (the drain's, and the flag file's text): the UNIX time by which the
training must have stopped, the batch script's margin for teardown and requeue already taken off. The
ranks agree on the earliest; ``ending_in()`` counts down to it, and the last sharded save is bounded by it.

On a cluster that several runs share, one run alone can be asked to end the same way: by a run of higher
priority that needs its room (``"yield"``: its driver queues it again and it resumes from the checkpoint)
or by ``raytrain cancel`` (``"cancel"``). Rank 0 reads that request (``raytrain.contracts.jobdir.EndRequest``)
beside the flag, in the same collective.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from raytrain.contracts import env, jobdir
from raytrain.service.collectives import all_reduce

RAY, FLAG = "ray-drain", "flag-file"
YIELD, CANCEL = jobdir.YIELD, jobdir.CANCEL  # this run alone: asked by a run of higher priority, or raytrain cancel
_CALIBRATION_STEPS = 5


class PreemptionWatch:
    """After each training step, says (collectively) whether the job is being preempted."""

    def __init__(
        self,
        flag_path: str | None,
        rank: int,
        device: torch.device,
        target_s: float = 5.0,
        request_path: str | None = None,
    ) -> None:
        self.flag_path = flag_path
        self.request_path = request_path  # this run's EndRequest, when it runs on a job's cluster
        self.rank = rank
        self.device = device
        self.target_s = target_s
        self.every = 1  # until calibrated
        self.via: str | None = None
        self.deadline: float | None = None  # UNIX time the training must have stopped by, once known
        self._steps = 0
        self._started: float | None = None

    def after_step(self) -> bool:
        self._steps += 1
        if self._steps == 1:
            self._started = time.perf_counter()
        elif self._steps == 1 + _CALIBRATION_STEPS and self._started is not None:
            step_s = (time.perf_counter() - self._started) / _CALIBRATION_STEPS
            pace = all_reduce({"step_s": step_s}, self.device, dist.ReduceOp.MAX)["step_s"]
            self.every = max(1, min(1000, round(self.target_s / max(pace, 1e-6))))
        due = self._steps % self.every == 0
        return (due and self.requested()) or self.via is not None

    def requested(self) -> bool:
        """Collective: True on every rank once either channel says the job is ending. Until a deadline
        is known too (the flag can come after a drain that had none), it goes on asking."""
        if self.via is not None and self.deadline is not None:
            return True
        import ray.train

        get_info: Any = getattr(ray.train, "get_preemption_info", None)
        info = get_info() if get_info is not None else None
        deadlines = [info.deadline_ms / 1000] if info is not None and getattr(info, "deadline_ms", None) else []
        flagged = self.rank == 0 and bool(self.flag_path) and os.path.exists(str(self.flag_path))
        if flagged:
            deadlines += _flag_deadline(str(self.flag_path))
        request = jobdir.EndRequest.read(self.request_path) if self.rank == 0 and self.request_path else None
        if request is not None:
            deadlines.append(request.deadline)
        # One collective: MAX of the votes, and of minus the deadlines (the earliest; -inf where none).
        votes = all_reduce(
            {
                RAY: info is not None,
                FLAG: flagged,
                CANCEL: request is not None and request.why == CANCEL,
                YIELD: request is not None and request.why == YIELD,
                "-deadline": -min(deadlines, default=math.inf),
            },
            self.device,
            dist.ReduceOp.MAX,
        )
        # The first channel that said so stays the reason: a cancel first (a cancelled run must not resume
        # when the job ending at the same time requeues), then the job's end before a yield.
        if self.via is None:
            self.via = next((via for via in (CANCEL, RAY, FLAG, YIELD) if votes[via] > 0), None)
        if self.via is not None and math.isfinite(votes["-deadline"]):
            self.deadline = -votes["-deadline"]
        return self.via is not None


def _flag_deadline(path: str) -> list[float]:
    """The deadline the flag file holds (``raytrain.contracts.jobdir.PREEMPT_FLAG``); none if it is empty."""
    try:
        with open(path) as f:
            return [float(f.read().strip())]
    except (OSError, ValueError):
        return []


_watch: PreemptionWatch | None = None


def configure(flag_path: str | None) -> None:
    """Set this worker up for ``ending_soon`` (the service does it before a training function starts)."""
    global _watch
    import ray
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    job_dir = env.JOB_DIR.get()
    request = None
    if job_dir:  # a job's cluster, which other runs may share: where this run is asked to end
        name = jobdir.request_name(ray.get_runtime_context().get_job_id(), context.get_experiment_name())
        request = os.path.join(job_dir, jobdir.QUEUE, name)
    _watch = PreemptionWatch(flag_path, context.get_world_rank(), ray.train.torch.get_device(), request_path=request)


def _current() -> PreemptionWatch:
    if _watch is None:  # a script that runs its own TorchTrainer on a raytrain cluster
        job_dir = env.JOB_DIR.get()
        configure(os.path.join(job_dir, jobdir.PREEMPT_FLAG) if job_dir else None)
    assert _watch is not None
    return _watch


def ending_soon(*, now: bool = False) -> bool:
    """Whether the job ends soon (a Slurm time limit or preemption is near), or this run was asked to end
    (a run of higher priority needs its room, or ``raytrain cancel``): checkpoint and return.

    Call it in a Ray Train function on every rank at the same point, as you call ``ray.train.report``:
    it is a collective, so every rank gets the same answer at the same step. Cheap enough for every
    step: it checks about every 5 s of training (the pace is measured on the first steps) and answers
    False in between; ``now=True`` checks at once (at the end of an epoch, say). Once True, it stays True.
    A function run by ``raytrain`` that returns after it said True ends the attempt as preempted: the job
    requeues (or, having yielded, the run queues again) and the next attempt resumes from the last
    checkpoint; a cancelled run ends.
    """
    watch = _current()
    return watch.requested() if now else watch.after_step()


def ending_in() -> float | None:
    """Seconds left until the training must have stopped, once ``ending_soon`` said the job ends (Slurm's
    time left, less the margin the batch script keeps for teardown and requeue); None before, or when
    neither channel could say. May be negative: the time is up."""
    if _watch is None or _watch.deadline is None:
        return None
    return _watch.deadline - time.time()


def ending_reason() -> str | None:
    """Why the training ends soon, once ``ending_soon`` said so: the job ends (``"ray-drain"`` or
    ``"flag-file"``), or this run was asked to (``"yield"`` to a run of higher priority, ``"cancel"``)."""
    return _watch.via if _watch is not None else None


def job_ending() -> bool:
    """Outside the ranks (a sweep's trial about to start one), without a collective: whether the job has
    said it ends soon, by either channel (a node drained for it, or the flag in the job's directory)."""
    from raytrain import ray_internals

    job_dir = env.JOB_DIR.get()
    flagged = bool(job_dir) and os.path.exists(os.path.join(str(job_dir), jobdir.PREEMPT_FLAG))
    return flagged or bool(ray_internals.draining_nodes())
