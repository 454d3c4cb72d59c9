"""End to end on data that streams: `raytrain fit --stream` against torchrun + DataLoader, same JPEGs.

    python bench/make_data.py /tmp/photos/p224-3000.parquet --photos 224 --rows 3000
    python bench/stream_e2e.py /tmp/photos/p224-3000.parquet [--pairs 3] [--epochs 4] --out e2e.json \\
        [--normal-too | --pinned-too | --code-too DIR]

Both sides train the same rows (raytrain's hash split), model, batch, optimizer, seed and training
augmentation (raytrain's own crop-flip, decoded again every epoch from the encoded JPEGs), and validate
every epoch on the held-out rows. The same cores: one training process with one thread and the rest of the
machine for the data. raytrain: `--workers 1 --cpus-per-worker 1` on its local Ray (2 CPUs here), so Ray
Data's tasks get the other CPU. The peer: bench/torchrun_ddp.py `--stream`, one rank and one DataLoader
worker process for training and one for validation (persistent, 4 batches prefetched each), `--hold-val`.

Both keep the first validation's decoded rows and replay them every later epoch (raytrain because they fit
its memory budget, the peer by `--hold-val`), and so start the next epoch's batches as an epoch's training
ends; in the first epoch, validation's batches while its last step runs and the next epoch's before the
checkpoint. The figure is images trained per second from the end of epoch 1's validation to the end of
epoch N's: training, validation and the checkpoints between (raytrain's report with its checkpoint, the
peer's `torch.save`), so what either side does during a checkpoint is on the clock; beside it, the same
over every epoch (epoch 1 from its loop's start, validation included), so that work a change moves out
of the window into epoch 1 is still counted, and epoch 1's time; and each command's time from its spawn
to its exit (`command_s`: start-up included, which neither epoch figure sees). Pairs run interleaved
(raytrain, peer, raytrain, ...) and ratios are taken pair by pair. A first raytrain run of each checkout,
not counted, starts the machine warm. Every run has a session of its own, and the next starts only once
every process of that session (and, with `--pinned-too`, of the ranks' sessions torchrun starts) has
ended.

`--normal-too` adds a third side to every round: raytrain with `--decode-priority normal` (its decoding at
Linux's default policy instead of SCHED_IDLE, which `auto` gives a rank on a CPU), the three runs of a round
in each of their 6 orders in turn, so that over 6 rounds each side runs in each place and after each other
side equally often.

`--code-too DIR` adds raytrain from another checkout (a git worktree of an earlier commit, say) as a third
side, the three in each of their 6 orders as with `--normal-too`: a change measured against the code
before it and against the peer in one run. Its raytrain runs from DIR (the working directory, and on
PYTHONPATH), checked to be DIR's own before any run. The results record each raytrain side's commit (and
whether its `raytrain/` differed from it), at the start and, where either changed meanwhile, at the end.

`--pinned-too` asks what Ray's own processes cost the rank: it adds both sides again with the rank's
training thread alone on CPU 0 and every other thread of the run on the other CPUs: the command's own
process, the rank's other threads and the processes it forks, Ray's daemons and actors, and this
harness's threads (``Pinner``, which looks every 0.1 s and records the thread it bound and its own CPU
time). The unpinned sides then get the same looks without the moves, so that every side pays for the
looking. The four sides run in a Williams order over 4 rounds: within a round each side in each place
once and after each other side once.

`--watch` looks at every side's training thread (as `--pinned-too`'s unpinned sides do, a look a second
instead of ten) and records, over the last stretch of its time as the rank's busiest thread as long as
the window of epochs 2..N (to a look), the share of that time it ran on a CPU, the share it was ready to
run and waited for one (the kernel's run-queue delay, from `/proc/<pid>/task/<tid>/schedstat`, which
psutil does not read), and how often a second it was preempted (its involuntary context switches): where
a side's step is slower with its input on time, whether other processes took its CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import med, spread

REPO = Path(__file__).resolve().parents[1]
WORK = {"model": "shufflenet_v2_x0_5", "image_size": 64, "batch_size": 64, "lr": 0.02, "seed": 0}


def per_epoch(history: list[dict[str, Any]], blocked: list[float]) -> dict[str, float]:
    """Images trained per second from the end of epoch 1's validation to the end of epoch N's: epochs
    2..N's training and validation and the N-1 checkpoints between them (``blocked``: how long each held
    training up), so that work either side starts during a checkpoint is on the clock. Also the share of
    that time spent waiting for training batches, and validation's time per epoch."""
    rest = history[1:] or history
    seconds = sum(e["epoch_time_s"] for e in rest) + sum(blocked)
    # And over every epoch, the first's start and validation too, so that work moved out of the window
    # into epoch 1 (a next pass started during its validation, say) is counted where it went.
    every = sum(e["epoch_time_s"] for e in history) + sum(blocked)
    return {
        "images_per_s": sum(e["train_samples"] for e in rest) / seconds,
        "train_only_images_per_s": sum(e["train_samples"] for e in rest) / sum(e["train_time_s"] for e in rest),
        "data_wait_fraction": sum(e["data_wait_s"] for e in rest) / seconds,
        "val_s": med([e["epoch_time_s"] - e["train_time_s"] for e in rest]),
        "checkpoint_s": med(blocked),
        "first_epoch_s": history[0]["epoch_time_s"],
        "all_epochs_images_per_s": sum(e["train_samples"] for e in history) / every,
    }


