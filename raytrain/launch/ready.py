"""Waiting, with a deadline and no fixed sleeps, until the head is up and every node has joined.

Each poll also checks that every Ray step is still running, so a node whose Ray dies fails the job at
once, named, with its log, instead of after the deadline.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain.errors import UserError
from raytrain.launch.jobdir import CLUSTER_FILE

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


def head_info(job_dir: Path, head: Watched, timeout: float) -> dict[str, Any]:
    """The head's cluster.json, once its supervisor has written it (before Ray starts: workers' own
    ``ray start`` waits for the head's GCS, so they can be launched at once)."""
    path = job_dir / CLUSTER_FILE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_steps([head])
        if path.exists():
            info: dict[str, Any] = json.loads(path.read_text())
            return info
        time.sleep(_POLL_S / 4)
    raise _deadline_error(f"the head on {head.node} did not start", timeout, [head], [head.node])


def _gcs_listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


class NodeTable:
    """Reads the GCS node table as ``ray.nodes()`` does, without registering a driver.

    A driver (``ray.init``) costs about a second of CPU while every node is still booting; a bare GCS
    client is what ``ray.cluster_utils`` uses for the same read. Falls back to ``ray.init`` if those
    internals are not there.
    """

    def __init__(self, address: str) -> None:
        import ray

        self._ray = ray
        self._driver = False
        try:
            from ray._private.state import GlobalState
            from ray._raylet import GcsClientOptions  # type: ignore[attr-defined]

            state = GlobalState()
            state._initialize_global_state(
                GcsClientOptions.create(address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False)
            )
            self._table = state.node_table
        except (ImportError, AttributeError, TypeError):
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            self._driver = True
            self._table = ray.nodes

    def alive(self) -> list[dict[str, Any]]:
        return [n for n in self._table() if n.get("Alive")]

    def alive_labels(self, key: str) -> set[str]:
        return {str((n.get("Labels") or {}).get(key)) for n in self.alive()}

    def close(self) -> None:
        if self._driver:
            self._ray.shutdown()


def wait_for_nodes(address: str, watched: Sequence[Watched], timeout: float, since: float | None) -> float:
    """Block until every watched node is alive in Ray; returns seconds since ``since`` (or since called)."""
    from raytrain.cluster import SLURM_NODE_LABEL

    start = time.monotonic()
    deadline = start + timeout
    expected = {w.node for w in watched}
    joined: set[str] = set()
    table: NodeTable | None = None
    try:
        while time.monotonic() < deadline:
            _check_steps(watched)
            if table is None and _gcs_listening(address):
                table = NodeTable(address)
            if table is not None:
                try:
                    joined = table.alive_labels(SLURM_NODE_LABEL) & expected
                except Exception:  # the GCS is still coming up
                    joined = set()
                if joined == expected:
                    return time.time() - since if since else time.monotonic() - start
            time.sleep(_POLL_S)
    finally:
        if table is not None:
            table.close()
    missing = sorted(expected - joined)
    raise _deadline_error(f"{', '.join(missing)} did not join the Ray cluster", timeout, watched, missing)
