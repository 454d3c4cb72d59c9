"""Boot time on the Slurm testbed: raytrain's batch script against the stock pattern, interleaved, at
one or more node counts (the testbed is booted with the largest).

    python bench/slurm_boot.py --runs 5 --train-runs 3                         # 3 nodes
    python bench/slurm_boot.py --nodes 3,6,8 --train-nodes 3,6 --runs 3 --train-runs 2   # the boot curve
    python bench/slurm_boot.py --runs 0 --train-runs 5 --before /tmp/before    # first step, before/after
    python bench/slurm_boot.py --runs 0 --train-runs 5 --container             # first step, in Podman or not

For each run it submits slurm/ray_cluster.sbatch (a --dry-run driver), bench/stock_pattern.sbatch (the
documented template's fixed sleeps) and bench/polling_pattern.sbatch (the same written with readiness
polls: every worker started as soon as the head answers, the driver once all have joined), one after
the other, and reads from their output when every node had joined (and, for the peers, when their
driver started). --train-runs jobs then train one epoch (one CPU worker per node) to
time the first step; with ``--before DIR`` (a checkout of an earlier revision, run by the same
interpreter with its own batch script and code) they alternate with that checkout's; with ``--container``
they alternate with the same job inside the testbed's Podman image (tests/container_image.py: Debian's
python3, this checkout's virtualenv bound in). Prints a Markdown table of medians and ranges.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from raytrain import waits

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".testbed/work/bench-boot"
PEERS = {  # what users run instead, as the documented template has it and as a careful user writes it
    "stock pattern (fixed sleeps)": REPO / "bench/stock_pattern.sbatch",
    "polling pattern (readiness polls)": REPO / "bench/polling_pattern.sbatch",
}


def cpu_job(nodes: int) -> list[str]:
    return [f"--nodes={nodes}", "--gpus-per-node=0", "--cpus-per-task=4"]


def env(checkout: Path = REPO, extra: dict[str, str] | None = None) -> dict[str, str]:
    e = dict(os.environ, SLURM_CONF=str(REPO / ".testbed/slurm.conf"), STOCK_DRIVER=str(REPO / "bench/stock_driver.py"))
    e.update(extra or {})
    e["PATH"] = f"{Path(sys.executable).parent}:{e['PATH']}"
    e.pop("RAY_ADDRESS", None)
    if checkout != REPO:  # the job (sbatch exports this environment) imports that checkout's raytrain
        e["PYTHONPATH"] = str(checkout)
    return e


def fresh_work() -> None:
    """An empty work directory for this run of a benchmark: a testbed booted again numbers its jobs from 1,
    and a job's output file left by an earlier boot would be appended to and read for the new job's."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)


def run_job(
    script: Path,
    opts: list[str],
    args: list[str],
    output: str,
    timeout: float = 600,
    checkout: Path = REPO,
    extra: dict[str, str] | None = None,
) -> str:
    sbatch = ["sbatch", "--parsable", *opts, str(script), *args]
    job_env = env(checkout, extra)
    job = subprocess.run(sbatch, env=job_env, cwd=WORK, capture_output=True, text=True, check=True).stdout.strip()

    def gone() -> bool:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env(), capture_output=True, text=True)
        return not state.stdout.strip()

    if waits.until(gone, timeout_s=timeout, every_s=0.5):
        return (WORK / output.replace("%j", job)).read_text()
    raise SystemExit(f"job {job} did not finish in {timeout} s")


def image_settings() -> dict[str, str]:
    """What runs a job in the testbed's Podman image (built first if Podman lacks it), as the tests do."""
    sys.path.insert(0, str(REPO))
    from tests import container_image

    tag, settings = container_image.ensure_with_settings()
    return {**settings, "RAYTRAIN_CONTAINER": tag}


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if not m:
        raise SystemExit(f"{pattern!r} not found in:\n{text}")
    return float(m.group(1))


def summary(values: list[float]) -> str:
    if len(values) == 1:  # one run is a figure, not a range
        return f"{values[0]:.1f} s (1 run)"
    return f"{statistics.median(values):.1f} s ({min(values):.1f}-{max(values):.1f})"