def ratios(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str = "images_per_s") -> list[float]:
    """Images/s of one side over another's, round by round."""
    return [r[key] / p[key] for r, p in zip(ours, theirs, strict=True)]


class Pinner(threading.Thread):
    """The rank's training thread alone on CPU 0 (the lowest CPU this harness may use), everything else of
    the run on the other CPUs; or, ``move=False``, the same looks without moving anything, so that a run
    compared with a pinned one pays for the same looking.

    The run is every process under the command's and every process of the sessions they are in (it is
    started in a session of its own; torchrun starts each rank in another). The command
    starts on every CPU (a local Ray counts the CPUs it may use as it starts); once a rank is there, this
    thread, itself on the other CPUs, moves every thread of the run there as it appears, the training
    thread to CPU 0, and back to the others any thread that lands beside it (those the training thread
    starts: Ray Data's iterator threads, a DataLoader's pin thread and workers). The training thread is the
    rank's thread that took the most CPU over the last second (its whole life at the first look), kept
    until another takes half as much again. A process other than a rank is looked at until a look finds
    nothing of it to move; a Ray worker still idle is asked again whether it has become a rank. It looks
    every 0.1 s after each look ends, and records each change of the bound thread and its own CPU time.
    It binds one rank: a second fails the run. Each look also reads the bound thread's scheduler counters
    (``schedstat``), which ``report`` hands on for ``on_cpu``. ``every``: seconds between looks."""

    def __init__(
        self, root: psutil.Process, alone: set[int], rest: set[int], *, move: bool = True, every: float = 0.1
    ) -> None:
        super().__init__(name="pinner", daemon=True)
        self.root, self.alone, self.rest, self.move, self.every = root, alone, rest, move, every
        self.sessions = {root.pid}  # the run's (the command leads it), its ranks' (torchrun's), as they are seen
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.bound: list[dict[str, Any]] = []  # each change: seconds since the start, pid, thread id and name
        self.cpu_s = 0.0
        self.end_s = 0.0  # the last look that saw a rank, seconds since the start
        self.looks = 0
        self._ranks: set[int] = set()  # pids known to be ranks (a Ray worker is named once it is one)
        self._settled: dict[int, bool] = {}  # other processes found with nothing to move: whether Ray's idle
        self._cpu: dict[int, deque[dict[int, float]]] = {}  # a rank's threads' CPU seconds, look by look
        self.sched: list[tuple[float, int, list[int]]] = []  # the bound thread's counters: when, thread, values

    def run(self) -> None:
        started = time.monotonic()
        try:
            if self.move:
                os.sched_setaffinity(0, self.rest)  # this thread only
            while not self.done.is_set():
                self.look(started)
                self.looks += 1
                self.done.wait(self.every)
        except BaseException as e:  # told after the run: a run that could not be pinned is not labelled so
            self.error = e
        finally:
            self.cpu_s = time.thread_time()

    def is_rank(self, proc: psutil.Process) -> bool:
        """raytrain's training worker, or the torchrun rank (the launcher's child, not a DataLoader worker)."""
        if proc.pid not in self._ranks:
            cmd = " ".join(proc.cmdline())
            parent = proc.parent() if "torchrun_ddp.py" in cmd else None
            if cmd.startswith("ray::RayTrainWorker") or (
                parent is not None and "torch.distributed.run" in " ".join(parent.cmdline())
            ):
                if any(psutil.pid_exists(pid) for pid in self._ranks):
                    raise RuntimeError("a second rank: this harness binds one rank's training thread")
                self._ranks.add(proc.pid)
        return proc.pid in self._ranks

    def busiest(self, pid: int, threads: list[Any]) -> int:
        window = self._cpu.setdefault(pid, deque(maxlen=1 + round(1 / self.every)))  # a second apart
        window.append({t.id: t.user_time + t.system_time for t in threads})
        base = window[0] if len(window) > 1 else {}
        took = {tid: cpu - base.get(tid, 0.0) for tid, cpu in window[-1].items()}
        top = max(took, key=took.__getitem__)
        now = self.bound[-1]["tid"] if self.bound and self.bound[-1]["pid"] == pid else None
        return now if now in took and took[top] <= 1.5 * took[now] else top

    def look(self, started: float) -> None:
        tree = _tree(self.root)  # empty once the command has ended: its sessions are known by then
        self.sessions |= _sessions_of(tree)
        procs = {p.pid: p for p in psutil.process_iter() if _session(p.pid) in self.sessions}
        procs |= {p.pid: p for p in tree}
        if not self._ranks and not any(_alive(self.is_rank, p) for p in procs.values()):
            return  # nothing moves before a rank is there: a local Ray counts its CPUs as it starts
        for pid, proc in procs.items():
            try:
                if self._settled.get(pid) is False or (pid in self._settled and not self.is_rank(proc)):
                    continue
                self._settled.pop(pid, None)
                rank = self.is_rank(proc)
                if rank:
                    self.end_s = round(time.monotonic() - started, 2)
                threads = proc.threads()
                top = self.busiest(pid, threads) if rank else None
                if top is not None and (not self.bound or self.bound[-1]["tid"] != top):
                    when = round(time.monotonic() - started, 2)
                    self.bound.append({"s": when, "pid": pid, "tid": top, "name": _name(top)})
                if top is not None and (counters := schedstat(pid, top)) is not None:
                    self.sched.append((time.monotonic() - started, top, counters))
                moved = self.move and any([self.place(t.id, self.alone if t.id == top else self.rest) for t in threads])
                if not rank and not moved:  # its threads start on the others from now on
                    self._settled[pid] = proc.cmdline()[:1] == ["ray::IDLE"]
            except psutil.NoSuchProcess:  # gone since it was listed
                continue

    @staticmethod
    def place(tid: int, cpus: set[int]) -> bool:
        """Thread ``tid`` on ``cpus``; whether it had to be moved (False for a thread that has ended)."""
        try:
            if os.sched_getaffinity(tid) == cpus:
                return False
            os.sched_setaffinity(tid, cpus)
            return True
        except ProcessLookupError:
            return False

    def report(self) -> dict[str, Any]:
        """What it did, for the run's record; raises where it could not do it."""
        if self.error is not None:
            raise SystemExit(f"the run could not be pinned: {self.error!r}")
        if not self.bound:
            raise SystemExit(f"no rank was found in {self.looks} looks")
        steady = longest(self.bound, self.end_s)
        return {
            "bound": self.bound,
            "bound_longest": steady,
            # The steady thread's counters from its binding on (the look that ends the span comes after it).
            "train_thread_samples": [
                (t, c) for t, tid, c in self.sched if steady and tid == steady["tid"] and t >= steady["s"]
            ],
            "pinner_cpu_s": round(self.cpu_s, 2),
            "pinner_looks": self.looks,
        }


