"""16 workers on 4 testbed nodes: raytrain against torchrun launched by srun, side by side, interleaved.

    python bench/scale16.py --runs 3

Both train the same workload as tests/test_scale_slurm.py (the embedded digits at 8 px, shufflenet_v2_x0_5,
16 a worker, gloo, one thread a worker) for --epochs epochs on 4 nodes of 4 CPUs: raytrain through
slurm/ray_cluster.sbatch (`--workers 16`), the peer through bench/torchrun_srun.sbatch (one torchrun per node,
4 processes each, c10d rendezvous) running bench/torchrun_ddp.py. Jobs alternate (raytrain, torchrun, ...).
Per job: training samples/s of each epoch after the first (rows trained / training time, the same on both
sides), the first training step and the whole job, from job start. Prints a Markdown table of medians,
ranges and the ratio raytrain / torchrun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import pyarrow.fs as pafs
from slurm_boot import REPO, WORK, cpu_job, fresh_work, number, run_job, summary

from raytrain.recipe.data import digits

NODES, PER_NODE = 4, 4
MODEL, SIZE, BATCH = "shufflenet_v2_x0_5", 8, 16


def steady(samples: list[float], times: list[float]) -> float:
    """Samples/s over the epochs after the first (the first carries start-up on both sides)."""
    return sum(samples[1:]) / sum(times[1:])


def raytrain(epochs: int, data: str) -> tuple[float, float, float]:
    fit = [
        *("--workers", str(NODES * PER_NODE), "--device", "cpu", "--model", MODEL, "--image-size", str(SIZE)),
        *("--batch-size", str(BATCH), "--epochs", str(epochs), "--data", data, "--augment", "none"),
        *("--storage", "runs", "--name", "scale16", "--fresh"),
    ]
    start = time.time()
    out = run_job(REPO / "slurm/ray_cluster.sbatch", cpu_job(NODES), fit, "raytrain-%j.out")
    wall = time.time() - start
    history = json.loads((WORK / "runs/scale16/result.json").read_text())["history"]
    full = [h for h in history if h["batches_done"] == 0]
    rate = steady([h["train_samples"] for h in full], [h["train_time_s"] for h in full])
    return rate, number(r"first training step ([\d.]+) s after the job started", out), wall


def torchrun(epochs: int, data: str) -> tuple[float, float, float]:
    result = WORK / "torchrun.json"
    args = [str(PER_NODE), str(REPO / "bench/torchrun_ddp.py"), "--data", data, "--model", MODEL]
    args += ["--image-size", str(SIZE), "--batch-size", str(BATCH), "--epochs", str(epochs), "--out", str(result)]
    start = time.time()
    run_job(REPO / "bench/torchrun_srun.sbatch", [*cpu_job(NODES), "--output=torchrun-%j.out"], args, "torchrun-%j.out")
    wall = time.time() - start
    run = json.loads(result.read_text())
    assert run["world_size"] == NODES * PER_NODE, run
    rate = steady([e["train_samples"] for e in run["epochs"]], [e["train_time_s"] for e in run["epochs"]])
    return rate, float(run["first_step_s"]), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    a = ap.parse_args()
    subprocess.run([sys.executable, str(REPO / "tests/testbed/testbed.py"), "up"], check=True)
    fresh_work()
    data = digits.ensure(pafs.LocalFileSystem(), str(WORK / "runs"))  # the embedded set, as `fit` writes it
    ours: list[tuple[float, float, float]] = []
    peer: list[tuple[float, float, float]] = []
    for i in range(a.runs):
        ours.append(raytrain(a.epochs, data))
        peer.append(torchrun(a.epochs, data))
        print(f"run {i + 1}: raytrain {ours[-1]}; torchrun {peer[-1]}", flush=True)
    print(f"\n| 4 nodes x 4 CPU workers, {a.runs} runs each | raytrain | torchrun by srun | ratio |\n|---|---|---|---|")
    for k, name in enumerate(("training samples/s (epochs 2+)", "job start -> first step", "job start -> job end")):
        r, t = [x[k] for x in ours], [x[k] for x in peer]
        cells = [f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" if k == 0 else summary(v) for v in (r, t)]
        print(f"| {name} | {cells[0]} | {cells[1]} | {statistics.median(r) / statistics.median(t):.2f} |")


if __name__ == "__main__":
    main()
