"""A cluster shared by several drivers admits a run when what it asks for is free; the others wait their
turn, first come first, with a line that says for what.

A serving job's drivers (``raytrain submit``), or a script that starts trainers side by side, share one
Ray cluster. Ray alone starts every run's controller at once, and one that does not fit what is free
retries placing its workers until the job ends (``WorkerGroupStartupTimeoutError`` every 60 s, without a
word). Here every run on a job's cluster holds a ticket in the job's queue (``queue/`` in the job's private
directory, so ``raytrain status`` can show it) for its whole life:

- it waits, in the driver (where Ctrl-C stops it), until it is first among the waiting runs, no other run
  is placing its workers (their resources still look free until placed), and its (least) worker count fits
  the resources free on the nodes, each worker on one node;
- admitted, it is *placing* until its workers have started, *running* after; a run that restarts its
  workers (a failure) is placing again, so a waiting run cannot take the room it is about to take back;
- its ticket goes when it ends; a ticket whose driver has died (its Ray job, or the Ray actor that drove it:
  a sweep's trial that Ray Tune stopped), or of an earlier attempt of the job (another cluster), is dropped
  by whoever finds it.

Strictly in order, higher priority first (``raytrain submit --priority high|normal|low``), then first come
first: a small run does not overtake a large one that waits for room, so the large one is never starved by
newcomers. (An elastic run already admitted may still grow back onto nodes that return.) A run that no free
state of the cluster could hold is refused before it queues (``raytrain.service.callback.check_fits``).

A run whose turn it is but that does not fit asks running runs of lower priority that can yield (those of
raytrain's own driver) to end soon: an ``EndRequest`` each, lowest priority and newest first, as many as it
takes to free what it needs. Their training learns of it through ``raytrain.ending_soon()``, checkpoints and
returns; their ticket goes back to waiting, in its old place (the controller sets it so as the attempt ends),
and their driver resumes them from that checkpoint when room returns (``raytrain.service.trainer``). A run
that has not yielded by the request's deadline (its training never asks) is counted on no longer.
``raytrain cancel`` asks a run to end the same way; a waiting run ends at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from raytrain import waits
from raytrain.contracts import env
from raytrain.contracts.jobdir import (
    CANCEL,
    PRIORITIES,
    QUEUE,
    YIELD,
    EndRequest,
    Phase,
    Priority,
    Ticket,
    rank_of,
)
from raytrain.contracts.result import EXIT_CANCELLED
from raytrain.errors import UserError

POLL_S = 1.0
SAY_EVERY_S = 60.0  # a run that waits says so when it starts waiting, when the reason changes, and this often
PLACEMENT_TRIES = 3  # worker-group starts in a row that time out (60 s each) before a run gives up
CONTROLLER_FAILURES = 10  # Ray Train's controller failure limit over a run (Ray's default: no limit)
YIELD_GRACE_S = 120.0  # a run asked to yield its room should have checkpointed and ended within this


def priority() -> Priority:
    """This driver's priority among the runs of a shared cluster (``RAYTRAIN_PRIORITY``)."""
    given = env.PRIORITY.get() or "normal"
    if given not in PRIORITIES:
        raise UserError(f"{env.PRIORITY.name}={given!r} is not a priority: give one of {', '.join(PRIORITIES)}")
    return given


class Cancelled(UserError):
    """``raytrain cancel`` ended a run before it started (it was waiting its turn)."""

    exit_code = EXIT_CANCELLED


