"""Who takes the training thread's CPU in raytrain's end-to-end run: the kernel's record of every switch.

    python bench/make_data.py /tmp/photos/p224-3000.parquet --photos 224 --rows 3000
    python bench/sched_trace.py /tmp/photos/p224-3000.parquet [--runs 5] [--epochs 10] [--at 28] [--seconds 6] \\
        --out trace.json

Runs raytrain's side of bench/stream_e2e.py (the same command, with more epochs so that training outlasts
the record) and, ``--at`` seconds after its start, records every context switch and wakeup on the machine
for ``--seconds`` (``perf record -e sched:sched_switch -e sched:sched_wakeup -a``: Debian's linux-perf, as
root). The training thread is the busiest thread of the ``ray::RayTrainWorker`` process when the record
starts, and must be the rank's busiest in the record too.

For the training thread, its share of the record on a CPU and waiting for one, from the kernel's own
counters (/proc's schedstat, as bench/stream_e2e.py --watch reads them). From the record: its waits to
run, each from the moment it was preempted (switched out still runnable) or woken until it is switched in
again (together, what schedstat counts as waiting); which threads were switched in at its preemptions (a
second); and, over its waits, what ran on the CPU it waited for and on the other CPUs (idle included): by
thread (process/thread; "rank/" marks the training process's own) and summed by whose threads they are
(``group``).

Checked, and failed on: the record falls between the lines the run prints as its first and last epochs
end; perf lost no events; and the training thread's switches follow each other as they must (a switch-in
after a switch-out, a wait opened by a preemption or a wakeup) but for a few (``MAX_ODD``). This VM's
kernel (6.18) leaves some unmatched: the thread switched out to sleep, and out again, with no switch-in
or wakeup recorded between (2-3% of its switches, mostly around its CPU going idle). Such a stretch opens
no wait, so the waits are a lower bound, set beside schedstat's; the count is in the results
(``unmatched``), and the share of every thread's switch-ins left untraced (``untraced_switch_ins``): the
time after one is counted to the thread last seen switched in there, idle mostly, so that "idle" on the
other CPUs is an upper bound. Recorded as well: the epochs the record overlapped against the others, the cost of
recording.
"""

from __future__ import annotations

import argparse
import collections
import itertools
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_e2e import REPO, raytrain_cmd, schedstat

HEADER = re.compile(
    r"^\s*(?P<comm>.*?)\s+(?P<pid>-?\d+)/(?P<tid>-?\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<t>[\d.]+):\s+sched:(?P<event>\w+):\s+(?P<rest>.*)$"
)
SWITCH = re.compile(
    r"prev_comm=.*? prev_pid=(?P<prev>\d+) prev_prio=\d+ prev_state=(?P<state>\S+) ==> "
    r"next_comm=(?P<next_comm>.*?) next_pid=(?P<next>\d+) next_prio=\d+"
)
WAKEUP = re.compile(r"comm=(?P<comm>.*?) pid=(?P<pid>\d+) prio=\d+ target_cpu=(?P<cpu>\d+)")
EPOCH_LINE = re.compile(r"^epoch +\d+/\d+ ")  # the recipe's line for each epoch (``recipe.metrics.epoch_line``)
TOP = 12
MAX_ODD = 0.05  # of the training thread's switches, the most that may be unmatched before a run fails


