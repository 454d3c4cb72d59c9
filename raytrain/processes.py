"""Ending the processes raytrain started, and only those, within a bound: the one stop path.

A stop must leave no Ray worker behind (it would hold its node's memory, CPUs or GPU after the run said it
ended), yet never touch another user's processes or another Ray node's on the same host: processes are
picked by the private temp directory raytrain gave their Ray node, never by name. Every stop (a node's
Ray, a lost node's srun step started again, the job's Prometheus, a local cluster) ends in ``end``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import psutil

# After SIGKILL, how long to wait for the kernel to take a process away.
KILL_WAIT_S = 2.0
# How often a stop looks again at what it waits for.
_POLL_S = 0.05


def naming(temp_dir: str, among: Iterable[psutil.Process] | None = None) -> list[psutil.Process]:
    """Live processes whose command line names ``temp_dir``: Ray's daemons (GCS, raylet, dashboard, log
    monitor, agents) pass it or the session directory under it. ``among`` narrows the search (default: the
    host). Ray's workers rename themselves (``ray::...``) and are found as ``with_descendants``."""
    found = []
    for p in psutil.process_iter() if among is None else among:
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and any(temp_dir in arg for arg in p.cmdline()):
                found.append(p)
    return found


def with_descendants(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and every process they started, as they stand now (taken before a stop: a worker whose
    raylet is gone is handed to init and no longer looks like one of them)."""
    found: dict[int, psutil.Process] = {}
    for p in procs:
        found[p.pid] = p
        with contextlib.suppress(psutil.Error):
            found.update((d.pid, d) for d in p.children(recursive=True))
    return list(found.values())


def of(popens: Iterable[subprocess.Popen[Any]]) -> list[psutil.Process]:
    """The ones of ``popens`` still running, as psutil sees them (taken before they are signalled)."""
    found = []
    for p in popens:
        if p.poll() is None:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(p.pid))
    return found


def group_held(leader: psutil.Process) -> bool:
    """Whether the process group LEADER started (``start_new_session``) still has its id: LEADER runs (or
    is unreaped; psutil tells a later process with its pid apart), or another process is still in the
    group (the kernel gives no new process an id that a group holds). Once neither, the id may belong to
    someone else's group, and signalling it would reach them."""
    with contextlib.suppress(psutil.Error):
        if leader.is_running():
            return True
    if psutil.pid_exists(leader.pid):
        return False  # a later process has its pid: the kernel hands out no id a group still holds
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid != leader.pid and os.getpgid(p.pid) == leader.pid:
                return True
    return False


def terminate(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM to each of ``procs``, then ``end`` them."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    end(procs, grace_s)


def end(procs: list[psutil.Process], grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``procs`` to exit on their own, SIGKILL the rest and wait for them to go.
    psutil tells a process from a later one that reuses its pid, so nothing else is killed."""
    alive = _wait_ended(procs, grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _wait_ended(alive, KILL_WAIT_S)


def _running(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` that still run: a zombie has ended, and holds no memory, CPU or GPU."""
    found = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def _wait_ended(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for ``procs`` to end; those still running. A zombie counts as ended: one
    whose parent is gone waits for init to reap it (``psutil.wait_procs`` would wait with it), while this
    process's own children among them are reaped here."""
    deadline = time.monotonic() + timeout_s
    alive = _running(procs)
    while alive and time.monotonic() < deadline:
        psutil.wait_procs(alive, timeout=min(_POLL_S, max(deadline - time.monotonic(), 0)))
        alive = _running(alive)
    psutil.wait_procs([p for p in procs if p not in alive], timeout=0)  # reaps this process's own zombies
    return alive


def alive_check(pid: int) -> Callable[[], bool]:
    """A check that PID (as it is now: psutil tells a later process with its pid apart) still runs, not
    counting a zombie."""
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return lambda: False

    def alive() -> bool:
        with contextlib.suppress(psutil.Error):
            return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
        return False

    return alive


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def run_tied(cmd: Sequence[str], environ: Mapping[str, str], alive: Callable[[], bool], grace_s: float) -> int:
    """Run CMD as a child, passing it the signals a driver gets, until it exits (its status, 128+N for a
    signal N) or ALIVE says the process it is tied to is gone: then the child and its descendants get
    SIGTERM, GRACE_S, SIGKILL, and the status is 143."""
    pending: list[int] = []  # a signal that came before the child existed
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        for c in children:
            c.send_signal(signum)
        pending.extend([] if children else [signum])

    for sig in FORWARDED:
        signal.signal(sig, forward)
    child = subprocess.Popen(list(cmd), env=dict(environ))
    children.append(child)
    for signum in pending:
        child.send_signal(signum)
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = child.wait(timeout=1.0)
            return 128 - rc if rc < 0 else rc
        if not alive():
            terminate(with_descendants(of([child])), grace_s)
            return 128 + signal.SIGTERM
