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

Strictly in order: a small run does not overtake a large one that waits for room, so the large one is never
starved by newcomers. (An elastic run already admitted may still grow back onto nodes that return.) A run
that no free state of the cluster could hold is refused before it queues
(``raytrain.service.callback.check_fits``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from raytrain import waits
from raytrain.contracts.jobdir import QUEUE, Phase, Ticket

POLL_S = 1.0
SAY_EVERY_S = 60.0  # a run that waits says so when it starts waiting, when the reason changes, and this often
PLACEMENT_TRIES = 3  # worker-group starts in a row that time out (60 s each) before a run gives up
CONTROLLER_FAILURES = 10  # Ray Train's controller failure limit over a run (Ray's default: no limit)


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
    ) -> Place:
        (job_dir / QUEUE).mkdir(mode=0o700, exist_ok=True)
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
                with contextlib.suppress(FileNotFoundError):
                    (self.queue / t.file_name).unlink()
            else:
                others.append(t)
        return others

    def wait(self, say: Callable[[str], None], cluster: Cluster, *, poll_s: float = POLL_S) -> None:
        """Return once this run may place its workers (saying, meanwhile, why not); its ticket is then
        ``placing``."""
        mine = self.ticket
        said: tuple[str, float] | None = None

        def turn() -> bool:
            nonlocal said
            others = self._others(cluster)
            available = list(cluster.free().values())
            # A run's phase and what it holds change one after the other (placed, then "running"; a worker
            # lost, "placing", then its resources freed): read across such a change, the queue and the free
            # resources may pair an old phase with new resources, so the turn is decided on the next poll.
            if [(t.seq, t.phase) for t in self._others(cluster)] != [(t.seq, t.phase) for t in others]:
                return False
            ahead = [t for t in others if t.phase == "waiting" and t.seq < mine.seq]
            placing = [t for t in others if t.phase == "placing"]
            fits = holds(available, mine.per_worker)
            if not ahead and not placing and fits >= mine.workers:
                self.set_phase("placing")
                if said is not None:
                    say(f"{mine.run}: its turn: {mine.workers} worker(s) fit what is free now")
                return True
            if ahead:
                why = f"{len(ahead)} run(s) ahead of it in the queue, the first {ahead[0].describe()}"
            elif placing:
                why = f"{placing[0].describe()} is placing its workers"
            else:
                summed: dict[str, float] = {}
                for res in available:
                    for k, v in res.items():
                        summed[k] = summed.get(k, 0.0) + v
                totals = cluster.totals()
                shown = {k: summed.get(k, 0.0) for k in mine.per_worker}
                total = {k: totals.get(k, 0.0) for k in mine.per_worker}
                why = (
                    f"free now: {_fmt(shown)} of {_fmt(total)}, room for {fits} such worker(s); it goes when runs "
                    "that hold the rest end"
                )
            now = time.monotonic()
            if said is None or said[0] != why or now - said[1] >= SAY_EVERY_S:
                say(f"{mine.run}: waiting for {mine.workers} worker(s) of {_fmt(mine.per_worker)}: {why}")
                said = (why, now)
            return False

        # No deadline of its own: the wait ends with the job (its driver is stopped with it), and the
        # runs it waits for end at their own time limits.
        waits.forever(turn, every_s=poll_s)

    def set_phase(self, phase: Phase) -> None:
        if self.ticket.phase != phase:
            self.ticket = dataclasses.replace(self.ticket, phase=phase)
            with contextlib.suppress(OSError):  # the job is ending and took its directory with it
                self.ticket.write(self.queue)

    def leave(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.queue / self.ticket.file_name).unlink()
