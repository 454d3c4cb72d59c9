"""Epoch progress from the Ray Train controller to the driver's terminal.

The controller calls ``after_report`` once all workers have reported an epoch; the callback forwards the
per-worker metrics through a small queue actor, and the driver prints one line per epoch from it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import ray
import ray.train
from ray.exceptions import RayError
from ray.util.queue import Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class ForwardReports(ray.train.UserCallback):  # type: ignore[misc,unused-ignore]
    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        self.queue.put({"metrics": metrics, "checkpoint": checkpoint.path if checkpoint else None})


def epoch_line(m: dict[str, Any]) -> str:
    width = len(str(m["epochs"]))
    if m.get("preempted"):
        return (
            f"epoch {m['epoch']:>{width}}/{m['epochs']}  stopped after {m['batches_done']} batches: the job is "
            f"ending ({m['preempted']}); checkpoint saved, it resumes from there"
        )
    return (
        f"epoch {m['epoch']:>{width}}/{m['epochs']}  loss {m['train_loss']:.4f}  acc {100 * m['train_acc']:5.1f}%  "
        f"val_loss {m['val_loss']:.4f}  val_acc {100 * m['val_acc']:5.1f}%  "
        f"{m['samples_per_s']:,.0f} samples/s  {m['epoch_time_s']:.1f} s"
    )


class Reports:
    """Collects the epochs as they arrive and hands each to ``on_epoch`` from a background thread.

    The thread blocks on the queue (one call per epoch, no polling: on a small node every poll is CPU
    taken from training) until ``__exit__`` puts an end marker behind the last report. The queue actor
    lives on the driver's node: anywhere else it would die with its node (a failed node, or the node
    whose Ray gets scancel's SIGTERM before the driver does). Should it die all the same, the reports
    stop quietly (``lost`` says why) and training's own outcome stands.
    """

    _END = "raytrain:end-of-reports"

    def __init__(self, on_epoch: Callable[[dict[str, Any]], None]) -> None:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        self.lost: RayError | None = None
        self.epochs: list[dict[str, Any]] = []
        self._on_epoch = on_epoch
        self._thread = threading.Thread(target=self._pump, name="raytrain-progress", daemon=True)

    def callback(self) -> ForwardReports:
        return ForwardReports(self.queue)

    def __enter__(self) -> Reports:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(RayError):
            self.queue.put(self._END)
        self._thread.join()
        with contextlib.suppress(RayError):
            self.queue.shutdown()

    def _take(self, item: dict[str, Any]) -> None:
        record = {"workers": item["metrics"], "checkpoint": item["checkpoint"]}
        self.epochs.append(record)
        self._on_epoch(record)

    def _pump(self) -> None:
        try:
            while (item := self.queue.get(block=True)) != self._END:
                self._take(item)
        except RayError as exc:
            self.lost = exc
