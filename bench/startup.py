"""Time to the first training step, locally: this checkout against an earlier one and the torchrun peer.

    git worktree add /tmp/before a21f44e        # the code as issue 13 found it
    python -m compileall -q /tmp/before/raytrain  # as `make setup` compiles this checkout
    python bench/startup.py --runs 5 --before /tmp/before
    python bench/startup.py --profile --before /tmp/before   # where the CPU goes until the first step

Each round runs, one after another: `raytrain fit` of this checkout, `raytrain fit` of the ``--before``
checkout (the same interpreter and packages, its own code), and bench/torchrun_ddp.py under torchrun;
each one epoch of bench/run.sh's workload (6,000 augmented digits at 32 px, ResNet-18, 2 CPU workers, batch
64, from a fresh start). raytrain's figures are the ones it prints and records in result.json (seconds
from the command's process start to the workers running, the first batch and the first step); the
peer's, its first optimizer step from the moment this script spawns torchrun. An earlier checkout may
count from another point (before 5e75164, from the entry of ``raytrain.train``, after the imports): its
marks are shown but not divided by; what compares the two is each command's whole run, spawn to exit,
timed here on one clock. Medians and ranges are printed as a Markdown table and written to
bench/out/startup.json.

``--profile`` runs this checkout's command (and the ``--before`` checkout's) once, with
``RAYTRAIN_PROGRESS_EVERY=0.5``, and samples with psutil the CPU time of every process of its tree until
its first progress line (the first step): each process's CPU seconds and when it started, by its title.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from compare import COMMON, OUT, REPO, run_torchrun  # bench/compare.py, next to this file

DATA = OUT / "digits-aug-6000.parquet"


def raytrain_startup(checkout: Path, storage: Path, name: str) -> dict[str, float]:
    """One `raytrain fit` of ``checkout`` for one epoch; its start-up marks, in seconds from the start."""
    cmd = fit_command(storage, name)
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(checkout)}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"raytrain fit in {checkout} failed:\n{proc.stdout}\n{proc.stderr}")
    marks = json.loads((storage / name / "result.json").read_text())["startup_s"]
    return {
        "workers_s": marks["worker"],
        "first_batch_s": marks["first_batch"],
        "first_step_s": marks["first_step"],
        "wall_s": time.time() - t0,
    }


def fit_command(storage: Path, name: str) -> list[str]:
    cmd = [sys.executable, "-m", "raytrain", "fit", "--workers", "2", "--device", "cpu", "--data", str(DATA)]
    cmd += ["--storage", str(storage), "--name", name, "--fresh", "--epochs", "1", "--augment", "none"]  # as the peer
    return cmd + [f"--{key.replace('_', '-')}={value}" for key, value in COMMON.items() if key != "image_size"]


def title(cmdline: list[str]) -> str:
    """A process as Ray titles it (``ray::TrainController``), else its program or Python script."""
    if not cmdline:
        return "?"
    if cmdline[0].startswith(("ray::", "ray-dashboard-")):
        return cmdline[0].split(" (")[0].strip()
    if "raytrain" in cmdline:
        return "driver: raytrain fit"
    if "-c" in cmdline:
        return "python -c (Ray's multiprocessing helper)"
    scripts = [Path(a).name for a in cmdline[1:] if a.endswith(".py")]
    return scripts[0] if scripts else Path(cmdline[0]).name


def profile(checkout: Path) -> str:
    """One run of ``checkout``'s command, the CPU of each of its processes sampled until the first step."""
    import psutil

    seen: dict[int, tuple[str, float, float]] = {}  # pid -> (title, CPU seconds, start)
    done = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "RAY_ADDRESS": "", "RAYTRAIN_PROGRESS_EVERY": "0.5", "PYTHONPATH": str(checkout)}
        t0 = time.time()
        cmd = fit_command(Path(tmp), "profile")
        pipe, none = subprocess.PIPE, subprocess.DEVNULL
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=pipe, stderr=none, text=True)

        def sample() -> None:
            root = psutil.Process(proc.pid)
            while not done.wait(0.2):  # a sample every 0.2 s until the first step
                with contextlib.suppress(psutil.Error):
                    for p in [root, *root.children(recursive=True)]:
                        with contextlib.suppress(psutil.Error), p.oneshot():
                            cpu = p.cpu_times()
                            seen[p.pid] = (title(p.cmdline()), cpu.user + cpu.system, p.create_time() - t0)

        sampler = threading.Thread(target=sample)
        sampler.start()
        assert proc.stdout is not None
        # A progress line: "progress: epoch 1/1  step 1/38" (earlier checkouts print it without the prefix).
        step = re.compile(r"^(progress: )?epoch +\d+/\d+ +step \d+")
        first = next((time.time() - t0 for line in proc.stdout if step.match(line)), float("nan"))
        done.set()
        sampler.join()
        proc.terminate()
        proc.communicate(timeout=120)
    rows = sorted(seen.values(), key=lambda r: -r[1])
    out = [
        f"First step {first:.1f} s after the start; {sum(r[1] for r in rows):.1f} CPU-s over {len(rows)} processes.",
        "",
        "| process | CPU s | started at, s |",
        "|---|---|---|",
    ]
    return "\n".join(out + [f"| `{name}` | {cpu:.2f} | {start:.1f} |" for name, cpu, start in rows])


