"""The driver's side of a run's events (``raytrain.service.events``).

The controller calls ``after_report`` once all workers have reported; ``ForwardReports`` passes the
per-worker metrics on through a small queue actor, which the workers post their own events to. The driver
takes the events from a background thread (``Reports``), prints a line per report, and builds
``result.json`` from what it heard (``Events``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.train
from ray.exceptions import RayError
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain.contracts.jobdir import CANCEL
from raytrain.service.events import EndedEarly, Progress, Report, WorkersFailed, WorkerStarted

ACK_TIMEOUT_S = 30.0  # the most a report waits for the driver to record it before Tune hears of it


@dataclass(frozen=True)
class Elastic:
    """An elastic run's floor: ``min_workers`` of ``per_worker`` resources each."""

    min_workers: int
    per_worker: dict[str, float]

    def capacity(self) -> int:
        """How many workers the live nodes hold, by their total resources."""
        held = 0
        for node in ray.nodes():
            res = node.get("Resources") or {}
            if node.get("Alive"):
                held += int(min(res.get(k, 0.0) // v for k, v in self.per_worker.items() if v > 0))
        return held


class TooFewWorkers(Exception):
    """An elastic run's nodes left cannot hold its least worker count: the cluster failed under it."""


class ForwardReports(ray.train.UserCallback):  # type: ignore[misc,unused-ignore]
    """In the controller: each report to the driver; then, in a sweep's trial, to Ray Tune (``then``), once the
    driver has recorded it (``acks``): Tune may stop the trial on it at once, and the report must be in the
    run's history and tracker by then."""

    def __init__(
        self, queue: Queue, elastic: Elastic | None = None, then: Any = None, acks: Queue | None = None
    ) -> None:
        self.queue = queue
        self.elastic = elastic
        self.then = then
        self.acks = acks

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        self.queue.put(Report(metrics=metrics, checkpoint=checkpoint.path if checkpoint else None))
        if self.then is None:
            return
        if self.acks is not None:
            with contextlib.suppress(Empty, RayError):  # a driver that does not answer delays Tune no longer
                self.acks.get(block=True, timeout=ACK_TIMEOUT_S)
        self.then.after_report(run_context, metrics, checkpoint)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        """Post the failure; a ``raytrain.Fatal`` from any rank, or a full disk, stops the run now (raising
        here is the one way a callback has to keep Ray Train from restarting the workers)."""
        from raytrain.errors import Fatal
        from raytrain.ray_internals import user_exception
        from raytrain.service.outcomes import brief, cause, no_space, out_of_space

        errors = sorted((rank, user_exception(e)) for rank, e in worker_exceptions.items())
        fatal = [e for _, e in errors if isinstance(e, Fatal)] or [
            Fatal(no_space(e)) for _, e in errors if out_of_space(e)
        ][:1]
        error = fatal[0] if fatal else cause(dict(errors))[1]
        # Elastic: Ray Train would wait for ever for nodes that hold the least workers; end the attempt
        # instead, so that the job requeues (a new allocation) and resumes.
        held = self.elastic.capacity() if self.elastic and not fatal else None
        too_few = held is not None and self.elastic is not None and held < self.elastic.min_workers
        ranks = [r for r, _ in errors]
        self.queue.put(WorkersFailed(time.time(), ranks, brief(error), fatal=bool(fatal), too_few=too_few))
        if fatal:
            raise Fatal(str(fatal[0]))
        if too_few and self.elastic is not None:
            raise TooFewWorkers(
                f"the nodes left hold {held} workers, fewer than the {self.elastic.min_workers} that --workers "
                "MIN:MAX asks for at least"
            )


@dataclass
class Events:
    """Everything the driver has heard of the current attempt."""

    reports: list[Report] = field(default_factory=list)
    workers: dict[int, WorkerStarted] = field(default_factory=dict)  # the latest start of each rank
    starts: list[WorkerStarted] = field(default_factory=list)  # every start, first attempt and restarts
    failures: list[WorkersFailed] = field(default_factory=list)
    ended_early: EndedEarly | None = None
    cancelled: bool = False  # raytrain cancel ended it (rank 0 saw it, or the controller stopped it)

    def worker_groups(self) -> list[list[WorkerStarted]]:
        """Every start, grouped into the worker groups Ray Train started: a rank seen again, or another world
        size, begins a new group (an elastic group that grew may start its new rank before its others)."""
        groups: list[list[WorkerStarted]] = []
        for s in sorted(self.starts, key=lambda s: s.started_at):
            last = groups[-1] if groups else []
            if (
                not last
                or last[0].world_size != s.world_size
                or any(w.placement.rank == s.placement.rank for w in last)
            ):
                groups.append([])
            groups[-1].append(s)
        return groups

    def current_workers(self) -> list[WorkerStarted]:
        """The workers of the latest worker group (the ones started since the last failure), by rank."""
        since = self.failures[-1].at if self.failures else float("-inf")
        latest = {s.placement.rank: s for s in self.starts if s.started_at >= since}
        return [latest[r] for r in sorted(latest)] or [self.workers[r] for r in sorted(self.workers)]


class Reports:
    """Collects the events as they arrive and hands each report to ``on_report`` from a background thread.

    The thread blocks on the queue (one call per event, no polling: on a small node every poll is CPU
    taken from training) until ``__exit__`` puts an end marker behind the last event. The queue actor
    lives on the driver's node: anywhere else it would die with its node (a failed node, or the node
    whose Ray gets scancel's SIGTERM before the driver does). Should it die all the same, the events
    stop quietly (``lost`` says why) and training's own outcome stands.
    """

    _END = "raytrain:end-of-reports"

    def __init__(
        self,
        on_report: Callable[[Report], None],
        on_failure: Callable[[WorkersFailed], None] = lambda f: None,
        elastic: Elastic | None = None,
        on_progress: Callable[[Progress], None] = lambda p: None,
    ) -> None:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        self.lost: RayError | None = None
        self.events = Events()
        self._on_report = on_report
        self._on_failure = on_failure
        self._on_progress = on_progress
        self._elastic = elastic
        self._thread = threading.Thread(target=self._pump, name="raytrain-progress", daemon=True)
        self._acks: Queue | None = None  # each report recorded, for the callback to hand it on (a sweep's trial)

    def callback(self, then: Any = None) -> ForwardReports:
        """The callback that forwards the reports here (and, once each is recorded, to ``then``)."""
        if then is not None and self._acks is None:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self._acks = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        return ForwardReports(self.queue, self._elastic, then, self._acks)

    @property
    def epochs(self) -> list[Report]:
        return self.events.reports

    def __enter__(self) -> Reports:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(RayError):
            self.queue.put(self._END)
        self._thread.join()
        with contextlib.suppress(RayError):
            self.queue.shutdown()
            if self._acks is not None:
                self._acks.shutdown()

    def _take(self, item: object) -> None:
        if isinstance(item, Report):
            self.events.reports.append(item)
            try:
                self._on_report(item)
            finally:
                if self._acks is not None:
                    with contextlib.suppress(RayError):
                        self._acks.put(True)
        elif isinstance(item, WorkerStarted):
            self.events.workers[item.placement.rank] = item
            self.events.starts.append(item)
        elif isinstance(item, WorkersFailed):
            self.events.failures.append(item)
            self._on_failure(item)
        elif isinstance(item, EndedEarly):
            self.events.ended_early = item
            self.events.cancelled = self.events.cancelled or item.via == CANCEL
        elif isinstance(item, Progress):
            self._on_progress(item)

    def _pump(self) -> None:
        try:
            while (item := self.queue.get(block=True)) != self._END:
                self._take(item)
        except RayError as exc:
            self.lost = exc