def longest(bound: list[dict[str, Any]], end_s: float) -> dict[str, Any]:
    """Of ``Pinner.bound``'s changes, the thread bound longest without a change (the training thread's
    steady run, where the binding held); ``end_s``: the last look that saw the rank."""
    spans = [{**a, "for_s": round(b["s"] - a["s"], 2)} for a, b in itertools.pairwise([*bound, {"s": end_s}])]
    return max(spans, key=lambda span: span["for_s"], default={})


def schedstat(pid: int, tid: int) -> list[int] | None:
    """A thread's nanoseconds on a CPU and nanoseconds ready and waiting for one (``schedstat``), and its
    involuntary context switches (``status``): psutil reads neither per thread."""
    task = Path(f"/proc/{pid}/task/{tid}")
    try:
        run_ns, wait_ns, _ = (int(v) for v in (task / "schedstat").read_text().split())
        status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        return [run_ns, wait_ns, int(status["nonvoluntary_ctxt_switches"])]
    except (OSError, ValueError, KeyError):  # ended, or a kernel without schedstats
        return None


def on_cpu(samples: list[tuple[float, list[int]]], window_s: float) -> dict[str, Any]:
    """The training thread's shares of the time on a CPU and ready and waiting for one, and its preemptions
    a second, over the last ``window_s`` seconds of its samples (the window of epochs 2..N, to a look: the
    thread is busiest until its training ends), from the first look in that stretch to the last."""
    if not samples:
        return {}
    end = samples[-1][0]
    inside = [(t, c) for t, c in samples if t >= end - window_s]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1:
        return {}
    (s0, a), (s1, b) = inside[0], inside[-1]
    span = s1 - s0
    return {
        "train_thread_on_cpu": (b[0] - a[0]) / 1e9 / span,
        "train_thread_waiting_cpu": (b[1] - a[1]) / 1e9 / span,
        "train_thread_preempted_per_s": (b[2] - a[2]) / span,
        "train_thread_span_s": round(span, 2),
    }


