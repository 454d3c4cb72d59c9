"""The metric keys raytrain's service reads from any training function's reports.

A training function reports whatever it likes with ``ray.train.report``; every report becomes a line on
the driver's terminal and an entry of ``result.json``'s history. These optional keys mean something to
the service itself. The built-in recipe's own keys are in ``raytrain.recipe.metrics``.
"""

from __future__ import annotations

from typing import Any, TypedDict

EPOCH = "epoch"  # int: the epoch the report is about (the line is then headed "epoch N")
EPOCHS = "epochs"  # int: the epochs the run will train (the line is then headed "epoch N/M")
STARTUP = "startup"  # first report of an attempt: Startup, for "first training step after ..." timings
RESUMED = "resumed"  # first report of an attempt: what it resumed from ({"checkpoint": path, ...})


class Startup(TypedDict):
    """Unix times, taken on rank 0."""

    first_batch_at: float | None
    first_step_at: float | None


Scalar = float | int | str | bool


def plain(metrics: dict[str, Any]) -> dict[str, Scalar]:
    """The plain values of a report, the epoch's included: what history.jsonl keeps of it."""
    return {k: v for k, v in metrics.items() if isinstance(v, Scalar) and k != EPOCHS}


def scalars(metrics: dict[str, Any]) -> dict[str, Scalar]:
    """The plain values of a report but the epoch, the ones a terminal line shows after "epoch N/M"."""
    return {k: v for k, v in plain(metrics).items() if k != EPOCH}


# raytrain's Ray metrics (``ray.util.metrics``), exported by each node's Ray metrics agent beside Ray's
# own; Prometheus sees each as ``ray_<name>``. The workers' step metrics, from ``raytrain.progress``:
SAMPLES_PER_S = "raytrain_samples_per_second"  # this rank's training samples per second
STEP_TIME = "raytrain_step_time_seconds"  # this rank's mean time per step, data wait included
DATA_WAIT = "raytrain_data_wait_seconds"  # this rank's mean wait for its next batch, per step
GPU_MEMORY = "raytrain_gpu_memory_bytes"  # the most GPU memory this rank's torch has allocated
STEP_TAGS = ("run", "slurm_job_id", "rank")
# Every number of rank 0's reports, set by the driver: raytrain_report_<key> (train_loss, val_acc,
# checkpoint_blocked_s, ...), the key with anything but [a-zA-Z0-9_] made "_".
REPORT_PREFIX = "raytrain_report_"
REPORT_TAGS = ("run", "slurm_job_id")
PROMETHEUS_PREFIX = "ray_"  # what Ray's exporter puts before every metric name


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a report (the epoch's included), the ones a curve or a gauge can take."""
    return {k: float(v) for k, v in plain(metrics).items() if not isinstance(v, bool | str)}


def report_metric(key: str) -> str:
    return REPORT_PREFIX + "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in key)