def counts(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=counts, default=[3], help="node counts to boot, e.g. 3,6,8")
    ap.add_argument("--train-nodes", type=counts, default=None, help="node counts to train at (default: --nodes)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--train-runs", type=int, default=3)
    ap.add_argument("--before", type=Path, default=None, help="an earlier checkout to time the first step against")
    ap.add_argument("--container", action="store_true", help="time the first step in the testbed's Podman image too")
    a = ap.parse_args()
    train_nodes = a.nodes if a.train_nodes is None else a.train_nodes
    testbed = dict(os.environ, RAYTRAIN_TESTBED_NODES=str(max(a.nodes + train_nodes)))
    subprocess.run([sys.executable, str(REPO / "tests/testbed/testbed.py"), "up"], env=testbed, check=True)
    fresh_work()
    rows = []
    for n in a.nodes if a.runs else []:
        ours: list[float] = []
        peers: dict[str, dict[str, list[float]]] = {p: {"driver": [], "joined": []} for p in PEERS}
        for i in range(a.runs):
            out = run_job(
                REPO / "slurm/ray_cluster.sbatch", cpu_job(n), ["--dry-run", "--device", "cpu"], "raytrain-%j.out"
            )
            ours.append(number(rf"all {n} nodes joined, ([\d.]+) s", out))
            took = [f"raytrain joined {ours[-1]:.1f} s"]
            for peer, script in PEERS.items():
                output = f"{script.stem}-%j.out"
                out = run_job(script, [*cpu_job(n), f"--output={output}"], [], output)
                peers[peer]["driver"].append(number(r"driver started ([\d.]+) s", out))
                peers[peer]["joined"].append(number(rf"all {n} nodes joined, ([\d.]+) s", out))
                took.append(
                    f"{peer} driver {peers[peer]['driver'][-1]:.1f} s, joined {peers[peer]['joined'][-1]:.1f} s"
                )
            print(f"{n} nodes, run {i + 1}: {'; '.join(took)}", flush=True)
        rows.append(f"| {n} | raytrain: job start -> all nodes joined ({a.runs} runs) | {summary(ours)} |")
        for peer, found in peers.items():
            rows += [
                f"| {n} | {peer}: job start -> driver starts | {summary(found['driver'])} |",
                f"| {n} | {peer}: job start -> all nodes joined | {summary(found['joined'])} |",
            ]
    fit = ["--device", "cpu", "--epochs", "1", "--image-size", "8", "--cpus-per-worker", "1", "--storage", "runs",
           "--fresh", "--name", "boot"]  # fmt: skip
    sides: dict[str, tuple[Path, dict[str, str]]] = {"raytrain": (REPO, {})}
    if a.before:
        sides[f"raytrain at {a.before}"] = (a.before, {})
    if a.container:
        sides["raytrain in a Podman image"] = (REPO, image_settings())
    for n in train_nodes if a.train_runs else []:
        first_step: dict[str, list[float]] = {side: [] for side in sides}
        joined: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(a.train_runs):
            for side, (checkout, extra) in sides.items():
                script = checkout / "slurm/ray_cluster.sbatch"
                out = run_job(script, cpu_job(n), fit, "raytrain-%j.out", checkout=checkout, extra=extra)
                first_step[side].append(number(r"first training step ([\d.]+) s after the job started", out))
                joined[side].append(number(rf"all {n} nodes joined, ([\d.]+) s", out))
                took = f"joined {joined[side][-1]:.1f} s, first step {first_step[side][-1]:.1f} s"
                print(f"{n} nodes, {side}, train run {i + 1}: {took}", flush=True)
        for side in sides:
            runs = f"({a.train_runs} runs)"
            rows.append(f"| {n} | {side}: job start -> all nodes joined {runs} | {summary(joined[side])} |")
            rows.append(f"| {n} | {side}: job start -> first training step {runs} | {summary(first_step[side])} |")
    print("\n| nodes | testbed, 2 cores | median (range) |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