def watched(pinning: dict[str, Any], epochs: dict[str, float], history: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's record with its training thread's shares over the window of epochs 2..N (``per_epoch``)."""
    samples = pinning.pop("train_thread_samples", None)
    if not samples:
        return pinning
    window_s = sum(e["train_samples"] for e in (history[1:] or history)) / epochs["images_per_s"]
    return {**pinning, **on_cpu(samples, window_s)}


def run(cmd: list[str], env: dict[str, str], what: str, pin: str = "", cwd: Path = REPO) -> dict[str, Any]:
    """Run one side's command in a session of its own, ``pin`` ``"pin"``, ``"watch"`` (``Pinner``, 10 looks
    a second) or ``"look"`` (one look a second, nothing moved: ``--watch``), and
    wait until every process of that session has ended, so that none of one run shares the CPUs with the
    next; killed where the harness stops early. Returns what the pinner did."""
    cpus = sorted(os.sched_getaffinity(0))
    alone, rest = {cpus[0]}, set(cpus[1:])
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, cwd=cwd, start_new_session=True)  # fmt: skip
    root = psutil.Process(proc.pid)
    pinner = Pinner(root, alone, rest, move=pin == "pin", every=1.0 if pin == "look" else 0.1) if pin else None

    def sessions() -> set[int]:
        return {proc.pid} if pinner is None else pinner.sessions

    try:
        if pinner is not None:
            if pinner.move:
                os.sched_setaffinity(0, rest)  # this thread, reading the command's output, stays off CPU 0
            pinner.start()
        try:
            out, err = proc.communicate()
            command_s = time.perf_counter() - started
        finally:
            os.sched_setaffinity(0, set(cpus))
            if pinner is not None:
                pinner.done.set()
                pinner.join()
        if proc.returncode != 0:
            raise SystemExit(f"{what} failed:\n{out[-3000:]}\n{err[-3000:]}")
        if left := _waited(sessions(), 60):
            raise SystemExit(f"{what}: processes of its session still ran a minute after it ended: {left}")
        return {"command_s": command_s, **({} if pinner is None else pinner.report())}
    except BaseException:
        _waited(sessions() | _sessions_of(_tree(root)), 10, kill=True)
        raise


def _waited(sessions: set[int], timeout: float, kill: bool = False) -> list[psutil.Process]:
    """Waits up to ``timeout`` for the processes of ``sessions`` to end (``kill``: asked to end first, and
    killed where they have not after 5 s); those still there (zombies, which a subreaper harness may never
    reap, are not counted)."""
    procs = [p for p in psutil.process_iter() if _session(p.pid) in sessions]
    if kill:
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        for p in psutil.wait_procs(procs, timeout=5)[1]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    left = psutil.wait_procs(procs, timeout=timeout)[1]
    return [p for p in left if _alive(lambda p: p.status() != psutil.STATUS_ZOMBIE, p)]


def _tree(root: psutil.Process) -> list[psutil.Process]:
    """``root`` and every process under it; none once it has ended."""
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _sessions_of(procs: list[psutil.Process]) -> set[int]:
    """The sessions ``procs`` are in (torchrun starts each rank in one of its own)."""
    return {sid for p in procs if (sid := _session(p.pid)) is not None}


def _alive(ask: Callable[[psutil.Process], bool], proc: psutil.Process) -> bool:
    """``ask(proc)``, False for a process gone since it was listed."""
    try:
        return ask(proc)
    except psutil.NoSuchProcess:
        return False


def _name(tid: int) -> str:
    try:
        return psutil.Process(tid).name()
    except psutil.NoSuchProcess:
        return "?"


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone, or not ours to ask
        return None


def raytrain_side(
    data: Path, work: Path, epochs: int, priority: str = "auto", pin: str = "", code: Path | None = None
) -> dict[str, Any]:
    """``code``: a checkout whose raytrain runs instead of this one's (``checkout``)."""
    storage = work / "runs"
    cmd = raytrain_cmd(data, storage, epochs, priority)
    pinning = run(cmd, {"RAY_ADDRESS": "", **_code_env(code)}, "raytrain fit --stream", pin, cwd=code or REPO)
    hist = json.loads((storage / "e2e" / "result.json").read_text())["history"]
    # An epoch's checkpoint_blocked_s is the report before it: epochs 2..N carry the saves after 1..N-1.
    blocked = [e["checkpoint_blocked_s"] for e in hist[1:]]
    epochs = per_epoch(hist, blocked)
    return {**epochs, "final_loss": hist[-1]["train_loss"], **watched(pinning, epochs, hist)}


