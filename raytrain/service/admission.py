"""A cluster shared by several drivers admits a run when what it asks for is free; the others wait their
turn, first come first, with a line that says for what.

A serving job's drivers (``raytrain submit``), or a script that starts trainers side by side, share one
Ray cluster. Ray alone starts every run's controller at once, and one that does not fit what is free
retries placing its workers until the job ends (``WorkerGroupStartupTimeoutError`` every 60 s, without a
word). Here every run on a job's cluster takes a ticket in the job's queue (``queue/`` in the job's
private directory, so ``raytrain status`` can show it) before its workers are placed: it goes when it is
first in the queue and its (least) worker count fits the resources free on the nodes, each worker on one
node. Its ticket is removed once its workers are placed (they hold their resources then), or when it
ends; a ticket whose driver has died is dropped by whoever finds it. Strictly in order: a small run does
not overtake a large one that waits for room, so the large one is never starved.

A run that no free state of the cluster could hold is refused before it queues
(``raytrain.service.callback.check_fits``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from raytrain.contracts.jobdir import QUEUE, Ticket

POLL_S = 1.0
PLACEMENT_TRIES = 3  # admitted, a run whose worker-group start times out (60 s each) this often gives up
SAY_EVERY_S = 60.0  # a run that waits says so when it starts waiting, when the reason changes, and this often


def holds(nodes: Iterable[Mapping[str, float]], per_worker: Mapping[str, float]) -> int:
    """How many workers of ``per_worker`` resources the nodes' resources hold, each worker on one node."""
    need = {k: v for k, v in per_worker.items() if v > 0}
    return sum(min((int(res.get(k, 0.0) // v) for k, v in need.items()), default=0) for res in nodes)


def _fmt(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if v) or "nothing"


class Place:
    """A run's ticket in the job's queue."""

    def __init__(self, job_dir: Path, ticket: Ticket) -> None:
        self.queue = job_dir / QUEUE
        self.ticket = ticket

    @classmethod
    def take(cls, job_dir: Path, *, run: str, ray_job: str, workers: int, per_worker: Mapping[str, float]) -> Place:
        (job_dir / QUEUE).mkdir(mode=0o700, exist_ok=True)
        ticket = Ticket(
            seq=time.time_ns(),
            run=run,
            ray_job=ray_job,
            driver_pid=os.getpid(),
            host=socket.gethostname(),
            workers=workers,
            per_worker=dict(per_worker),
            since=time.time(),
        )
        ticket.write(job_dir / QUEUE)
        return cls(job_dir, ticket)

    def wait(
        self,
        say: Callable[[str], None],
        *,
        free: Callable[[], Mapping[str, Mapping[str, float]]],
        totals: Callable[[], Mapping[str, float]],
        live: Callable[[], set[str]],
        poll_s: float = POLL_S,
    ) -> None:
        """Return once this run is first in the queue and fits what is free (saying, meanwhile, why not)."""
        mine = self.ticket
        said: tuple[str, float] | None = None
        while True:
            alive = live()
            ahead = []
            for t in Ticket.read_all(self.queue):
                if t.ray_job not in alive and t.seq != mine.seq:
                    with contextlib.suppress(FileNotFoundError):
                        (self.queue / t.file_name).unlink()  # its driver is gone
                elif t.seq < mine.seq:
                    ahead.append(t)
            available = list(free().values())
            fits = holds(available, mine.per_worker)
            if not ahead and fits >= mine.workers:
                self.ticket = Ticket(**{**mine.__dict__, "admitted": True})
                self.ticket.write(self.queue)
                if said is not None:
                    say(f"{mine.run}: its turn: {mine.workers} worker(s) fit what is free now")
                return
            if ahead:
                why = f"{len(ahead)} run(s) ahead of it in the queue, the first {ahead[0].describe()}"
            else:
                summed: dict[str, float] = {}
                for res in available:
                    for k, v in res.items():
                        summed[k] = summed.get(k, 0.0) + v
                shown = {k: summed.get(k, 0.0) for k in mine.per_worker}
                total = {k: totals().get(k, 0.0) for k in mine.per_worker}
                why = (
                    f"free now: {_fmt(shown)} of {_fmt(total)}, room for {fits} such worker(s); it goes when runs "
                    "that hold the rest end"
                )
            now = time.monotonic()
            if said is None or said[0] != why or now - said[1] >= SAY_EVERY_S:
                need = _fmt(mine.per_worker)
                say(f"{mine.run}: waiting for {mine.workers} worker(s) of {need}: {why}")
                said = (why, now)
            time.sleep(poll_s)

    def leave(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.queue / self.ticket.file_name).unlink()
