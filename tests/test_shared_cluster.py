"""A shared cluster on the Slurm testbed: token auth that cannot be set up stops a job before any Ray
process starts, and a stock script that a real time limit requeues. The time-limit signal -> checkpoint ->
requeue -> resume path of `fit`, on a Ray without drain-node, is in test_scale_slurm; jobs of two users
sharing nodes, locked down and cancelled one at a time, are test_two_users_slurm."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.conftest import REPO
from tests.slurm_util import FAST_FIT, TWO_NODES, WHOLE_NODES, Testbed, assert_cleaned_up, exit_code

pytestmark = pytest.mark.slurm


def test_auth_that_cannot_be_set_up_stops_the_job(testbed: Testbed) -> None:
    job = testbed.submit(*WHOLE_NODES, fit=FAST_FIT, env={"RAYTRAIN_STATE_DIR": "/proc/raytrain-no-such-dir"})
    info = testbed.wait_done(job, timeout=60)
    out = testbed.output(job)
    assert info["JobState"] == "FAILED" and exit_code(info) == 2, out
    assert re.search(r"raytrain: error: cannot set up token auth in /proc/raytrain-no-such-dir/\d+ .*without auth", out)
    assert "head on" not in out  # no Ray process was started
    assert_cleaned_up(job)
    assert os.environ.get("RAYTRAIN_STATE_DIR") is None


def test_the_time_limit_requeues_a_script_that_never_checkpoints_early_with_squeue_silent(testbed: Testbed) -> None:
    """A real time limit (--time=1:30, which Slurm rounds up to 2 minutes; warned 10-70 s before) on a stock
    script, run unchanged on every node, that never asks ending_soon(): the warning comes, the script trains
    on, and Slurm's SIGTERM at the limit requeues the job, even with squeue not answering the trap's questions
    (why the job ends, its steps). The next attempt resumes from the script's newest checkpoint. (A stock
    script that completes, result.json and all, is test_service_slurm's high-priority run.)"""
    stubs = testbed.work / "silent-squeue"
    stubs.mkdir(exist_ok=True)
    squeue = stubs / "squeue"
    real = shutil.which("squeue")
    squeue.write_text(f'#!/bin/sh\ncase "$*" in *%r*|*--steps*) exec sleep 600;; esac\nexec {real} "$@"\n')
    squeue.chmod(0o755)
    env = {"PATH": f"{stubs}:{testbed.env['PATH']}", "PYTHONPATH": str(REPO), "RAYTRAIN_SIGNAL_LEAD": "10"}
    # 3 CPUs a worker on 4-CPU nodes: Ray itself has to put the two workers on two nodes.
    stock = ("python", "-m", "tests.user_code.stock_train", "--storage", "runs", "--workers", "2")
    fit = ("--", *stock, "--cpus-per-worker", "3", "--epochs", "100000", "--name", "timelimit")
    job = testbed.submit(*TWO_NODES, "--time=1:30", "--signal=B:USR2@10", fit=fit, env=env)
    out = testbed.wait_output(job, r"requeueing job", timeout=300)
    assert "SIGUSR2: the job ends soon" in out and "SIGTERM: the job was cancelled or reached its time limit" in out
    assert re.search(
        rf"raytrain: requeueing job {job} \(restart 1 of at most 3\): it reached its time limit \(after the warning; "
        r"squeue did not say\)",
        out,
    ), out
    assert "raytrain: driver: python -m tests.user_code.stock_train --storage runs " in out, out
    placed = re.findall(r"\(ip=(10\.77\.0\.\d+), pid=\d+\) world_rank=\d", out)
    assert sorted(placed) == ["10.77.0.11", "10.77.0.12"], out  # Ray's own line per worker
    first = [int(e) for e in re.findall(r"raytrain: epoch (\d+) ", out)]  # the service's line per report
    assert first, out
    info = testbed.wait_state(job, {"RUNNING"}, timeout=120)
    assert info["Restarts"] == "1", info
    out = testbed.wait_output(job, rf"(?s)requeueing job {job} \(restart 1.*raytrain: epoch \d+ ", timeout=240)
    attempt_0 = out.split("/attempt-1")[0]  # the requeue's own SIGTERM does not decide a second time
    assert attempt_0.count("SIGTERM: the job was cancelled") == 1 and attempt_0.count("requeueing job") == 1, out
    resumed = int(re.findall(r"raytrain: epoch (\d+) ", out.split(f"requeueing job {job} (restart 1")[1])[0])
    assert resumed > 1 and resumed >= max(first) - 2, (resumed, first)  # from its newest checkpoint (2 kept)
    testbed.run("scancel", job)
    assert_cleaned_up(job)
