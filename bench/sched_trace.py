"""Who takes the training thread's CPU in raytrain's end-to-end run: the kernel's record of every switch.

    python bench/make_data.py /tmp/photos/p224-3000.parquet --photos 224 --rows 3000
    python bench/sched_trace.py /tmp/photos/p224-3000.parquet [--runs 2] [--epochs 10] [--at 28] [--seconds 6] \\
        --out trace.json

Runs raytrain's side of bench/stream_e2e.py (the same command, with more epochs so that training outlasts
the record) and, ``--at`` seconds after its start, records every context switch on the machine for
``--seconds`` (``perf record -e sched:sched_switch -a``: Debian's linux-perf, as root). The training
thread is the busiest thread of the ``ray::RayTrainWorker`` process when the record starts. From the record:
its share on a CPU; how often a second it was switched out while still runnable (preempted) and the share
of the record it then waited to run again (and the median wait); which threads were switched in at those
preemptions (a second, as process/thread; "rank/" marks the training process's own); which ran on the CPU it
left while it waited (share of the record); both also summed by whose threads they are (the training
process's own, the decoding task's, Ray's actors', Ray's daemons', the rest: ``group``); and how much of a
CPU sat idle meanwhile. The record must fall
between the lines the run prints as its first and last epochs end: a run where it does not fails, naming
when each came.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_e2e import REPO, raytrain_cmd

SWITCH = re.compile(
    r"^\s*(?P<comm>.*?)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<t>[\d.]+):\s+sched:sched_switch:\s+"
    r"prev_comm=.*? prev_pid=(?P<prev>\d+) prev_prio=\d+ prev_state=(?P<state>\S+) ==> "
    r"next_comm=(?P<next_comm>.*?) next_pid=(?P<next>\d+) next_prio=\d+"
)
TOP = 12
EPOCH_LINE = re.compile(r"^epoch +\d+/\d+ ")  # the recipe's line for each epoch (``recipe.metrics.epoch_line``)


def training_thread(root: psutil.Process) -> tuple[int, int]:
    """The pid of the run's ``ray::RayTrainWorker`` process and the tid of its busiest thread."""
    for proc in root.children(recursive=True):
        try:
            if proc.cmdline()[:1] == ["ray::RayTrainWorker"]:
                busiest = max(proc.threads(), key=lambda t: t.user_time + t.system_time)
                return proc.pid, busiest.id
        except psutil.Error:
            continue
    raise SystemExit("no ray::RayTrainWorker process under the command when the record was due: raise --at")


def _name(name: str, cmdline: list[str]) -> str:
    """A process's name; for a Python one, its script's (Ray's dashboard, agents, log monitor) or module's."""
    if not name.startswith("python"):
        return name
    if "-m" in cmdline[:-1]:
        return cmdline[cmdline.index("-m") + 1]
    return next((Path(arg).name for arg in cmdline[1:] if arg.endswith(".py")), name)


