"""Events of a run: reports from the Ray Train controller to the driver (on a real local Ray), and what
the driver makes of the worker starts and failures it heard of."""

from __future__ import annotations

import threading

import pytest

from raytrain import waits
from raytrain.contracts.result import Placement
from raytrain.service.events import Report, WorkersFailed, WorkerStarted
from raytrain.service.reports import Events
from raytrain.service.trainer import _Attempt, _resizes, _restarts


@pytest.mark.ray
def test_reports_arrive_in_order_and_end_quietly_when_their_queue_dies(ray_local: object) -> None:
    import ray
    from ray.exceptions import RayActorError

    from raytrain.service.reports import Reports

    seen: list[Report] = []
    took_two = threading.Event()

    def on_report(report: Report) -> None:
        seen.append(report)
        if len(seen) == 2:
            took_two.set()

    with Reports(on_report) as reports:
        forward = reports.callback()
        for epoch in (1, 2):
            forward.after_report(None, [{"epoch": epoch}], None)
        assert took_two.wait(timeout=60)
        assert reports.queue.actor is not None
        ray.kill(reports.queue.actor)  # what a node going down does to the queue actor on it
        # ray.kill is asynchronous: let the pump find the queue gone before the block's end marker could
        # still reach a live queue.
        reports._thread.join(timeout=60)
        assert not reports._thread.is_alive()
    # The pump thread ended without a traceback, and leaving the block raised nothing.
    assert isinstance(reports.lost, RayActorError)
    assert [r.rank0["epoch"] for r in seen] == [1, 2] and reports.events.reports == seen


def _started(rank: int, at: float, host: str, world: int) -> WorkerStarted:
    where = Placement(rank=rank, hostname=host, ip="10.0.0.1", device="cpu")
    return WorkerStarted(where, started_at=at, world_size=world)


@pytest.mark.parametrize("grown", [(1, 0, 2), (2, 0, 1)], ids=["old-ranks-first", "new-rank-first"])
def test_an_elastic_run_that_shrank_on_a_failure_and_grew_back_records_one_restart_and_one_resize(
    grown: tuple[int, ...],
) -> None:
    """Three workers; node3's fails at 50 and two restart at 70; node3 is back and three start at 130, in
    any order: the rank on the node that came back may start first (seen on the testbed)."""
    events = Events(
        starts=[
            *(_started(r, 10 + r, f"node{r + 1}", 3) for r in range(3)),
            *(_started(r, 70 + r, f"node{r + 1}", 2) for r in range(2)),
            *(_started(r, 130 + i, f"node{r + 1}", 3) for i, r in enumerate(grown)),
        ],
        failures=[WorkersFailed(at=50.0, ranks=[2], error="node3 died")],
        reports=[
            Report(metrics=[{}] * 3, checkpoint="/runs/x/epoch_0001", received_at=40.0),
            Report(metrics=[{}] * 2, checkpoint="/runs/x/epoch_0002", received_at=100.0),
        ],
    )
    assert [len(g) for g in events.worker_groups()] == [3, 2, 3]
    attempt = _Attempt(started=0.0, since=0.0, what="command", resumes_from=None)
    (restart,) = _restarts(events, attempt)
    assert restart.resumed_from == "/runs/x/epoch_0001" and restart.restart_s == 71.0 - 50.0
    (grew,) = _resizes(events, attempt)
    assert (grew.workers, grew.were, grew.at_s) == (3, 2, 130.0)
    assert grew.resumed_from == "/runs/x/epoch_0002" and grew.cost_s == 30.0
    assert [w.placement.hostname for w in events.current_workers()] == ["node1", "node2", "node3"]


@pytest.mark.ray
def test_an_elastic_run_whose_nodes_left_hold_too_few_workers_ends_the_attempt(ray_local: object) -> None:
    """Ray Train would wait for ever for nodes that hold MIN workers: the callback ends the attempt as
    lost instead (the job then requeues), and posts why; with enough left, Ray Train restarts as usual."""
    import ray

    from raytrain.service.reports import Elastic, ForwardReports, Reports, TooFewWorkers

    held = sum(int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"])
    with Reports(lambda report: None) as reports:
        roomy = ForwardReports(reports.queue, Elastic(min_workers=held, per_worker={"CPU": 1.0}))
        roomy.after_exception(None, {1: RuntimeError("rank 1 died")})  # returns: Ray Train restarts
        cramped = ForwardReports(reports.queue, Elastic(min_workers=held + 1, per_worker={"CPU": 1.0}))
        with pytest.raises(TooFewWorkers, match=rf"the nodes left hold {held} workers, fewer than the {held + 1}"):
            cramped.after_exception(None, {0: RuntimeError("node lost")})
        # the pump thread takes the events off the queue
        waits.until(lambda: len(reports.events.failures) >= 2, timeout_s=60, every_s=0.05)
    assert [f.too_few for f in reports.events.failures] == [False, True]


def test_start_up_is_timed_from_the_command_process_start() -> None:
    """The first step's "N s after the command started" counts from the process's start (the interpreter
    and the imports included), to the kernel's clock tick, not from when the driver's code began."""
    import subprocess
    import sys
    import time

    code = "import time; t = time.time(); from raytrain.cli import _process_start; print(_process_start(), t)"
    spawned = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    began, code_ran = map(float, out.stdout.split())
    # Before the process's first line of code ran; no earlier than its spawn, less the kernel's 10 ms tick.
    assert spawned - 0.02 <= began < code_ran