def raytrain_cmd(data: Path, storage: Path, epochs: int, priority: str = "auto") -> list[str]:
    """raytrain's side: one worker on one CPU, the run ``e2e`` in ``storage`` (started fresh), on ``data``."""
    return [sys.executable, "-m", "raytrain", "fit", "--stream", "--workers", "1", "--cpus-per-worker", "1",
            "--device", "cpu", "--data", str(data), "--storage", str(storage), "--name", "e2e", "--fresh",
            "--epochs", str(epochs), "--augment", "crop-flip", "--model", WORK["model"],
            "--image-size", str(WORK["image_size"]), "--batch-size", str(WORK["batch_size"]),
            "--lr", str(WORK["lr"]), "--seed", str(WORK["seed"]), "--decode-priority", priority]  # fmt: skip


def _code_env(code: Path | None) -> dict[str, str]:
    """With the checkout ``code`` as the working directory (first on ``python -m``'s path, and on that of
    Ray's workers, which get the driver's), the environment in which raytrain is imported from it rather
    than from this one (an editable install's finder comes after PYTHONPATH)."""
    return (
        {} if code is None else {"PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    )


def checkout(code: Path | None) -> dict[str, Any]:
    """The commit of the checkout whose raytrain a side runs (this one's for None), and whether its
    ``raytrain/`` differs from that commit (a results file beside it is not counted; a new module in it
    is); a SystemExit where ``code``'s own ``raytrain/__init__.py`` is not the one imported."""
    where = (code or REPO).resolve()
    ask = [sys.executable, "-c", "import raytrain; print(raytrain.__file__)"]
    found = subprocess.run(
        ask, env={**os.environ, **_code_env(code)}, cwd=where, capture_output=True, text=True, check=True
    )
    if Path(found.stdout.strip()).resolve() != where / "raytrain" / "__init__.py":
        raise SystemExit(f"{where}: python imports raytrain from {found.stdout.strip()}, not from it")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=True).stdout

    changed = git("status", "--porcelain", "--", "raytrain").strip()
    return {"commit": git("rev-parse", "HEAD").strip(), "changed": bool(changed)}


def peer_side(data: Path, work: Path, epochs: int, pin: str = "") -> dict[str, Any]:
    out = work / "peer.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(REPO / "bench/torchrun_ddp.py"), "--data", str(data), "--epochs", str(epochs), "--stream",
           "--loader-workers", "1", "--augment", "crop-flip", "--model", WORK["model"],
           "--image-size", str(WORK["image_size"]), "--batch-size", str(WORK["batch_size"]),
           "--lr", str(WORK["lr"]), "--seed", str(WORK["seed"]), "--save", "torch", "--save-dir", str(work),
           "--hold-val", "--out", str(out)]  # fmt: skip
    # The script imports raytrain's decoding; from this checkout, as its first path entry is bench/.
    pinning = run(cmd, {"OMP_NUM_THREADS": "1", **_code_env(REPO)}, "torchrun peer", pin)
    hist = json.loads(out.read_text())["epochs"]
    blocked = [e["checkpoint_blocked_s"] for e in hist[:-1]]
    epochs = per_epoch(hist, blocked)
    return {**epochs, "final_loss": hist[-1]["train_loss"], **watched(pinning, epochs, hist)}


