"""slurm/ray_cluster.sbatch on a real 3-node Slurm testbed (tests/testbed): failures and placement.

Jobs that train to completion are in test_sweep_slurm.py and test_faults_slurm.py, jobs cancelled while they
train in test_two_users_slurm.py; a driver that fails failing the job with its exit status, in
test_faults_slurm.py (storage one node sees)."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from tests.slurm_util import STUCK_RAY, Testbed, assert_cleaned_up, exit_code

pytestmark = pytest.mark.slurm
CPU_JOB = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=4")
TINY_FIT = ("--device", "cpu", "--image-size", "16", "--cpus-per-worker", "1")


@pytest.mark.parametrize(
    ("bad", "how", "within"),
    [("node3", "hang", 60), ("node3", "exit", 30), ("node1", "late-exit", 30)],
    ids=["worker-never-joins", "worker-dies", "head-dies-while-workers-connect"],
)
def test_node_that_never_joins_fails_the_job_naming_it(testbed: Testbed, bad: str, how: str, within: float) -> None:
    env = {
        "RAYTRAIN_RAY_BIN": STUCK_RAY,
        "RAYTRAIN_TEST_BAD_NODE": bad,
        "RAYTRAIN_TEST_BAD_HOW": how,
        "RAYTRAIN_JOIN_TIMEOUT": "30",
    }
    job = testbed.submit(*CPU_JOB, fit=TINY_FIT, env=env)
    info = testbed.wait_done(job, timeout=120)
    out = testbed.output(job)
    assert info["JobState"] == "FAILED" and exit_code(info) != 0, out
    log = str(testbed.log_dir(job) / ("head-node1.log" if bad == "node1" else f"worker-{bad}.log"))
    if how == "hang":
        assert re.search(rf"{bad} did not join the Ray cluster within 30 s; logs: {bad}: {re.escape(log)}", out), out
    else:
        assert f"Ray on {bad} exited before the cluster was up; see {log}" in out, out
    took = datetime.fromisoformat(info["EndTime"]) - datetime.fromisoformat(info["StartTime"])
    assert took.total_seconds() < within, (info["StartTime"], info["EndTime"])
    assert_cleaned_up(job)


def test_gpu_dry_run_places_one_worker_per_node_and_gpu(testbed: Testbed) -> None:
    job = testbed.submit("--nodes=3", "--gpus-per-node=2", "--cpus-per-task=4", fit=("--dry-run",))
    info = testbed.wait_done(job, timeout=120)
    out = testbed.output(job)
    assert exit_code(info) == 0, out
    assert "placement: 6 GPU workers on 3 nodes, backend nccl" in out
    rows = re.findall(r"^  (\d+)\s+(node\d)\s+([\d.]+)\s+(cuda:\d)$", out, re.M)
    assert [(r[1], r[3]) for r in rows] == [(f"node{n}", f"cuda:{g}") for n in (1, 2, 3) for g in (0, 1)]
    assert [r[0] for r in rows] == [str(i) for i in range(6)]
    assert_cleaned_up(job)
