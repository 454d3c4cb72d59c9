"""Job start -> first training step on the Slurm testbed, with Ray Data's default pool of Parquet footer
readers (32 actors per read) against raytrain's (``RAY_DATA_PARQUET_FOOTER_NUM_ACTORS=4``), interleaved.

    make testbed-up && PYTHONPATH=. .venv/bin/python bench/footer_actors.py --runs 3
"""

from __future__ import annotations

import argparse
import re
import statistics

from tests.slurm_util import boot_testbed

FIT = ("--device", "cpu", "--image-size", "8", "--cpus-per-worker", "1", "--storage", "runs", "--epochs", "1")
JOB = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="pairs of jobs")
    args = ap.parse_args()
    testbed = boot_testbed()
    seconds: dict[str, list[float]] = {"32": [], "4": []}
    for i in range(args.runs):
        for actors, times in seconds.items():
            env = {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": actors}
            job = testbed.submit(*JOB, fit=(*FIT, "--name", f"footer-{actors}-{i}"), env=env)
            testbed.wait_done(job, timeout=600)
            found = re.search(r"first training step ([\d.]+) s after the job started", testbed.output(job))
            assert found, testbed.output(job)
            times.append(float(found.group(1)))
            print(f"{actors} footer actors: first step {times[-1]:.1f} s", flush=True)
    ray_default, ours = (statistics.median(v) for v in seconds.values())
    print(f"median: Ray's 32 {ray_default:.1f} s, raytrain's 4 {ours:.1f} s, ratio {ours / ray_default:.2f}")


if __name__ == "__main__":
    main()