def _write(path: Path, result: dict[str, Any]) -> None:
    """``result`` to ``path`` whole: written beside it, then put in its place."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(result, indent=1))
    part.replace(path)


def _pick(run: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in run.items() if k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    both = ap.add_mutually_exclusive_group()
    both.add_argument("--normal-too", action="store_true", help="also raytrain with --decode-priority normal")
    both.add_argument("--pinned-too", action="store_true", help="also both sides with the rank alone on CPU 0")
    both.add_argument("--code-too", type=Path, metavar="DIR", help="also raytrain from the checkout DIR")
    ap.add_argument("--watch", action="store_true", help="record each side's training thread's time on a CPU")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.data = a.data.resolve()  # the code side runs in its own checkout
    a.code_too = a.code_too.resolve() if a.code_too else None
    if not os.access(a.out.resolve().parent, os.W_OK):
        ap.error(f"--out {a.out}: its folder does not exist or cannot be written")
    three = "--normal-too" if a.normal_too else "--code-too" if a.code_too else None
    if three and a.pairs % 6:
        ap.error(f"{three} runs the 6 orders of its three sides in turn: give --pairs as a multiple of 6")
    if a.pinned_too and a.pairs % 4:
        ap.error("--pinned-too runs its four sides in 4 orders in turn: give --pairs as a multiple of 4")
    if a.pinned_too and len(os.sched_getaffinity(0)) < 2:
        ap.error("--pinned-too binds the rank to one CPU and the rest of the run to the others: it needs 2 CPUs")
    watch = "watch" if a.pinned_too else "look" if a.watch else ""  # the unpinned sides pay for the same looking
    sides: dict[str, Any] = {
        "raytrain": lambda work: raytrain_side(a.data, work, a.epochs, pin=watch),
        "peer": lambda work: peer_side(a.data, work, a.epochs, pin=watch),
    }
    if a.normal_too:
        sides["raytrain_normal"] = lambda work: raytrain_side(a.data, work, a.epochs, "normal", pin=watch)
    if a.code_too:
        sides["raytrain_code"] = lambda work: raytrain_side(a.data, work, a.epochs, pin=watch, code=a.code_too)
    if a.pinned_too:
        sides["raytrain_pinned"] = lambda work: raytrain_side(a.data, work, a.epochs, pin="pin")
        sides["peer_pinned"] = lambda work: peer_side(a.data, work, a.epochs, pin="pin")
    result: dict[str, Any] = {name: [] for name in sides} | {"work": WORK, "epochs": a.epochs, "date": time.ctime()}
    result["code"] = {"raytrain": checkout(None), **({"raytrain_code": checkout(a.code_too)} if a.code_too else {})}
    names = tuple(sides)
    if three:
        orders = list(itertools.permutations(names))
    elif a.pinned_too:  # Williams: each side in each place once, and after each other side once
        orders = [tuple(names[(first + k) % 4] for k in (0, 1, 3, 2)) for first in range(4)]
    else:
        orders = [names]
    for code in (None, a.code_too) if a.code_too else (None,):  # not counted: a first run starts cold
        with tempfile.TemporaryDirectory(prefix="e2e-") as tmp:
            raytrain_side(a.data, Path(tmp), 2, code=code)
    for i in range(a.pairs):
        for name in orders[i % len(orders)]:
            with tempfile.TemporaryDirectory(prefix="e2e-") as tmp:
                result[name].append(sides[name](Path(tmp)))
        shown = ("images_per_s", "data_wait_fraction", "bound_longest", "train_thread_waiting_cpu")
        print(f"round {i + 1}: " + ", ".join(f"{n} {_pick(result[n][-1], shown)}" for n in sides), flush=True)
        _write(a.out, result)  # a later failure keeps the rounds run
    result["ratio"] = ratios(result["raytrain"], result["peer"])
    result["ratio_all_epochs"] = ratios(result["raytrain"], result["peer"], "all_epochs_images_per_s")
    if a.normal_too:
        result["ratio_normal"] = ratios(result["raytrain_normal"], result["peer"])
        result["idle_over_normal"] = ratios(result["raytrain"], result["raytrain_normal"])
    if a.code_too:
        result["ratio_code"] = ratios(result["raytrain_code"], result["peer"])
        result["over_code"] = ratios(result["raytrain"], result["raytrain_code"])
        result["over_code_all_epochs"] = ratios(result["raytrain"], result["raytrain_code"], "all_epochs_images_per_s")
    if a.pinned_too:
        result["ratio_pinned"] = ratios(result["raytrain_pinned"], result["peer_pinned"])
    now = {"raytrain": checkout(None), **({"raytrain_code": checkout(a.code_too)} if a.code_too else {})}
    if now != result["code"]:  # a checkout committed to or edited while the rounds ran
        result["code_at_end"] = now
        print(f"the code changed while the rounds ran: {result['code']} at the start, {now} at the end")
    _write(a.out, result)
    for key in (
        "images_per_s",
        "train_only_images_per_s",
        "data_wait_fraction",
        "val_s",
        "checkpoint_s",
        "first_epoch_s",
        "all_epochs_images_per_s",
        "command_s",
        "train_thread_on_cpu",
        "train_thread_waiting_cpu",
        "train_thread_preempted_per_s",
    ):
        if not any(key in r for n in sides for r in result[n]):
            continue  # the thread's counters: with --watch or --pinned-too, where the kernel keeps them
        digits = 0 if "images" in key or "preempted" in key else 2
        found = {n: [r[key] for r in result[n] if key in r] for n in sides}
        print(f"{key}: " + ", ".join(f"{n} {spread(v, digits) if v else 'none'}" for n, v in found.items()))
    print(f"ratio (raytrain / peer, pair by pair): {spread(result['ratio'], 3)}")
    print(f"over every epoch: {spread(result['ratio_all_epochs'], 3)}")
    if a.normal_too:
        print(f"ratio with --decode-priority normal: {spread(result['ratio_normal'], 3)}")
        print(f"idle / normal, round by round: {spread(result['idle_over_normal'], 3)}")
    if a.code_too:
        print(f"ratio of raytrain from {a.code_too}: {spread(result['ratio_code'], 3)}")
        print(f"raytrain / raytrain from {a.code_too}, round by round: {spread(result['over_code'], 3)}")
        print(f"over every epoch: {spread(result['over_code_all_epochs'], 3)}")
    if a.pinned_too:
        print(f"ratio, both sides pinned: {spread(result['ratio_pinned'], 3)}")


if __name__ == "__main__":
    main()