@dataclass
class Event:
    t: float
    cpu: int
    kind: str  # "switch" or "wakeup"
    out: int = 0  # switch: the thread switched out, its process, and whether it was still runnable
    out_pid: int = 0
    out_name: str = ""
    runnable: bool = False
    tid: int = 0  # switch: the thread switched in; wakeup: the thread woken
    name: str = ""
    target: int = 0  # wakeup: the CPU it is woken on


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
    events = ["-e", "sched:sched_switch", "-e", "sched:sched_wakeup"]
    done = subprocess.run(
        ["perf", "record", "-q", *events, "-a", "-m", "16M", "-o", str(out), "--", "sleep", str(seconds)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"perf record failed (root, and the kernel's sched tracepoints, are needed): {done.stderr}")


def read(data: Path) -> tuple[list[Event], int]:
    """The record's switches and wakeups in time order, and the events perf lost."""
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "--ns", "--show-lost-events", "-F", "comm,pid,tid,cpu,time,event,trace"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: list[Event] = []
    lost, odd_lines = 0, []
    for line in text.splitlines():
        if "LOST" in line:
            lost += int(m[1]) if (m := re.search(r"LOST (\d+)", line)) else 1
            continue
        h = HEADER.match(line)
        if h is None:
            odd_lines += [line] if line.strip() else []
            continue
        t, cpu = float(h["t"]), int(h["cpu"])
        if h["event"] == "sched_switch" and (s := SWITCH.match(h["rest"])):
            found.append(Event(t, cpu, "switch", int(s["prev"]), int(h["pid"]), h["comm"].strip(),
                               s["state"].startswith("R"), int(s["next"]), s["next_comm"]))  # fmt: skip
        elif h["event"] == "sched_wakeup" and (w := WAKEUP.match(h["rest"])):
            found.append(Event(t, cpu, "wakeup", tid=int(w["pid"]), name=w["comm"], target=int(w["cpu"])))
        else:
            odd_lines.append(line)
    if odd_lines:
        raise SystemExit(
            f"{len(odd_lines)} lines of perf script's output were not understood (check its format), such as: "
            + " | ".join(odd_lines[:3])
        )
    return found, lost


def group(label: str) -> str:
    """Whose a thread is: the training process's own, the decoding task's, raytrain's driver, Ray's daemons'
    (its raylet, GCS, dashboard and agents, log monitor), Ray's actors', idle, or the rest (the kernel's,
    perf's, other programs')."""
    if label.startswith("rank/"):
        return "the rank's other threads"
    if "Project->" in label or "MapBatches" in label:
        return "the decode task"
    if label.startswith("raytrain"):
        return "raytrain's driver"
    if label.startswith(("raylet", "gcs_server", "ray-dashboard", "dashboard.py", "agent.py", "log_monitor.py",
                         "monitor.py", "ray::DashboardA", "ray::RuntimeEnv")):  # fmt: skip
        return "Ray's daemons"
    if label.startswith("ray::"):
        return "Ray's actors and idle workers"
    return "idle" if label == "idle" else "the rest"


def by_group(shares: dict[str, float]) -> dict[str, float]:
    sums: collections.Counter[str] = collections.Counter()
    for label, v in shares.items():
        sums[group(label)] += v
    return dict(sums.most_common())


def summary(events: list[Event], rank_pid: int, train: int, procs: dict[int, str]) -> dict[str, Any]:
    """What the record says of the training thread (module docstring). ``procs``: each process's name, by
    pid, as the record ended."""
    switches = [e for e in events if e.kind == "switch"]
    start, end = switches[0].t, switches[-1].t
    span = end - start
    pid_of = {e.out: e.out_pid for e in switches}
    name_of = {e.out: e.out_name for e in switches} | {e.tid: e.name for e in switches}

    def label(tid: int) -> str:
        """``process/thread`` (the thread alone where it is the process's main one); the rank's as ``rank/``."""
        if tid == 0:
            return "idle"
        thread, pid = name_of.get(tid, "?"), pid_of.get(tid)
        proc = "rank" if pid == rank_pid else procs.get(pid, "?") if pid is not None else "?"
        return thread if proc[:15] == thread else f"{proc}/{thread}"

    # Each CPU's record as segments: who ran there from when to when.
    segments: dict[int, list[tuple[float, float, int]]] = collections.defaultdict(list)
    running: dict[int, tuple[int, float]] = {}
    for e in switches:
        if e.cpu in running:
            tid, since = running[e.cpu]
            segments[e.cpu].append((since, e.t, tid))
        running[e.cpu] = (e.tid, e.t)
    on_cpu: collections.Counter[int] = collections.Counter()
    for segs in segments.values():
        for s, f, tid in segs:
            on_cpu[tid] += f - s
    # A thread switched out twice with no switch-in between was switched in once untraced.
    untraced, outs, last_out = 0, 0, set()
    for e in switches:
        if e.out:
            outs += 1
            untraced += e.out in last_out
            last_out.add(e.out)
        last_out.discard(e.tid)
    rank_threads = [tid for tid in on_cpu if pid_of.get(tid) == rank_pid]
    if max(rank_threads, key=lambda tid: on_cpu[tid], default=None) != train:
        raise SystemExit(f"thread {train}, the rank's busiest before the record, was not its busiest in it")

    # The training thread's waits: (kind, from, to, the CPU it waited for).
    waits: list[tuple[str, float, float, int]] = []
    switched_in: collections.Counter[str] = collections.Counter()
    state, since, cpu, odd, moves = "unknown", 0.0, 0, 0, 0
    for e in events:
        if e.kind == "wakeup" and e.tid == train:
            if state == "sleeping":
                state, since, cpu, kind = "waiting", e.t, e.target, "woken"
        elif e.kind == "switch" and e.out == train:
            moves += 1
            odd += state not in ("running", "unknown")
            if e.runnable:
                state, since, cpu, kind = "waiting", e.t, e.cpu, "preempted"
                switched_in[label(e.tid)] += 1
            else:
                state = "sleeping"
        if e.kind == "switch" and e.tid == train:
            moves += 1
            if state == "waiting":
                waits.append((kind, since, e.t, cpu))
            else:
                odd += state not in ("unknown",)  # switched in with no wait open: a switch-out or wakeup missed
            state = "running"
    if odd > MAX_ODD * moves:
        raise SystemExit(f"{odd} of the training thread's {moves} switches unmatched: the record is not sound")

    # Over the waits, who held the CPU waited for and the other CPUs.
    its_cpu: collections.Counter[str] = collections.Counter()
    others: collections.Counter[str] = collections.Counter()
    for c, segs in segments.items():
        i = 0
        for _, w_from, w_to, w_cpu in waits:
            while i < len(segs) and segs[i][1] <= w_from:
                i += 1
            j = i
            while j < len(segs) and segs[j][0] < w_to:
                s, f, tid = segs[j]
                overlap = min(f, w_to) - max(s, w_from)
                if overlap > 0 and tid != train:
                    (its_cpu if c == w_cpu else others)[label(tid)] += overlap
                j += 1

    def waited(kind: str | None) -> dict[str, float]:
        mine = [t - f for k, f, t, _ in waits if kind is None or k == kind]
        return {
            "share": sum(mine) / span,
            "per_s": len(mine) / span,
            "median_us": statistics.median(mine) * 1e6 if mine else 0.0,
        }

    return {
        "record_s": span,
        "untraced_switch_ins": untraced / outs,
        "waiting": waited(None),
        "waiting_preempted": waited("preempted"),
        "waiting_woken": waited("woken"),
        "unmatched": odd,
        "switches": moves,
        "switched_in_at_preemption_per_s": {k: v / span for k, v in switched_in.most_common()},
        "its_cpu_meanwhile": {k: v / span for k, v in its_cpu.most_common()},
        "other_cpus_meanwhile": {k: v / span for k, v in others.most_common()},
    }


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
        before, begun = schedstat(rank_pid, train_tid), time.time()
        record(seconds, work / "perf.data")
        after, ended = schedstat(rank_pid, train_tid), time.time()
        if before is None or after is None:
            raise SystemExit("the training thread's schedstat could not be read: it ended, or the kernel keeps none")
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
    ends = [t for t, ln in lines if EPOCH_LINE.match(ln)]  # each epoch's line, printed as it ends
    if len(ends) < 2 or not ends[0] < begun < ended < ends[-1]:
        said = ", ".join(f"{t - started:.1f}" for t in ends)
        raise SystemExit(
            f"the record ({begun - started:.1f}-{ended - started:.1f} s) is not within epochs 2..{epochs} "
            f"(epochs ended at {said} s): change --at or --epochs"
        )
    events, lost = read(work / "perf.data")
    if lost:
        raise SystemExit(f"perf lost {lost} events: the record is not whole (a larger -m, or a shorter --seconds)")
    # Epochs 2..N, each from the line before it to its own: those the record overlapped, and the rest.
    spans = list(itertools.pairwise(ends))
    overlapped = [b - a for a, b in spans if a < ended and b > begun]
    clear = [b - a for a, b in spans if not (a < ended and b > begun)]
    return {
        # The kernel's own counters of the training thread over the record (perf's start and end included).
        "on_cpu": (after[0] - before[0]) / 1e9 / (ended - begun),
        "waiting_schedstat": (after[1] - before[1]) / 1e9 / (ended - begun),
        **summary(events, rank_pid, train_tid, procs),
        "record_s_from_start": [begun - started, ended - started],
        "epochs_ended_s_from_start": [t - started for t in ends],
        "epoch_s_overlapping_the_record": overlapped,
        "epoch_s_clear_of_it": clear,
    }


def _line(shares: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in list(shares.items())[:TOP])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--at", type=float, default=28.0, help="seconds from the command's start to the record")
    ap.add_argument("--seconds", type=float, default=6.0, help="the record's length")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    runs = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="trace-") as tmp:
            run = one_run(a.data.resolve(), a.epochs, a.at, a.seconds, Path(tmp))
        for what in ("switched_in_at_preemption_per_s", "its_cpu_meanwhile", "other_cpus_meanwhile"):
            run[f"{what}_by_group"] = by_group(run[what])
        runs.append(run)
        w = run["waiting"]
        print(
            f"run {i + 1}: on a CPU {run['on_cpu']:.3f}; waiting {w['share']:.3f} ({w['per_s']:.0f} waits/s, median "
            f"{w['median_us']:.0f} us; after a preemption {run['waiting_preempted']['share']:.3f}, after a wakeup "
            f"{run['waiting_woken']['share']:.3f}); epochs overlapping the record "
            f"{statistics.median(run['epoch_s_overlapping_the_record']):.2f} s, the others "
            f"{statistics.median(run['epoch_s_clear_of_it']):.2f} s",
            flush=True,
        )
        for what in ("its_cpu_meanwhile", "other_cpus_meanwhile"):
            print(f"  {what}: {_line(run[what + '_by_group'])}\n    {_line(run[what])}")
    a.out.write_text(json.dumps({"date": time.ctime(), "args": vars(a) | {"data": str(a.data), "out": str(a.out)},
                                 "runs": runs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
