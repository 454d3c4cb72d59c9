"""Where the CPU goes while a command trains: CPU seconds per process of its tree, steady state only.

    python bench/cpu_profile.py -- .venv/bin/raytrain fit --workers 2 ...

Runs the command, reads its output line by line, and snapshots utime+stime of every process descended
from it (from /proc) when the first epoch line appears and when the last one does; the difference,
grouped by role (training workers, Ray Data, the driver, Ray's own daemons and actors), is the cost of
each while training runs (processes that exit in between are not counted). Two /proc walks in all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
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


def snapshot(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds) for root and all its descendants."""
    kids, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[pid] = (cmd or "?", (int(stat[11]) + int(stat[12])) / TICK)
    return out


def role(cmd: str) -> str:
    """A process's part in a raytrain run, from its command line (Ray sets ray::<Actor> titles)."""
    rules = [
        (r"^ray::(RayTrainWorker|_RayTrainWorker)", "training workers"),
        (r"^ray::(SplitCoordinator|ReadParquet|MapBatches|RandomShuffle|Repartition|.*Operator)", "Ray Data"),
        (r"raytrain fit|-m raytrain", "driver"),
        (r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|runtime_env|agent", "Ray daemons"),
        (r"^ray::", "other Ray actors and tasks"),
        (r"torch\.distributed\.run|torchrun", "torchrun launcher"),
        (r"torchrun_ddp\.py", "training workers"),
    ]
    return next((name for pattern, name in rules if re.search(pattern, cmd)), "other")


def profile(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run cmd; CPU seconds by role and by process between the first and the last epoch line."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    marks: dict[str, tuple[float, dict[int, tuple[str, float]]]] = {}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = EPOCH.match(line)
        if m:
            marks.setdefault("start", (time.monotonic(), snapshot(proc.pid)))
            if m.group(1) == m.group(2):
                marks["end"] = (time.monotonic(), snapshot(proc.pid))
    rc = proc.wait()
    if rc != 0 or "end" not in marks or marks["end"][0] <= marks["start"][0]:
        raise SystemExit(f"cpu_profile: {' '.join(cmd)} failed (exit {rc}):\n{''.join(lines[-30:])}")
    (t0, a), (t1, b) = marks["start"], marks["end"]
    wall = t1 - t0
    per_proc: dict[str, float] = {}
    by_role: dict[str, float] = {}
    for pid, (name, cpu) in b.items():
        used = cpu - a.get(pid, (name, 0.0))[1]
        if used > 0:
            label = f"{name[:60]} [{pid}]"
            per_proc[label] = used / wall
            by_role[role(name)] = by_role.get(role(name), 0.0) + used / wall
    top = dict(sorted(per_proc.items(), key=lambda kv: -kv[1])[:15])
    return {"wall_s": wall, "cores_by_role": by_role, "top_processes": top, "cores": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        raise SystemExit("cpu_profile: give the command to run after --")
    json.dump(profile(cmd), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
