"""Waiting, with a deadline and no fixed sleeps, until the head is up and every node has joined.

Each poll also checks that every Ray step is still running, so a node whose Ray dies fails the job at
once, named, with its log, instead of after the deadline.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from raytrain import waits
from raytrain.contracts.jobdir import SLURM_NODE_LABEL, ClusterFile
from raytrain.errors import UserError
from raytrain.ray_internals import GcsReader

_POLL_S = 0.2


@dataclass(frozen=True)
class Watched:
    """One Ray step: the Slurm node it runs on, the local pid of its srun, and its log file."""

    node: str
    pid: int
    log: str

    @classmethod
    def parse(cls, spec: str) -> Watched:
        node, pid, log = spec.split(":", 2)
        return cls(node=node, pid=int(pid), log=log)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(path: str, lines: int = 3) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(t.strip() for t in text[-lines:])


def _check_steps(watched: Sequence[Watched]) -> None:
    for w in watched:
        if not _alive(w.pid):
            tail = _tail(w.log)
            raise UserError(
                f"Ray on {w.node} exited before the cluster was up; see {w.log}" + (f": {tail}" if tail else "")
            )


def _deadline_error(what: str, timeout: float, watched: Sequence[Watched], missing: Sequence[str]) -> UserError:
    logs = ", ".join(f"{w.node}: {w.log}" for w in watched if w.node in missing)
    return UserError(f"{what} within {timeout:.0f} s; logs: {logs}")


def head_info(job_dir: Path, head: Watched, timeout: float) -> ClusterFile:
    """The head's cluster.json, once its supervisor has written it (before Ray starts: workers' own
    ``ray start`` waits for the head's GCS, so they can be launched at once)."""

    def written() -> ClusterFile | None:
        _check_steps([head])
        with contextlib.suppress(FileNotFoundError):
            return ClusterFile.read(job_dir)
        return None

    if (info := waits.until(written, timeout_s=timeout, every_s=_POLL_S / 4)) is not None:
        return info
    raise _deadline_error(f"the head on {head.node} did not start", timeout, [head], [head.node])


def wait_for_nodes(address: str, watched: Sequence[Watched], timeout: float, since: float | None) -> float:
    """Block until every watched node is alive in Ray; returns seconds since ``since`` (or since called)."""
    start = time.monotonic()
    expected = {w.node for w in watched}
    joined: set[str] = set()
    table: GcsReader | None = None

    def all_joined() -> bool:
        nonlocal joined, table
        _check_steps(watched)  # names a head that died: its GCS is then gone for good
        try:
            table = table or GcsReader(address)
            joined = {str((n.get("Labels") or {}).get(SLURM_NODE_LABEL)) for n in table.alive()} & expected
        except Exception:  # the GCS is not up yet (GcsGone), or still coming up
            joined = set()
        return joined == expected

    try:
        if waits.until(all_joined, timeout_s=timeout, every_s=_POLL_S):
            return time.time() - since if since else time.monotonic() - start
    finally:
        if table is not None:
            table.close()
    missing = sorted(expected - joined)
    raise _deadline_error(f"{', '.join(missing)} did not join the Ray cluster", timeout, watched, missing)


def watch_steps(watched: Sequence[Watched], poll_s: float = 1.0, tick: Callable[[], None] | None = None) -> Watched:
    """Block while every Ray step runs; return the first one that has ended. ``tick`` runs every poll."""

    def ended() -> Watched | None:
        if tick is not None:
            tick()
        return next((w for w in watched if not _alive(w.pid)), None)

    return waits.forever(ended, every_s=poll_s)


def lost_node_message(w: Watched) -> str:
    tail = _tail(w.log)
    return f"Ray on {w.node} exited; the cluster is broken; see {w.log}" + (f": {tail}" if tail else "")
