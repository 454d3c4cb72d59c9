"""Where the CPU goes while a command trains: CPU seconds per process of its tree, steady state only.

    python bench/cpu_profile.py -- .venv/bin/raytrain fit --workers 2 ...

Runs the command (3 or more epochs), reads its output line by line, and snapshots utime+stime and
context switches of every process descended from it, and of each of its threads (from /proc), when the
first epoch line appears and when the one before the last does; the difference,
grouped by role (training workers, Ray Data, the driver, Ray's own daemons and actors), is the cost of
each while training runs (processes that exit in between are not counted). Two /proc walks in all.
In each training worker the thread that trains (the busiest at the start) gets its own figures: how
much of a core it got, and how often the kernel took the core away from it (involuntary context
switches), and how long it waited for a core while it could run (run-queue wait, from /proc's
schedstat), which say how much the rest of the machine disturbs training. With ``--threads N`` it also
lists the N threads that switched most (name, process, nice, share of a core, wake-ups and preemptions
per second): who wakes up how often while training runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
EPOCH = re.compile(r"^epoch +(\d+)/(\d+) ")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    return kids


@dataclass(frozen=True)
class Usage:
    cpu_s: float  # utime + stime
    voluntary: int = 0  # context switches: the task blocked
    involuntary: int = 0  # context switches: the kernel preempted it
    waited_s: float = 0.0  # on a run queue: ready to run, and no core given (schedstat; 0 where absent)

    def minus(self, earlier: Usage | None) -> Usage:
        e = earlier or Usage(0.0)
        return Usage(
            self.cpu_s - e.cpu_s,
            self.voluntary - e.voluntary,
            self.involuntary - e.involuntary,
            self.waited_s - e.waited_s,
        )


@dataclass(frozen=True)
class Proc:
    cmd: str
    cpu_s: float  # the whole process, threads that have exited included
    nice: int
    threads: dict[int, Usage]
    names: dict[int, str]  # thread id -> its name (comm)


def _stat(stat_file: Path) -> list[str]:
    """The fields of /proc/.../stat after the command name (the first is field 3, the state)."""
    return stat_file.read_text().rsplit(")", 1)[1].split()


def _cpu_s(stat: list[str]) -> float:
    """utime + stime in seconds, from the fields ``_stat`` returns."""
    return (int(stat[11]) + int(stat[12])) / TICK


def _name(task: Path) -> str:
    try:
        return (task / "comm").read_text().strip()
    except OSError:
        return "?"


def _thread(task: Path) -> Usage | None:
    """One thread's usage, or None if it exited while being read (Ray's workers start and end threads)."""
    try:
        status = (task / "status").read_text().splitlines()
        switches = dict(line.split(":\t") for line in status if "ctxt_switches" in line)
        voluntary, involuntary = int(switches["voluntary_ctxt_switches"]), int(switches["nonvoluntary_ctxt_switches"])
        usage = Usage(_cpu_s(_stat(task / "stat")), voluntary, involuntary)
    except (OSError, KeyError, IndexError, ValueError):
        return None
    try:  # run time, run-queue wait and time slices, in ns (a kernel without schedstats has no such file)
        return Usage(usage.cpu_s, voluntary, involuntary, int((task / "schedstat").read_text().split()[1]) / 1e9)
    except (OSError, IndexError, ValueError):
        return usage


def snapshot(root: int) -> dict[int, Proc]:
    """pid -> its command, CPU seconds and per-thread usage, for root and all its descendants."""
    kids, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        base = Path(f"/proc/{pid}")
        try:
            cmd = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = _stat(base / "stat")
            cpu, nice = _cpu_s(stat), int(stat[16])
            tasks = list((base / "task").iterdir())
        except (OSError, IndexError, ValueError):
            continue
        threads = {int(t.name): u for t in tasks if (u := _thread(t)) is not None}
        out[pid] = Proc(cmd or "?", cpu, nice, threads, {int(t.name): _name(t) for t in tasks})
    return out


def role(cmd: str) -> str:
    """A process's part in a raytrain run, from its command line (Ray sets ray::<Actor> titles)."""
    rules = [
        (r"^ray::(RayTrainWorker|_RayTrainWorker)", "training workers"),
        (r"^ray::(SplitCoordinator|ReadParquet|MapBatches|RandomShuffle|Repartition|.*Operator)", "Ray Data"),
        (r"raytrain fit|-m raytrain", "driver"),
        (r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|runtime_env|agent", "Ray daemons"),
        (r"^ray::", "other Ray actors and tasks"),
        (r"torch\.distributed\.run|(^|/)torchrun ", "torchrun launcher"),  # its workers' lines lack these
        (r"torchrun_ddp\.py", "training workers"),
    ]
    return next((name for pattern, name in rules if re.search(pattern, cmd)), "other")


def profile(cmd: list[str], env: dict[str, str] | None = None, threads: int = 0) -> dict[str, Any]:
    """Run cmd; CPU by role and by process, context switches, and the training threads' share of a core,
    between the first and the last epoch line; with threads, the that many threads that switched most."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    marks: dict[str, tuple[float, dict[int, Proc]]] = {}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = EPOCH.match(line)
        if m:
            done, total = int(m.group(1)), int(m.group(2))
            if total < 3:
                proc.terminate()  # raytrain and torchrun both stop their workers on SIGTERM
                proc.wait()
                raise SystemExit("cpu_profile: the command must run 3 or more epochs (the window is 2..N-1)")
            marks.setdefault("start", (time.monotonic(), snapshot(proc.pid)))
            # Ray Train's workers end before the driver prints the last epoch: the window closes one
            # epoch early, while they are still there to read.
            if done == total - 1:
                marks["end"] = (time.monotonic(), snapshot(proc.pid))
    rc = proc.wait()
    if rc != 0 or "end" not in marks or marks["end"][0] <= marks["start"][0]:
        raise SystemExit(f"cpu_profile: {' '.join(cmd)} failed (exit {rc}):\n{''.join(lines[-30:])}")
    (t0, a), (t1, b) = marks["start"], marks["end"]
    wall = t1 - t0
    per_proc: dict[str, float] = {}
    by_role: dict[str, float] = {}
    switches = 0
    trainers = []
    busy: list[dict[str, Any]] = []
    for pid, now in b.items():
        if pid not in a:
            continue
        before = a[pid]
        used = now.cpu_s - before.cpu_s
        # Threads alive at both ends, and those started in between (whole); ones that ended are not seen.
        deltas = [u.minus(before.threads.get(t)) for t, u in now.threads.items()]
        switches += sum(d.voluntary + d.involuntary for d in deltas)
        busy += [{"thread": now.names.get(t, "?"), "process": f"{now.cmd[:50]} [{pid}]", "nice": now.nice,
                  "cores": d.cpu_s / wall, "switches_per_s": (d.voluntary + d.involuntary) / wall,
                  "preempted_per_s": d.involuntary / wall}
                 for t, d in zip(now.threads, deltas, strict=True)]  # fmt: skip
        part = role(now.cmd)
        if used > 0:
            per_proc[f"{now.cmd[:60]} [{pid}]"] = used / wall
            by_role[part] = by_role.get(part, 0.0) + used / wall
        if part != "training workers":
            continue
        # The training thread: the busiest at the start; not measured if it has ended by the close.
        trainer = max(before.threads, key=lambda t: before.threads[t].cpu_s, default=None)
        if trainer in now.threads:
            busiest = now.threads[trainer].minus(before.threads[trainer])
            trainers.append({"cores": busiest.cpu_s / wall, "preempted_per_s": busiest.involuntary / wall,
                             "blocked_per_s": busiest.voluntary / wall,
                             "waited_for_a_core": busiest.waited_s / wall})  # fmt: skip
    top = dict(sorted(per_proc.items(), key=lambda kv: -kv[1])[:15])
    return {
        "wall_s": wall,
        "cores_by_role": by_role,
        "top_processes": top,
        "cores": os.cpu_count(),
        "context_switches_per_s": switches / wall,
        "training_threads": trainers,
        **({"busiest_threads": sorted(busy, key=lambda t: -t["switches_per_s"])[:threads]} if threads else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="also list the N threads that switched most")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        raise SystemExit("cpu_profile: give the command to run after --")
    json.dump(profile(cmd, threads=a.threads), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
