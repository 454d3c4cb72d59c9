"""Progress within an epoch (``raytrain.progress``) and raytrain's Ray metrics.

A training function calls ``raytrain.progress(step, samples=...)`` after each training step, on every
rank (it is local: no collective, no device sync). About once a second each rank sets its Ray metrics
(samples/s, step time, data wait, GPU memory; ``raytrain.contracts.metrics``), which every node's Ray
metrics agent exports beside Ray's own, and rank 0 posts a ``Progress`` event to the driver, which shows
it as a live line on a terminal or a plain line at a steady interval in a batch log.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from raytrain.contracts import metrics as keys
from raytrain.service.events import Progress, post

POST_EVERY_S = 1.0  # how often a rank updates its metrics and rank 0 tells the driver


class _Gauges:
    """This rank's step metrics as Ray metrics."""

    def __init__(self, tags: dict[str, str]) -> None:
        from ray.util.metrics import Gauge

        def gauge(name: str, what: str) -> Any:
            g = Gauge(name, description=what, tag_keys=keys.STEP_TAGS)
            g.set_default_tags(tags)
            return g

        self.samples_per_s = gauge(keys.SAMPLES_PER_S, "training samples per second of one rank")
        self.step_time = gauge(keys.STEP_TIME, "mean seconds per training step of one rank, data wait included")
        self.data_wait = gauge(keys.DATA_WAIT, "mean seconds per step one rank waited for its next batch")
        self.gpu_memory = gauge(keys.GPU_MEMORY, "the most GPU memory one rank's torch has allocated")


class StepMeter:
    """Counts one rank's steps and, about every ``every_s``, sets its metrics and (rank 0) posts Progress."""

    def __init__(
        self,
        post: Any,
        rank: int,
        tags: dict[str, str],
        every_s: float = POST_EVERY_S,
        clock: Callable[[], float] = time.perf_counter,
        world: int = 1,
    ) -> None:
        self.post = post
        self.world = world
        self._clock = clock
        self.rank = rank
        self.every_s = every_s
        self._tags = tags
        self._gauges: _Gauges | None = None
        self._epoch: int | None = None
        self._last_step = -1
        self._prev: float | None = None  # the time of the previous call in this epoch
        self._posted = float("-inf")
        self._samples = self._steps = 0
        self._time = self._wait = 0.0

    def __call__(
        self,
        step: int,
        samples: int,
        steps: int | None,
        epoch: int | None,
        epochs: int | None,
        data_wait_s: float | None,
    ) -> None:
        now = self._clock()
        if epoch != self._epoch or step <= self._last_step:  # a new epoch: its first step has no pace yet
            self._epoch, self._prev, self._posted = epoch, None, float("-inf")
            self._samples = self._steps = 0
            self._time = self._wait = 0.0
        self._last_step = step
        if self._prev is not None:
            self._samples += samples
            self._steps += 1
            self._time += now - self._prev
            self._wait += data_wait_s or 0.0
        self._prev = now
        if now - self._posted < self.every_s:
            return
        self._posted = now
        rate = self._samples / self._time if self._time > 0 else None
        step_time = self._time / self._steps if self._steps else None
        if rate is not None and step_time is not None:
            self._set_gauges(rate, step_time, self._wait / self._steps if data_wait_s is not None else None)
        self._samples = self._steps = 0
        self._time = self._wait = 0.0
        if self.rank == 0:
            run_rate = rate * self.world if rate is not None else None
            self.post(Progress(step, steps, epoch, epochs, run_rate, step_time, time.time()))

    def _set_gauges(self, rate: float, step_time: float, wait: float | None) -> None:
        import torch

        try:
            if self._gauges is None:
                self._gauges = _Gauges(self._tags)
            self._gauges.samples_per_s.set(rate)
            self._gauges.step_time.set(step_time)
            if wait is not None:
                self._gauges.data_wait.set(wait)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self._gauges.gpu_memory.set(float(torch.cuda.max_memory_allocated()))
        except Exception:  # metrics are for watching; they never stop training
            self._gauges = None


class ReportGauges:
    """Every number of rank 0's reports as a Ray metric (``raytrain_report_<key>``), set where the reports
    arrive: the driver, or Ray Train's controller for a script's own trainer."""

    def __init__(self, run: str, job: str) -> None:
        self._tags = {"run": run, "slurm_job_id": job}
        self._gauges: dict[str, Any] = {}
        self._off = False

    def set(self, metrics: dict[str, Any]) -> None:
        if self._off:
            return
        try:
            from ray.util.metrics import Gauge

            for key, value in keys.numbers(metrics).items():
                name = keys.report_metric(key)
                if name not in self._gauges:
                    self._gauges[name] = Gauge(
                        name, description=f"{key!r} of rank 0's last report", tag_keys=keys.REPORT_TAGS
                    )
                    self._gauges[name].set_default_tags(self._tags)
                self._gauges[name].set(value)
        except Exception:  # metrics are for watching: a failure turns them off, never training
            self._off = True


_meter: StepMeter | None = None
_looked = False  # a training function not run by raytrain's service: whether this worker was looked at


def configure(events: Any, *, rank: int, world: int, run: str, job: str) -> None:
    """Set this worker up for ``progress`` (the service does it before a training function starts)."""
    global _meter
    tags = {"run": run, "slurm_job_id": job, "rank": str(rank)}
    _meter = StepMeter(lambda item: post(events, item), rank, tags, world=world)


def _own_trainer() -> StepMeter | None:
    """A script's own trainer (no driver of raytrain's to tell): the rank's Ray metrics still count."""
    global _looked, _meter
    if not _looked:
        _looked = True
        with contextlib.suppress(Exception):  # not in a Ray Train worker: progress does nothing
            import ray.train

            from raytrain import slurm_env

            ctx = ray.train.get_context()
            rank = ctx.get_world_rank()
            tags = {"run": ctx.get_experiment_name(), "slurm_job_id": slurm_env.job_label(), "rank": str(rank)}
            _meter = StepMeter(lambda item: None, rank, tags)
    return _meter


def progress(
    step: int,
    *,
    samples: int,
    steps: int | None = None,
    epoch: int | None = None,
    epochs: int | None = None,
    data_wait_s: float | None = None,
) -> None:
    """Say that training step ``step`` (counted from 1 in each epoch) of ``samples`` samples is done.

    Call it on every rank after each step; it is cheap (a clock read; about once a second a metric
    update, and on rank 0 a message to the driver) and never a collective. ``steps``: the epoch's steps,
    if known (for the ETA); ``epoch``/``epochs``: the epoch in progress, from 1, and the run's count;
    ``data_wait_s``: how long this step waited for its batch. In a script's own trainer it sets the
    rank's Ray metrics only (no driver of raytrain's shows a line); outside Ray Train it does nothing.
    """
    meter = _meter or _own_trainer()
    if meter is not None:
        with contextlib.suppress(Exception):  # progress is for watching; it never stops training
            meter(step, samples, steps, epoch, epochs, data_wait_s)