def measure(runs: int, before: Path | None) -> dict[str, Any]:
    sides: dict[str, list[dict[str, float]]] = {"raytrain": [], "torchrun": []}
    if before is not None:
        sides["before"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            sides["raytrain"].append(raytrain_startup(REPO, Path(tmp), f"now{i}"))
            if before is not None:
                sides["before"].append(raytrain_startup(before, Path(tmp), f"before{i}"))
            peer = run_torchrun(DATA, Path(tmp) / f"peer{i}.json", epochs=1, seed=i)
            sides["torchrun"].append({"first_step_s": peer["first_step_s"]})
            took = ", ".join(f"{k} {v[-1]['first_step_s']:.1f} s" for k, v in sides.items())
            print(f"round {i + 1}/{runs}: {took}", flush=True)
    return sides


def markdown(sides: dict[str, list[dict[str, float]]], before: str | None) -> str:
    def cell(side: str, key: str) -> str:
        xs = [r[key] for r in sides[side] if key in r]
        if len(xs) == 1:  # one run is a figure, not a range
            return f"{xs[0]:.1f} (1 run)"
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else ""

    def med(side: str) -> float:
        return statistics.median(r["first_step_s"] for r in sides[side])

    rows = [("raytrain, this checkout", "raytrain")]
    if "before" in sides:
        rows.append((f"raytrain at {before}", "before"))
    rows.append(("torchrun peer (bench/torchrun_ddp.py)", "torchrun"))
    out = [
        f"| seconds from the command's start, median (range) of {len(sides['raytrain'])} rounds | workers running "
        "| first batch | first step |",
        "|---|---|---|---|",
    ]
    keys = ("workers_s", "first_batch_s", "first_step_s")
    out += [f"| {label} | " + " | ".join(cell(side, k) for k in keys) + " |" for label, side in rows]
    ratio = med("raytrain") / med("torchrun")
    out.append(f"\nFirst step, this checkout / torchrun (each from its process start): {ratio:.2f}.")
    if "before" in sides:
        walls = {side: statistics.median(r["wall_s"] for r in sides[side]) for side in ("raytrain", "before")}
        out.append(
            f"One epoch's whole command, spawn to exit on this script's clock: {walls['raytrain']:.1f} s against "
            f"{walls['before']:.1f} s at {before}: **{walls['raytrain'] / walls['before']:.2f}**."
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--before", type=Path, default=None, help="a checkout of an earlier revision to compare with")
    ap.add_argument("--profile", action="store_true", help="one run: where the CPU goes until the first step")
    a = ap.parse_args()
    if not DATA.exists():
        subprocess.run([sys.executable, str(REPO / "bench/make_data.py"), str(DATA), "--rows", "6000"], check=True)
    if a.profile:
        for checkout in [REPO, *([a.before] if a.before else [])]:
            print(f"\n{checkout}:\n{profile(checkout)}")
        return
    sides = measure(a.runs, a.before)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "startup.json").write_text(json.dumps(sides, indent=1))
    print(markdown(sides, str(a.before) if a.before else None))


if __name__ == "__main__":
    main()
