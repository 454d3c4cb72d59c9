"""A shared cluster admits runs in turn (raytrain.service.admission): higher priority first, then first come
first, each when what it asks for is free, with a line that says what it waits for; a run of higher priority
asks running runs of lower priority to yield their room; raytrain cancel ends a waiting run; a ticket whose
driver died is dropped. The
cluster's free resources and live drivers are given as functions here; the testbed runs it on a real
serving cluster (tests/test_service_slurm.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from raytrain import waits
from raytrain.contracts import jobdir
from raytrain.contracts.jobdir import QUEUE, EndRequest, Priority, Ticket
from raytrain.service import admission, jobs

CPU3 = {"CPU": 3.0}


class Cluster:
    """Three 4-CPU nodes whose free CPUs a test sets, and the drivers alive on them."""

    def __init__(self) -> None:
        self.free_cpus = [4.0, 4.0, 4.0]
        self.alive = {"job-a", "job-b", "job-c"}
        self.view = admission.Cluster(
            address="gcs:1", free=self.free, totals=lambda: {"CPU": 12.0}, live=lambda: self.alive
        )

    def free(self) -> dict[str, dict[str, float]]:
        return {f"n{i}": {"CPU": c} for i, c in enumerate(self.free_cpus)}

    def wait(self, place: admission.Place, said: list[str]) -> threading.Thread:
        def run() -> None:
            place.wait(said.append, self.view, poll_s=0.01)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def until(predicate: Callable[[], bool], timeout: float = 10) -> None:
    assert waits.until(predicate, timeout_s=timeout, every_s=0.01), "timed out"


def take(
    job_dir: Path,
    run: str,
    ray_job: str,
    workers: int = 3,
    cluster: str = "gcs:1",
    priority: Priority = "normal",
    yields: bool = True,
) -> admission.Place:
    return admission.Place.take(
        job_dir,
        run=run,
        cluster=cluster,
        ray_job=ray_job,
        workers=workers,
        per_worker=CPU3,
        priority=priority,
        yields=yields,
    )


def test_workers_count_per_node() -> None:
    assert admission.holds([{"CPU": 4}, {"CPU": 4}, {"CPU": 2}], CPU3) == 2
    assert admission.holds([{"CPU": 8, "GPU": 1}], {"CPU": 3, "GPU": 1}) == 1
    assert admission.holds([{"CPU": 8}], {"CPU": 1, "GPU": 1}) == 0


def test_runs_go_in_turn_each_when_it_fits(tmp_path: Path) -> None:
    cluster = Cluster()
    first = take(tmp_path, "first", "job-a")
    first.wait(print, cluster.view, poll_s=0.01)
    assert first.ticket.phase == "placing"  # nothing ahead, and it fits: at once

    second_said: list[str] = []
    second = take(tmp_path, "second", "job-b")
    waiting = cluster.wait(second, second_said)
    until(lambda: second_said)
    assert second_said[0].startswith(
        "second: waiting for 3 worker(s) of 3 CPU: run 'first' (priority normal, driver pid "
    )
    assert second_said[0].endswith("is placing its workers"), second_said  # its resources still look free
    assert waiting.is_alive()

    # The first run's workers are placed: they hold 9 of the 12 CPUs now.
    cluster.free_cpus = [1.0, 1.0, 1.0]
    first.set_phase("running")
    until(lambda: len(second_said) > 1)
    assert second_said[1] == (
        "second: waiting for 3 worker(s) of 3 CPU: free now: 3 CPU of 12 CPU, room for 0 such worker(s); it goes "
        "when runs that hold the rest end"
    )
    assert waiting.is_alive() and [t.phase for t in Ticket.read_all(tmp_path / QUEUE)] == ["running", "waiting"]

    # A worker of the first fails: Ray Train restarts its workers, and until they are placed again the
    # resources they free are not the second's to take.
    first.set_phase("placing")
    cluster.free_cpus = [4.0, 4.0, 4.0]
    until(lambda: len(second_said) > 2)
    assert second_said[2] == second_said[0] and waiting.is_alive()

    first.leave()  # the first run ended
    waiting.join(timeout=10)
    assert not waiting.is_alive() and second.ticket.phase == "placing"
    assert second_said[-1] == "second: its turn: 3 worker(s) fit what is free now"


def test_a_phase_that_changes_while_the_resources_are_read_decides_nothing(tmp_path: Path) -> None:
    """The first run loses a worker just as the second reads the cluster: "placing" lands after the queue
    was read, the freed CPUs before the resources are. The second must not take that room."""
    cluster = Cluster()
    first = take(tmp_path, "first", "job-a")
    first.set_phase("running")
    cluster.free_cpus = [1.0, 1.0, 1.0]
    second = take(tmp_path, "second", "job-b")
    reads = 0

    def free_as_the_worker_is_lost() -> dict[str, dict[str, float]]:
        nonlocal reads
        reads += 1
        if reads == 1:
            first.set_phase("placing")
            cluster.free_cpus = [4.0, 4.0, 4.0]
        elif reads == 3:
            first.leave()
        return cluster.free()

    view = admission.Cluster(
        address="gcs:1", free=free_as_the_worker_is_lost, totals=cluster.view.totals, live=cluster.view.live
    )
    said: list[str] = []
    second.wait(said.append, view, poll_s=0.01)
    assert reads == 4 and said[0].endswith("is placing its workers"), said  # the 2nd poll saw it placing
    assert said[-1] == "second: its turn: 3 worker(s) fit what is free now"


def test_a_small_run_does_not_overtake_a_large_one_that_waits(tmp_path: Path) -> None:
    cluster = Cluster()
    cluster.free_cpus = [3.0, 1.0, 1.0]  # room for one 3-CPU worker
    large_said: list[str] = []
    large = take(tmp_path, "large", "job-a")
    large_waits = cluster.wait(large, large_said)
    until(lambda: large_said)
    small_said: list[str] = []
    small = take(tmp_path, "small", "job-b", workers=1)
    small_waits = cluster.wait(small, small_said)
    until(lambda: small_said)
    assert "1 run(s) ahead of it in the queue, the first run 'large'" in small_said[0]
    cluster.free_cpus = [4.0, 4.0, 4.0]
    large_waits.join(timeout=10)
    assert large.ticket.phase == "placing" and small_waits.is_alive()  # the large one places its workers
    cluster.free_cpus = [1.0, 1.0, 4.0]
    large.set_phase("running")
    small_waits.join(timeout=10)
    assert small.ticket.phase == "placing"


def test_tickets_of_dead_drivers_and_of_an_earlier_attempt_are_dropped(tmp_path: Path) -> None:
    cluster = Cluster()
    dead = take(tmp_path, "dead", "job-c")
    cluster.alive.discard("job-c")  # its driver was killed before its workers were placed
    earlier = take(tmp_path, "earlier", "job-a", cluster="gcs:0")  # Ray job ids start over on a new cluster
    said: list[str] = []
    mine = take(tmp_path, "mine", "job-a")
    mine.wait(said.append, cluster.view, poll_s=0.01)
    assert mine.ticket.phase == "placing" and said == []
    assert [t.run for t in Ticket.read_all(tmp_path / QUEUE)] == ["mine"]
    assert not (tmp_path / QUEUE / dead.ticket.file_name).exists()
    assert not (tmp_path / QUEUE / earlier.ticket.file_name).exists()


def test_a_restart_reads_as_placing_before_ray_train_frees_the_old_workers_resources(tmp_path: Path) -> None:
    """Ray Train 2.60 restarts a worker group by shutting the old one down (its placement group removed,
    its resources free) and then starting one; the hook before the shutdown is where a run's ticket says
    "placing", or a waiting run could see the resources free while the run still reads as running."""
    import inspect

    from ray.train.v2._internal.execution.controller.controller import TrainController

    from raytrain.service.callback import ServiceCallback

    source = inspect.getsource(TrainController._execute_resize_decision)
    assert source.index('"before_controller_execute_resize_decision"') < source.index("self._shutdown_worker_group()")
    callback = ServiceCallback()
    callback._place = take(tmp_path, "first", "job-a")
    callback._place.set_phase("running")
    callback.before_controller_execute_resize_decision(None)
    assert [t.phase for t in Ticket.read_all(tmp_path / QUEUE)] == ["placing"]


def test_a_ticket_whose_actor_died_is_dropped_though_its_ray_job_lives(tmp_path: Path) -> None:
    """A sweep's trial that Ray Tune stopped: its actor is gone, the sweep's driver (its Ray job) is not."""
    cluster = Cluster()
    dead = {"actor-1"}
    view = admission.Cluster(address="gcs:1", free=cluster.free, totals=cluster.view.totals, live=cluster.view.live,
                             dead=lambda actor: actor in dead)  # fmt: skip
    stopped = admission.Place.take(
        tmp_path, run="trial", cluster="gcs:1", ray_job="job-a", workers=1, per_worker=CPU3, actor="actor-1"
    )
    stopped.set_phase("placing")  # it would hold every other run back for ever
    running = admission.Place.take(
        tmp_path, run="other-trial", cluster="gcs:1", ray_job="job-a", workers=1, per_worker=CPU3, actor="actor-2"
    )
    running.set_phase("placing")
    waiting = take(tmp_path, "waits", "job-b", workers=1)
    said: list[str] = []
    thread = threading.Thread(target=lambda: waiting.wait(said.append, view, poll_s=0.01), daemon=True)
    thread.start()
    until(lambda: bool(said))
    assert "other-trial" in said[0] and not (tmp_path / QUEUE / stopped.ticket.file_name).exists(), said
    running.set_phase("running")
    thread.join(10)
    assert not thread.is_alive() and waiting.ticket.phase == "placing"


def test_a_run_of_higher_priority_goes_first_and_asks_running_runs_of_lower_priority_to_yield(tmp_path: Path) -> None:
    cluster = Cluster()
    cluster.free_cpus = [4.0, 4.0, 4.0, 4.0]  # a fourth node here
    script = take(tmp_path, "script", "job-d", workers=1, priority="low", yields=False)  # a stock script's trainer
    script.wait(print, cluster.view, poll_s=0.01)
    script.set_phase("running")
    low = take(tmp_path, "low", "job-c", priority="low")
    cluster.free_cpus = [4.0, 4.0, 4.0, 1.0]
    low.wait(print, cluster.view, poll_s=0.01)
    low.set_phase("running")
    cluster.free_cpus = [1.0, 1.0, 1.0, 1.0]  # its three 3-CPU workers and the script's one
    later_said: list[str] = []
    later = take(tmp_path, "later", "job-b", priority="low")
    later_waits = cluster.wait(later, later_said)
    until(lambda: later_said)
    assert later_said[0].endswith("it goes when runs that hold the rest end")  # it asks nothing of its equals
    assert low.request() is None
    high_said: list[str] = []
    high = take(tmp_path, "high", "job-a", priority="high")
    high_waits = cluster.wait(high, high_said)
    until(lambda: high_said)
    assert high_said[0] == (
        "high: waiting for 3 worker(s) of 3 CPU: free now: 4 CPU of 12 CPU, room for 0 such worker(s); asked run "
        "'low' (priority low) to yield theirs"
    )
    shown = {t.run: t.why for t in Ticket.read_all(tmp_path / QUEUE)}  # for raytrain status
    assert shown["high"] == high_said[0].split("3 CPU: ", 1)[1] and shown["low"] is None
    asked = low.request()
    assert asked is not None and asked.why == jobdir.YIELD and asked.by == "run 'high' (priority high)"
    assert asked.deadline == pytest.approx(asked.at + admission.YIELD_GRACE_S)
    assert script.request() is None  # a script's trainer cannot queue again: never asked
    until(lambda: len(later_said) > 1)
    assert "1 run(s) ahead of it in the queue, the first run 'high' (priority high" in later_said[-1], later_said

    # The low run checkpoints and its attempt ends: its ticket waits again, in its place, without the request;
    # the high run goes first; its driver takes the same ticket up again, behind the high run, before the later.
    low.requeue()
    assert low.ticket.phase == "waiting"
    # The high run may have read the low one as running just before, and ask again: it sees the low run
    # waiting and takes that back.
    until(lambda: low.request() is None)
    cluster.free_cpus = [4.0, 4.0, 4.0, 1.0]
    high_waits.join(timeout=10)
    assert high.ticket.phase == "placing" and later_waits.is_alive()
    again = take(tmp_path, "low", "job-c", priority="low")
    assert again.ticket == low.ticket
    order = [t.run for t in sorted(Ticket.read_all(tmp_path / QUEUE), key=lambda t: t.order) if t.phase == "waiting"]
    assert order == ["low", "later"]


def test_a_request_to_yield_that_crosses_the_run_yielding_is_taken_back(tmp_path: Path) -> None:
    """The high run read the queue the moment before the low one requeued (and removed its request): the
    request it writes after finds the low run waiting, and goes, so the low run is not asked again later."""
    cluster = Cluster()
    cluster.free_cpus = [4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    older = take(tmp_path, "older", "job-b", priority="low")
    older.set_phase("running")
    low = take(tmp_path, "low", "job-c", priority="low")  # the newer: asked first
    low.wait(print, cluster.view, poll_s=0.01)
    low.set_phase("running")
    read_before = low.ticket
    low.requeue()
    high = take(tmp_path, "high", "job-a", priority="high")
    assert high._ask_to_yield([older.ticket, read_before], fits=0) == [] and low.request() is None
    assert older.request() is None  # the room the low run frees as it ends is counted: no other run is asked
    low.set_phase("running")  # ... while a run still running is asked
    assert high._ask_to_yield([low.ticket], fits=0) == ["run 'low' (priority low)"] and low.request() is not None


def test_a_run_that_does_not_yield_in_time_is_counted_on_no_longer(tmp_path: Path) -> None:
    cluster = Cluster()
    low = take(tmp_path, "low", "job-c", priority="low")
    low.wait(print, cluster.view, poll_s=0.01)
    low.set_phase("running")
    cluster.free_cpus = [1.0, 1.0, 1.0]
    said: list[str] = []
    high = take(tmp_path, "high", "job-a", priority="high")
    late = EndRequest(why=jobdir.YIELD, by="run 'high' (priority high)", deadline=1.0, at=0.0, asker=high.ticket.seq)
    late.write(tmp_path / QUEUE, low.ticket.request_file)  # long past its deadline
    waiting = cluster.wait(high, said)
    until(lambda: said)
    assert said[0].endswith("it goes when runs that hold the rest end"), said  # its training never asks
    # Room comes another way: the high run goes, and takes back what it asked of the low one.
    cluster.free_cpus = [4.0, 4.0, 4.0]
    waiting.join(timeout=10)
    assert high.ticket.phase == "placing" and low.request() is None


def test_a_cancelled_run_that_waits_ends_at_once(tmp_path: Path) -> None:
    cluster = Cluster()
    cluster.free_cpus = [1.0, 1.0, 1.0]
    waiting = take(tmp_path, "waits", "job-b")
    request = EndRequest(why=jobdir.CANCEL, by="alice with raytrain cancel", deadline=0.0, at=0.0)
    request.write(tmp_path / QUEUE, waiting.ticket.request_file)
    with pytest.raises(admission.Cancelled, match=r"^waits: cancelled by alice with raytrain cancel while it waited"):
        waiting.wait(print, cluster.view, poll_s=0.01)
    assert admission.Cancelled.exit_code == 143


def test_cancel_asks_every_ticket_of_the_run_and_returns_once_it_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``raytrain cancel`` on the login node (the job's directory given here, not found through Slurm)."""
    monkeypatch.setattr(jobs, "running_cluster", lambda job_id: tmp_path)
    with pytest.raises(jobs.UserError, match=r"^job 7 has no run named 'nope' running or waiting: raytrain status 7"):
        jobs.cancel("7", "nope", grace_s=5)
    running = take(tmp_path, "r", "job-a")
    running.set_phase("running")
    said: list[str] = []
    thread = threading.Thread(target=lambda: jobs.cancel("7", "r", grace_s=30, echo=said.append), daemon=True)
    thread.start()
    until(lambda: running.request() is not None)
    asked = running.request()
    assert asked is not None and asked.why == jobdir.CANCEL and asked.by.endswith(" with raytrain cancel")
    assert said[0].startswith("run 'r' (running, driver pid ") and said[0].endswith("stopped in 30 s if not")
    # It was yielding its room just then: its ticket waits again, the cancel kept for its driver to find.
    running.requeue()
    again = take(tmp_path, "r", "job-a")
    assert again.ticket == running.ticket and again.request() == asked and thread.is_alive()
    with pytest.raises(admission.Cancelled):
        again.wait(print, Cluster().view, poll_s=0.01)
    again.leave()  # as the driver's callback does when its wait ends so
    thread.join(timeout=10)
    assert not thread.is_alive() and said[-1] == "run 'r': ended"
