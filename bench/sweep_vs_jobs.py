"""Trials per hour of an allocation: a sweep packed into one Slurm job, against the same trials run as
separate Slurm jobs that each boot their own Ray cluster, on the testbed, interleaved pair by pair.

    python bench/sweep_vs_jobs.py --pairs 2 --trials 6 --epochs 2     # boots the testbed itself

Both sides train the same trials: the recipe on the embedded digits at 8 px, 2 CPU workers of 1 CPU a
trial, no early stopping (``--scheduler none``), the learning rates the sweep drew (read from its
``trials.json`` and given to the separate jobs as ``--lr``), on the same 3 nodes of 4 CPUs.

- The sweep: one ``sbatch --nodes=3 --cpus-per-task=4 slurm/ray_cluster.sbatch sweep ...``: one cluster
  boot, the trials packed into it as many at once as it holds.
- The separate jobs: one ``sbatch --nodes=1 --cpus-per-task=3 slurm/ray_cluster.sbatch --lr X ...`` per
  trial, all submitted at once, as a user scripts it: Slurm runs as many at once as the nodes hold and
  every job boots a Ray cluster of its own. Three CPUs, not two: a run alone refuses to leave its node no
  CPU for data loading ("the workers take 2 of the cluster's 2 CPUs"), so one such job fits a 4-CPU node.

Each side's time runs from its first sbatch to the end of its last job (the jobs are gone from squeue);
trials per hour is trials over that. Every trial must complete on both sides. Prints a Markdown table of
medians, ranges and the pair-by-pair ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slurm_boot  # the testbed's environment and work directory, as the boot benchmark uses them

from raytrain import waits

REPO = slurm_boot.REPO
SCRIPT = REPO / "slurm/ray_cluster.sbatch"
TRIAL = ["--device", "cpu", "--image-size", "8", "--workers", "2", "--cpus-per-worker", "1"]


def submit(opts: list[str], args: list[str]) -> str:
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", *opts, str(SCRIPT), *args]
    return subprocess.run(
        cmd, env=slurm_boot.env(), cwd=slurm_boot.WORK, capture_output=True, text=True, check=True
    ).stdout.strip()


def wait_gone(jobs: list[str], timeout: float) -> None:
    def gone() -> bool:
        listed = subprocess.run(
            ["squeue", "-h", "-j", ",".join(jobs), "-o", "%i"], env=slurm_boot.env(), capture_output=True, text=True
        )
        return listed.returncode == 0 and not listed.stdout.strip()

    if not waits.until(gone, timeout_s=timeout, every_s=0.5):
        raise SystemExit(f"jobs {', '.join(jobs)} did not finish in {timeout} s")


def completed(run: Path) -> bool:
    try:
        return json.loads((run / "result.json").read_text())["status"] == "completed"
    except (OSError, ValueError, KeyError):
        return False


def sweep_side(i: int, trials: int, epochs: int, storage: Path) -> tuple[float, list[float]]:
    """Seconds for the sweep, and the learning rates it drew."""
    name = f"sweep-{i}"
    args = ["sweep", *TRIAL, "--epochs", str(epochs), "--param", "lr=loguniform:1e-3:0.3", "--trials", str(trials)]
    args += ["--scheduler", "none", "--storage", str(storage), "--name", name]
    started = time.monotonic()
    job = submit(["--nodes=3", "--cpus-per-task=4"], args)
    wait_gone([job], timeout=1800)
    took = time.monotonic() - started
    records = json.loads((storage / name / "trials.json").read_text())
    if sorted(r["status"] for r in records) != ["completed"] * trials:
        raise SystemExit(f"sweep job {job}: not every trial completed: {records}")
    return took, [float(r["params"]["lr"]) for r in sorted(records, key=lambda r: r["name"])]


def jobs_side(i: int, lrs: list[float], epochs: int, storage: Path) -> float:
    """Seconds for the same trials as separate jobs, all submitted at once."""
    started = time.monotonic()
    jobs = [
        submit(
            ["--nodes=1", "--cpus-per-task=3"],
            [
                *TRIAL,
                "--epochs",
                str(epochs),
                "--lr",
                repr(lr),
                "--storage",
                str(storage),
                "--name",
                f"jobs-{i}-{k}",
            ],
        )
        for k, lr in enumerate(lrs)
    ]
    wait_gone(jobs, timeout=3600)
    took = time.monotonic() - started
    missing = [k for k in range(len(lrs)) if not completed(storage / f"jobs-{i}-{k}")]
    if missing:
        raise SystemExit(f"separate jobs {jobs}: trials {missing} did not complete")
    return took


def summary(values: list[float], unit: str = " s") -> str:
    if len(values) == 1:  # one run is a figure, not a range
        return f"{values[0]:.1f}{unit} (1 run)"
    return f"{statistics.median(values):.1f}{unit} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2, help="sweep / separate-jobs pairs, interleaved")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()
    subprocess.run([sys.executable, str(REPO / "tests/testbed/testbed.py"), "up"], env=dict(os.environ), check=True)
    slurm_boot.fresh_work()
    storage = slurm_boot.WORK / "runs"
    sweeps: list[float] = []
    separate: list[float] = []
    for i in range(a.pairs):
        took, lrs = sweep_side(i, a.trials, a.epochs, storage)
        sweeps.append(took)
        separate.append(jobs_side(i, lrs, a.epochs, storage))
        print(f"pair {i + 1}: sweep {sweeps[-1]:.1f} s, separate jobs {separate[-1]:.1f} s", flush=True)
    per_hour = [a.trials * 3600 / s for s in sweeps], [a.trials * 3600 / s for s in separate]
    ratios = [j / s for s, j in zip(sweeps, separate, strict=True)]
    print(
        f"\n{a.trials} trials of {a.epochs} epochs, 2 CPU workers each, 3 testbed nodes of 4 CPUs; {a.pairs} pair(s)\n"
    )
    print("| | wall | trials per hour |")
    print("|---|---|---|")
    print(f"| one sweep job (one cluster boot) | {summary(sweeps)} | {summary(per_hour[0], '')} |")
    print(f"| separate jobs (a cluster boot each) | {summary(separate)} | {summary(per_hour[1], '')} |")
    print(f"\nseparate jobs' wall / the sweep's, pair by pair: {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
