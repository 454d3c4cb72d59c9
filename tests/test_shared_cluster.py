"""A shared cluster on the Slurm testbed: auth and exposure of a running job, jobs sharing nodes (one
cancelled while it trains, one trained to completion), and a stock script that a real time limit requeues.
The time-limit signal -> checkpoint -> requeue -> resume path of `fit`, on a Ray without drain-node, is in
test_scale_slurm."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from raytrain.contracts.jobdir import job_dir
from tests.conftest import REPO
from tests.lockdown import assert_locked_down, ray_default_token_mtime
from tests.slurm_util import FAST_FIT, Testbed, assert_cleaned_up, exit_code

pytestmark = pytest.mark.slurm
WHOLE_NODES = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=4")
HALF_NODES = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=2")


@dataclass(frozen=True)
class Training:
    job: str
    token: str
    ray_default_token: int | None  # mtime of Ray's shared default token file before the job, if any


@pytest.fixture(scope="module")
def training(testbed: Testbed) -> Iterator[Training]:
    """A job on half of each node that trains until it is cancelled: probed by one test, joined and cancelled by
    the next."""
    before = ray_default_token_mtime()
    job = testbed.submit(*HALF_NODES, fit=(*FAST_FIT, "--epochs", "100000", "--name", "long"))
    try:
        testbed.wait_output(job, r"^epoch +1/100000 ", timeout=300)
        yield Training(job, (job_dir(job) / "token").read_text().strip(), before)
    finally:
        testbed.run("scancel", job, check=False)


def test_a_running_job_is_locked_down(testbed: Testbed, training: Training) -> None:
    assert_locked_down(testbed, training.job, training.token, trainers_expected=3)
    assert ray_default_token_mtime() == training.ray_default_token  # the job never wrote Ray's shared token


def test_two_jobs_share_nodes_and_cancelling_one_spares_the_other(testbed: Testbed, training: Training) -> None:
    long = training.job
    try:
        # What jobs SIGKILLed before their teardown leave: the next job removes this cluster's, and only those.
        stale, foreign = job_dir("990001"), job_dir("990002")
        for path, cluster in ((stale, "rttestbed"), (foreign, "another-cluster")):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            (path / "token").write_text("0" * 64)
            (path / "slurm-cluster").write_text(cluster + "\n")
        short = testbed.submit(*HALF_NODES, fit=(*FAST_FIT, "--epochs", "2", "--name", "short"))
        testbed.wait_output(short, r"^placement: ", timeout=300)
        assert not stale.exists() and (foreign / "token").exists()
        assert "removed the private directories of ended jobs 990001 " in testbed.output(short)
        shutil.rmtree(foreign)
        a, b = testbed.job(long), testbed.job(short)
        assert a["JobState"] == b["JobState"] == "RUNNING" and a["NodeList"] == b["NodeList"] == "node[1-3]"
        blocks = [
            re.search(r"ports (\d+)-", (testbed.log_dir(j) / "head-node1.log").read_text()) for j in (long, short)
        ]
        assert blocks[0] and blocks[1] and blocks[0].group(1) != blocks[1].group(1)

        testbed.run("scancel", long)
        assert testbed.wait_done(long, timeout=60)["JobState"] == "CANCELLED"
        assert_cleaned_up(long)
        out = testbed.output(long)
        assert "SIGTERM: the job was cancelled" in out
        assert "SIGTERM received" not in out and "Traceback" not in out  # no stack dumps from Ray or raytrain
        assert training.token not in out
        for path in testbed.log_dir(long).rglob("*"):
            if path.is_file() and path.stat().st_size < 20_000_000:
                assert training.token.encode() not in path.read_bytes(), path

        info = testbed.wait_done(short, timeout=400)
        out = testbed.output(short)
        assert info["JobState"] == "COMPLETED" and exit_code(info) == 0, out
        assert re.search(r"cluster: all 3 nodes joined, [\d.]+ s after the job started", out), out
        result = json.loads((testbed.work / "runs/short/result.json").read_text())
        assert result["status"] == "completed" and result["epochs_completed"] == 2 and result["world_size"] == 3
        assert {p["hostname"] for p in result["placement"]} == {"node1", "node2", "node3"}
        ckpt = Path(result["last_checkpoint"])
        assert ckpt.is_relative_to(testbed.work / "runs/short") and (ckpt / "state.pt").is_file()
        logs = testbed.log_dir(short)
        assert {p.name for p in logs.glob("*.log")} == {"head-node1.log", "worker-node2.log", "worker-node3.log"}
        assert (logs / "ray-head-node1").is_dir()  # Ray's own logs, kept from the node-local temp dir
        assert_cleaned_up(short)
    finally:  # the module's long job is this test's to end, passed or failed (its own, conftest ends)
        testbed.run("scancel", long, check=False)


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
    """A real time limit (90 s, warned 10-70 s before) on a stock script, run unchanged on every node, that
    never asks ending_soon(): the warning comes, the script trains on, and Slurm's SIGTERM at the limit
    requeues the job, even with squeue not answering the trap's questions (why the job ends, its steps). The
    next attempt resumes from the script's newest checkpoint. (A stock script that completes, result.json and
    all, is test_service_slurm's first driver.)"""
    stubs = testbed.work / "silent-squeue"
    stubs.mkdir(exist_ok=True)
    squeue = stubs / "squeue"
    real = shutil.which("squeue")
    squeue.write_text(f'#!/bin/sh\ncase "$*" in *%r*|*--steps*) exec sleep 600;; esac\nexec {real} "$@"\n')
    squeue.chmod(0o755)
    env = {"PATH": f"{stubs}:{testbed.env['PATH']}", "PYTHONPATH": str(REPO), "RAYTRAIN_SIGNAL_LEAD": "10"}
    # 3 CPUs a worker on 4-CPU nodes: Ray itself has to put the three workers on three nodes.
    stock = ("python", "-m", "tests.user_code.stock_train", "--storage", "runs", "--workers", "3")
    fit = ("--", *stock, "--cpus-per-worker", "3", "--epochs", "100000", "--name", "timelimit")
    job = testbed.submit(*WHOLE_NODES, "--time=1:30", "--signal=B:USR2@10", fit=fit, env=env)
    out = testbed.wait_output(job, r"requeueing job", timeout=300)
    assert "SIGUSR2: the job ends soon" in out and "SIGTERM: the job was cancelled or reached its time limit" in out
    assert re.search(
        rf"raytrain: requeueing job {job} \(restart 1 of at most 3\): it reached its time limit \(after the warning; "
        r"squeue did not say\)",
        out,
    ), out
    assert "raytrain: driver: python -m tests.user_code.stock_train --storage runs " in out, out
    placed = re.findall(r"\(ip=(10\.77\.0\.\d+), pid=\d+\) world_rank=\d", out)
    assert sorted(placed) == ["10.77.0.11", "10.77.0.12", "10.77.0.13"], out  # Ray's own line per worker
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