def record(seconds: float, out: Path) -> None:
    if shutil.which("perf") is None:
        raise SystemExit("perf not found: apt-get install linux-perf (and run as root)")
    if not Path("/sys/kernel/tracing/events/sched").is_dir():
        subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], check=False)
    done = subprocess.run(
        ["perf", "record", "-q", "-e", "sched:sched_switch", "-a", "-o", str(out), "--", "sleep", str(seconds)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"perf record failed (root, and the kernel's sched tracepoints, are needed): {done.stderr}")


def switches(data: Path) -> list[dict[str, Any]]:
    """The record's switches, in time order: the CPU, the time, the thread switched out (its pid and whether
    it was still runnable) and the thread switched in."""
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "comm,pid,tid,cpu,time,event,trace"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = []
    for line in text.splitlines():
        m = SWITCH.match(line)
        if m:
            found.append(
                {
                    "t": float(m["t"]),
                    "cpu": int(m["cpu"]),
                    "out": int(m["prev"]),
                    "out_pid": int(m["pid"]),
                    "out_name": m["comm"].strip(),
                    "runnable": m["state"].startswith("R"),
                    "in": int(m["next"]),
                    "in_name": m["next_comm"],
                }
            )
    return found


def summary(events: list[dict[str, Any]], rank_pid: int, train_tid: int, procs: dict[int, str]) -> dict[str, Any]:
    """What the record says of the training thread (module docstring). ``procs``: each process's name, by
    pid, as the record ended."""
    span = events[-1]["t"] - events[0]["t"]
    pid_of = {e["out"]: e["out_pid"] for e in events}
    name_of = {e["out"]: e["out_name"] for e in events} | {e["in"]: e["in_name"] for e in events}

    def label(tid: int) -> str:
        """``process/thread`` (the thread alone where it is the process's main one); the rank's as ``rank/``."""
        if tid == 0:
            return "idle"
        thread, pid = name_of.get(tid, "?"), pid_of.get(tid)
        proc = "rank" if pid == rank_pid else procs.get(pid, "?") if pid is not None else "?"
        return thread if proc[:15] == thread else f"{proc}/{thread}"

    on_cpu: collections.Counter[int] = collections.Counter()
    running: dict[int, tuple[int, float]] = {}
    for e in events:
        if e["cpu"] in running:
            tid, since = running[e["cpu"]]
            on_cpu[tid] += e["t"] - since
        running[e["cpu"]] = (e["in"], e["t"])
    switched_in: collections.Counter[str] = collections.Counter()
    meanwhile: collections.Counter[str] = collections.Counter()
    waits: list[float] = []
    left: tuple[int, float] | None = None  # the CPU the training thread was preempted from, and when
    on_left: list[tuple[int, float]] = []  # who ran there since
    for e in events:
        if left is not None and e["cpu"] == left[0] and e["in"] != train_tid:
            on_left.append((e["in"], e["t"]))
        if e["out"] == train_tid and e["runnable"]:
            left, on_left = (e["cpu"], e["t"]), [(e["in"], e["t"])]
            switched_in[label(e["in"])] += 1
        elif e["in"] == train_tid and left is not None:
            waits.append(e["t"] - left[1])
            for (tid, since), nxt in zip(on_left, [*on_left[1:], (None, e["t"])], strict=True):
                meanwhile[label(tid)] += nxt[1] - since
            left = None
    return {
        "record_s": span,
        "on_cpu": on_cpu[train_tid] / span,
        "preempted_per_s": len(waits) / span,
        "waiting": sum(waits) / span,
        "median_wait_us": statistics.median(waits) * 1e6 if waits else 0.0,
        "idle_cpus": on_cpu[0] / span,
        "switched_in_per_s": {k: v / span for k, v in switched_in.most_common()},
        "ran_meanwhile": {k: v / span for k, v in meanwhile.most_common()},
    }


def group(label: str) -> str:
    """Whose a thread is: the training process's own, the decoding task's, Ray's actors', Ray's daemons' (its
    raylet, GCS, dashboard and agents, log monitor), or the rest (the kernel's, other programs')."""
    if label.startswith("rank/"):
        return "rank's other threads"
    if "Project->" in label or "MapBatches" in label:
        return "decode task"
    if label.startswith(("raylet", "gcs_server", "ray-dashboard", "dashboard.py", "agent.py", "log_monitor.py",
                         "monitor.py", "ray::DashboardA", "ray::RuntimeEnv", "raytrain")):  # fmt: skip
        return "Ray's daemons and the driver"
    if label.startswith("ray::"):
        return "Ray's actors and idle workers"
    return "the rest"


def by_group(shares: dict[str, float]) -> dict[str, float]:
    sums: collections.Counter[str] = collections.Counter()
    for label, v in shares.items():
        sums[group(label)] += v
    return dict(sums.most_common())


def one_run(data: Path, epochs: int, at: float, seconds: float, work: Path) -> dict[str, Any]:
    cmd = raytrain_cmd(data, work / "runs", epochs)
    started = time.time()
    proc = subprocess.Popen(cmd, env={**os.environ, "RAY_ADDRESS": ""}, cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[tuple[float, str]] = []  # the command's output, each line with the time it came
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln) for ln in proc.stdout or ()))
    reader.start()
    try:
        time.sleep(max(0.0, started + at - time.time()))  # the record's place in the run, by the clock
        rank_pid, train_tid = training_thread(psutil.Process(proc.pid))
        begun = time.time()
        record(seconds, work / "perf.data")
        ended = time.time()
        procs = {
            p.pid: _name(p.info["name"], p.info["cmdline"] or []) for p in psutil.process_iter(["name", "cmdline"])
        }
        proc.wait()
        reader.join()
    except BaseException:
        proc.kill()
        raise
    output = "".join(ln for _, ln in lines)
    if proc.returncode != 0:
        raise SystemExit(f"raytrain fit failed:\n{output[-3000:]}")
    epochs_at = [t for t, ln in lines if EPOCH_LINE.match(ln)]  # each epoch's line, printed as it ends
    if len(epochs_at) < 2 or not epochs_at[0] < begun < ended < epochs_at[-1]:
        ends = ", ".join(f"{t - started:.1f}" for t in epochs_at)
        raise SystemExit(
            f"the record ({begun - started:.1f}-{ended - started:.1f} s) is not within epochs 2..{epochs} "
            f"(epochs ended at {ends} s): change --at or --epochs"
        )
    return {
        **summary(switches(work / "perf.data"), rank_pid, train_tid, procs),
        "record_s_from_start": [begun - started, ended - started],
        "epochs_ended_s_from_start": [t - started for t in epochs_at],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--at", type=float, default=28.0, help="seconds from the command's start to the record")
    ap.add_argument("--seconds", type=float, default=6.0, help="the record's length")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    runs = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="trace-") as tmp:
            run = one_run(a.data.resolve(), a.epochs, a.at, a.seconds, Path(tmp))
        runs.append(run)
        print(
            f"run {i + 1}: on a CPU {run['on_cpu']:.3f}, preempted {run['preempted_per_s']:.0f}/s, waiting "
            f"{run['waiting']:.3f} (median {run['median_wait_us']:.0f} us), idle CPUs {run['idle_cpus']:.2f}",
            flush=True,
        )
        for what in ("switched_in_per_s", "ran_meanwhile"):
            run[f"{what}_by_group"] = by_group(run[what])
            print(f"  {what}: " + ", ".join(f"{k} {v:.3g}" for k, v in list(run[what].items())[:TOP]))
            print(f"  {what}, by whose: " + ", ".join(f"{k} {v:.3g}" for k, v in run[f"{what}_by_group"].items()))
    a.out.write_text(json.dumps({"date": time.ctime(), "args": vars(a) | {"data": str(a.data), "out": str(a.out)},
                                 "runs": runs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