def holds(nodes: Iterable[Mapping[str, float]], per_worker: Mapping[str, float]) -> int:
    """How many workers of ``per_worker`` resources the nodes' resources hold, each worker on one node."""
    need = {k: v for k, v in per_worker.items() if v > 0}
    return sum(min((int(res.get(k, 0.0) // v) for k, v in need.items()), default=0) for res in nodes)


def _fmt(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if v) or "nothing"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What admission asks of the cluster (Ray's, in the driver; given as functions in the tests)."""

    address: str  # the GCS address: tickets taken on another cluster are an earlier attempt's
    free: Callable[[], Mapping[str, Mapping[str, float]]]  # node -> resources not in use
    totals: Callable[[], Mapping[str, float]]  # the cluster's resources in all
    live: Callable[[], set[str]]  # the Ray jobs (drivers) alive
    dead: Callable[[str], bool] = lambda actor: False  # whether that Ray actor (a ticket's) has died


class Place:
    """A run's ticket in the job's queue (picklable: the Ray Train controller updates its phase)."""

    def __init__(self, job_dir: Path, ticket: Ticket) -> None:
        self.queue = job_dir / QUEUE
        self.ticket = ticket

    @classmethod
    def take(
        cls,
        job_dir: Path,
        *,
        run: str,
        cluster: str,
        ray_job: str,
        workers: int,
        per_worker: Mapping[str, float],
        actor: str | None = None,
        priority: Priority = "normal",
        yields: bool = False,
    ) -> Place:
        """The run's ticket: a new one, or the one it kept when it yielded its room (same driver)."""
        (job_dir / QUEUE).mkdir(mode=0o700, exist_ok=True)
        for kept in Ticket.read_all(job_dir / QUEUE):
            if kept.held_by(ray_job, run) and kept.phase == "waiting":
                return cls(job_dir, kept)
        ticket = Ticket(
            seq=time.time_ns(),
            run=run,
            cluster=cluster,
            ray_job=ray_job,
            driver_pid=os.getpid(),
            host=socket.gethostname(),
            workers=workers,
            per_worker=dict(per_worker),
            since=time.time(),
            actor=actor,
            priority=priority,
            yields=yields,
            batch=env.BATCH_DRIVER.get() == "1" and actor is None,  # a trial's driver is an actor
        )
        ticket.write(job_dir / QUEUE)
        return cls(job_dir, ticket)

    def _others(self, cluster: Cluster) -> list[Ticket]:
        """The queue's other live tickets (dropping those of dead drivers and earlier attempts)."""
        alive = cluster.live()
        others = []
        for t in Ticket.read_all(self.queue):
            if t.seq == self.ticket.seq:
                continue
            if t.cluster != cluster.address or t.ray_job not in alive or (t.actor and cluster.dead(t.actor)):
                for name in (t.file_name, t.request_file):
                    with contextlib.suppress(FileNotFoundError):
                        (self.queue / name).unlink()
            else:
                others.append(t)
        return others

    def wait(self, say: Callable[[str], None], cluster: Cluster, *, poll_s: float = POLL_S) -> None:
        """Return once this run may place its workers (saying, meanwhile, why not); its ticket is then
        ``placing``. Raises ``Cancelled`` if ``raytrain cancel`` ends it meanwhile."""
        mine = self.ticket
        said: tuple[str, float] | None = None

        def turn() -> bool:
            nonlocal said
            if (asked := self.request()) is not None and asked.why == CANCEL:
                raise Cancelled(f"{mine.run}: cancelled by {asked.by} while it waited its turn")
            others = self._others(cluster)
            available = list(cluster.free().values())
            # A run's phase and what it holds change one after the other (placed, then "running"; a worker
            # lost, "placing", then its resources freed): read across such a change, the queue and the free
            # resources may pair an old phase with new resources, so the turn is decided on the next poll.
            if [(t.seq, t.phase) for t in self._others(cluster)] != [(t.seq, t.phase) for t in others]:
                return False
            ahead = [t for t in others if t.phase == "waiting" and t.order < mine.order]
            placing = [t for t in others if t.phase == "placing"]
            fits = holds(available, mine.per_worker)
            if not ahead and not placing and fits >= mine.workers:
                self.set_phase("placing")
                self._withdraw()  # the runs it asked and that have not yielded yet need not
                if said is not None:
                    say(f"{mine.run}: its turn: {mine.workers} worker(s) fit what is free now")
                return True
            if ahead:
                why = f"{len(ahead)} run(s) ahead of it in the queue, the first {ahead[0].describe()}"
            elif placing:
                why = f"{placing[0].describe()} is placing its workers"
            else:
                why = self._room(available, others, fits, cluster)
            now = time.monotonic()
            if said is None or said[0] != why or now - said[1] >= SAY_EVERY_S:
                say(f"{mine.run}: waiting for {mine.workers} worker(s) of {_fmt(mine.per_worker)}: {why}")
                if said is None or said[0] != why:
                    self._update(why=why)  # for raytrain status
                said = (why, now)
            return False

        # No deadline of its own: the wait ends with the job (its driver is stopped with it), and the
        # runs it waits for end at their own time limits.
        waits.forever(turn, every_s=poll_s)

    def _room(self, available: list[Mapping[str, float]], others: list[Ticket], fits: int, cluster: Cluster) -> str:
        """Why the first run in line does not fit, once it has asked the running runs of lower priority
        whose room it needs to yield it."""
        mine = self.ticket
        summed: dict[str, float] = {}
        for res in available:
            for k, v in res.items():
                summed[k] = summed.get(k, 0.0) + v
        totals = cluster.totals()
        shown = {k: summed.get(k, 0.0) for k in mine.per_worker}
        total = {k: totals.get(k, 0.0) for k in mine.per_worker}
        why = f"free now: {_fmt(shown)} of {_fmt(total)}, room for {fits} such worker(s)"
        asked = self._ask_to_yield(others, fits)
        if asked:
            return f"{why}; asked {', '.join(asked)} to yield theirs"
        return f"{why}; it goes when runs that hold the rest end"

    def _ask_to_yield(self, others: list[Ticket], fits: int) -> list[str]:
        """Ask running runs of lower priority to end soon, lowest and newest first, until those asked would
        free room enough (counting each of their workers as room for one of ours, where it holds as much);
        returns the runs asked so far, this time or before."""
        mine = self.ticket
        lower = sorted(
            (t for t in others if t.phase == "running" and t.yields and rank_of(t.priority) < rank_of(mine.priority)),
            key=lambda t: (rank_of(t.priority), -t.seq),
        )
        asked = []
        room = fits
        for victim in lower:
            if room >= mine.workers:
                break
            held = victim.workers if all(victim.per_worker.get(k, 0.0) >= v for k, v in mine.per_worker.items()) else 0
            if held == 0:
                continue  # its workers are smaller than ours: ending it alone frees no room for one
            request = EndRequest.read(self.queue / victim.request_file)
            if request is not None and request.why == YIELD and time.time() > request.deadline:
                continue  # asked, and it has not yielded in time: its training never asks, so count on it no longer
            if request is None:
                now = time.time()
                request = EndRequest(
                    why=YIELD,
                    by=f"run {mine.run!r} (priority {mine.priority})",
                    deadline=now + YIELD_GRACE_S,
                    at=now,
                    asker=mine.seq,
                )
                with contextlib.suppress(OSError):
                    request.write(self.queue, victim.request_file)
                if self._yielded_meanwhile(victim, request):
                    room += held  # its room frees as it ends: no other run need be asked for it
                    continue
            asked.append(f"run {victim.run!r} (priority {victim.priority})")
            room += held
        return asked

    def _yielded_meanwhile(self, victim: Ticket, request: EndRequest) -> bool:
        """Whether VICTIM went back to waiting after the queue was read: its ``requeue`` may have removed its
        request before ours was written, so ours, written after, goes (``requeue`` writes the phase first)."""
        now = next((t for t in Ticket.read_all(self.queue) if t.seq == victim.seq), None)
        if now is not None and now.phase == "running":
            return False
        path = self.queue / victim.request_file
        if EndRequest.read(path) == request:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return True

    def request(self) -> EndRequest | None:
        """Whether this run has been asked to end (by a higher-priority run, or ``raytrain cancel``)."""
        return EndRequest.read(self.queue / self.ticket.request_file)

    def set_phase(self, phase: Phase) -> None:
        if self.ticket.phase != phase:
            self._update(phase=phase, why=None)

    def _update(self, **change: Any) -> None:
        self.ticket = dataclasses.replace(self.ticket, **change)
        with contextlib.suppress(OSError):  # the job is ending and took its directory with it
            self.ticket.write(self.queue)

    def leave(self) -> None:
        """The run ends: its ticket goes, any request that it end, and those it made that others yield."""
        self._withdraw()
        for name in (self.ticket.request_file, self.ticket.file_name):
            with contextlib.suppress(FileNotFoundError):
                (self.queue / name).unlink()

    def _withdraw(self) -> None:
        """Take back the requests this run made that others yield their room (it has its room, or ends)."""
        for path in self.queue.glob("*.end"):
            request = EndRequest.read(path)
            if request is not None and request.why == YIELD and request.asker == self.ticket.seq:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def requeue(self) -> None:
        """The run yielded its room: its ticket waits again, in its place, for its driver to resume it (a
        cancel that came meanwhile stays, for that wait to find)."""
        self.set_phase("waiting")  # first: a run that asks it to yield meanwhile sees it and takes that back
        request = self.request()
        if request is not None and request.why == YIELD:
            with contextlib.suppress(FileNotFoundError):
                (self.queue / self.ticket.request_file).unlink()


def leave_all(run: str) -> None:
    """In a driver on a job's cluster, done with the run named RUN: any ticket it still holds for it (one it
    kept to resume after yielding its room), and any request that it end, go."""
    import ray

    if not (job_dir := env.JOB_DIR.get()) or not ray.is_initialized():
        return
    ray_job = ray.get_runtime_context().get_job_id()
    for ticket in Ticket.read_all(Path(job_dir) / QUEUE):
        if ticket.held_by(ray_job, run):
            Place(Path(job_dir), ticket).leave()
