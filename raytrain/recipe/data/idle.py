"""Decoding that gives way to training: a generator stepped on a thread of Linux's idle scheduling policy.

A streamed pass decodes on the CPUs the ranks leave Ray Data, but Linux schedules threads, not CPUs: beside
the decoding run Ray's own processes, a dozen of which wake a hundred times a second each, and the decoding
thread and a waking one can share the core the rank's training thread wants. On 2 cores a training thread then
waited for a CPU 0.11 s of every second and was preempted about 590 times a second (BENCHMARKS.md, end to
end). A thread of the SCHED_IDLE policy runs only where no thread of the normal policy wants the CPU and gives
way the moment one does, and it still takes the cycles nothing else wants. End to end on 2 cores that gave
1.02 (0.97-1.08) times the images a second of Linux's default sharing with every order of the sides run once
(1.06 in two earlier runs in a rotated order); which of its effects carries the gain was not pinned down.
What it costs: every thread that wakes preempts it, so the same decoding takes more CPU (a pass read with
nothing else running: about 5% more CPU an image and 4-5% fewer images a second, 2 runs each). That can pay
where the ranks train on CPUs and compete for the cores, not where they train on GPUs and decoding is what
keeps them fed: ``resolve``.

A process cannot leave SCHED_IDLE without privilege, and a Ray worker process runs other tasks after this one,
so the policy is set on a thread of this module's own, never on the thread Ray runs the task on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar, cast

T = TypeVar("T")

AUTO, IDLE, NORMAL = "auto", "idle", "normal"  # --decode-priority
PRIORITIES = (AUTO, IDLE, NORMAL)


def resolve(priority: str, *, use_gpu: bool) -> str:
    """``auto``: IDLE where the ranks train on CPUs and so compete with decoding for cores, NORMAL where they
    train on GPUs and decoding is what keeps them fed (the figures: the module's docstring, BENCHMARKS.md),
    and NORMAL where the platform has no idle policy (not Linux; asked of the process that plans the run,
    which raytrain starts on the cluster's own nodes)."""
    if priority != AUTO:
        return priority
    return NORMAL if use_gpu or not hasattr(os, "SCHED_IDLE") else IDLE  # SCHED_IDLE: Linux only


_END = object()
_POLL_S = 0.05  # a waiting caller looks up this often: Ray cancels a task by an interrupt a blocked wait misses
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _lower() -> None:
    """Put the calling thread at SCHED_IDLE; where the platform has no such policy or Linux or a sandbox
    refuses it, the thread stays as it is and says so (once a process: the thread is made once)."""
    policy = getattr(os, "SCHED_IDLE", None)
    try:
        if policy is None:
            raise OSError("this platform has no SCHED_IDLE; it is Linux's")
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except Exception as e:  # anything raised here would break the thread for every later decode
        logging.getLogger(__name__).warning(
            "raytrain: decoding at the normal scheduling policy, not the idle one --decode-priority chose (%s); "
            "pass --decode-priority normal to skip the attempt",
            e,
        )


def _forget() -> None:
    """In a forked child: the parent's thread is not there, so the first use makes another."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget)


def _thread() -> ThreadPoolExecutor:
    """The process's one idle thread (made on first use; the steps of every generator take turns on it)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="raytrain-idle", initializer=_lower)
        return _pool


def stepped(items: Iterator[T]) -> Iterator[T]:
    """``items``, each made on the idle thread while the caller waits: the same items in the same order,
    one at a time (nothing is made ahead of what the caller asks for), its errors raised to the caller."""
    pool = _thread()
    try:
        while True:
            step = pool.submit(next, items, _END)
            while not wait([step], timeout=_POLL_S).done:  # short waits: Ray's cancel of the task is seen
                pass
            if (item := step.result()) is _END:  # the step's own errors, a TimeoutError among them, raised here
                return
            yield cast(T, item)
    finally:
        # Closed early (the pass ended, or Ray cancelled the task): ``items`` is closed on the thread once
        # any step still running there ends; the caller does not wait for it.
        close = getattr(items, "close", None)
        if close is not None:
            with contextlib.suppress(RuntimeError):  # the interpreter is shutting down: no new work
                pool.submit(close)
