"""A shared cluster on the Slurm testbed: auth and exposure of a running job, jobs sharing nodes (one
cancelled while it trains, one trained to completion), and the time-limit path signal -> checkpoint ->
requeue -> resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.conftest import REPO
from tests.listeners import grpc_call, grpc_probe, http_status, job_listeners, ray_worker_ports, still_listening
from tests.slurm_util import Testbed, assert_cleaned_up, exit_code, node_roots

pytestmark = pytest.mark.slurm
FAST_FIT = ("--device", "cpu", "--image-size", "8", "--cpus-per-worker", "1", "--storage", "runs")
WHOLE_NODES = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=4")
HALF_NODES = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=2")
GET_NODES = "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"
# Prometheus exporters (read-only metrics, no auth in Ray); documented in the README.
METRICS = ("metrics_export", "dashboard_metric", "autoscaler_metric")


def job_dir(job: str) -> Path:
    return Path.home() / ".raytrain/jobs" / job


def in_head_netns(code: str) -> str:
    """Run Python inside node1's network namespace (the head's loopback is only reachable there)."""
    proc = subprocess.run(["nsenter", "--net=/run/netns/rtn1", sys.executable, "-c", code], cwd=REPO,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return proc.stdout.strip()


def dashboard_status(port: int, path: str, token: str | None, method: str = "GET") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    call = f"http_status('127.0.0.1', {port}, {path!r}, {headers!r}, {method!r})"
    code = f"from tests.listeners import http_status; print({call})"
    return int(in_head_netns(code))


def gcs_call(address: str, token: str | None) -> str:
    with grpc.insecure_channel(address) as channel:
        return grpc_call(channel, GET_NODES, token, timeout=5)


def ray_default_token_mtime() -> int | None:
    """Ray's default token file, shared by all of a user's Ray clusters: a job must never write it."""
    path = Path.home() / ".ray/auth_token"
    return path.stat().st_mtime_ns if path.exists() else None


@dataclass(frozen=True)
class Training:
    job: str
    token: str
    ray_default_token: int | None  # mtime of Ray's shared default token file before the job, if any


@pytest.fixture(scope="module")
def training(testbed: Testbed) -> Iterator[Training]:
    """A 50-epoch job on half of each node, under way: probed by one test, joined and cancelled by the next."""
    before = ray_default_token_mtime()
    job = testbed.submit(*HALF_NODES, fit=(*FAST_FIT, "--epochs", "50", "--name", "long"))
    try:
        testbed.wait_output(job, r"^epoch +1/50 ", timeout=300)
        yield Training(job, (job_dir(job) / "token").read_text().strip(), before)
    finally:
        testbed.run("scancel", job, check=False)


def test_a_running_job_is_locked_down(testbed: Testbed, training: Training) -> None:
    job, token = training.job, training.token
    private = job_dir(job)
    assert private.stat().st_mode & 0o777 == 0o700
    assert (private / "token").stat().st_mode & 0o777 == 0o600
    info = json.loads((private / "cluster.json").read_text())
    ports, dash = info["ports"], info["dashboard_port"]

    # GCS: refused without the token or with a wrong one; served with the right one.
    assert gcs_call(info["gcs_address"], None) == "UNAUTHENTICATED"
    assert gcs_call(info["gcs_address"], "0" * 64) == "UNAUTHENTICATED"
    assert gcs_call(info["gcs_address"], token) == "OK"
    # Dashboard and Jobs API: on the head's loopback only, and token-protected there too.
    assert http_status(info["head_ip"], dash, "/api/jobs/") is None
    for path in ("/api/jobs/", "/nodes?view=summary", "/api/cluster_status"):
        assert dashboard_status(dash, path, None) == 401, path
        assert dashboard_status(dash, path, "0" * 64) == 403, path
    assert dashboard_status(dash, "/api/jobs/", None, "POST") == 401
    assert dashboard_status(dash, "/api/jobs/", token) == 200
    assert dashboard_status(dash, "/api/cluster_status", token) == 200

    # Every non-loopback listener of the job refuses requests without the token, except the
    # documented ones: Prometheus metrics, torch's TCPStore (in the job's port block), Gloo's
    # connections, and srun's own I/O ports (Slurm's credentials protect those).
    block = range(ports["gcs"], ports["max_worker"] + 1)
    exceptions = {ports[m] for m in METRICS}
    listeners = job_listeners(job)
    worker_ports = {node: ray_worker_ports(root, job) for node, root in node_roots().items()}
    trainers = {(lst.node, lst.pid) for lst in listeners if lst.process.startswith("ray::RayTrainWo")}
    served = {(lst.node, lst.pid) for lst in listeners if lst.port in worker_ports[lst.node]}
    assert len(trainers) == 3 and trainers <= served  # each training worker's Ray port gets probed
    for lst in listeners:
        if lst.loopback or lst.process == "srun":
            continue
        host = {"node1": "10.77.0.11", "node2": "10.77.0.12", "node3": "10.77.0.13"}[lst.node]
        torch_range = ports["torch_first"] <= lst.port <= ports["torch_last"]
        ray_port = lst.port in worker_ports[lst.node]
        if lst.process.startswith("ray::RayTrainWo") and not (ray_port or torch_range):
            continue  # Gloo's data connections: ephemeral ports (in the block at times), no auth in torch
        assert lst.port in block, lst
        status = http_status(host, lst.port, "/metrics" if lst.port in exceptions else "/")
        if lst.port in exceptions:
            assert status == 200, lst
        elif status is not None:
            assert status in (401, 403), (lst, status)
        elif torch_range:
            assert lst.process.startswith("ray::RayTrainWo"), lst  # the TCPStore, pinned in the block
        else:
            codes = grpc_probe(host, lst.port)
            if set(codes.values()) == {"UNAVAILABLE"} and not still_listening(lst):
                continue  # gone since the listing: Ray ends idle workers
            assert codes and set(codes.values()) == {"UNAUTHENTICATED"}, (lst, codes)

    # The token appears in no command line, log, or the job's name.
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                assert token.encode() not in (proc / "cmdline").read_bytes(), proc
            except OSError:
                continue
    assert token not in testbed.run("scontrol", "show", "job", job).stdout
    # `raytrain dashboard` on the login node prints the tunnel the job log shows.
    hint = testbed.run(sys.executable, "-m", "raytrain", "dashboard", job).stdout
    tunnel = f"ssh -N -L 8265:127.0.0.1:{dash} -J "
    assert tunnel in hint and f"{private}/token" in hint
    assert tunnel in testbed.output(job)
    assert ray_default_token_mtime() == training.ray_default_token  # the job never wrote Ray's shared token


def test_two_jobs_share_nodes_and_cancelling_one_spares_the_other(testbed: Testbed, training: Training) -> None:
    long = training.job
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
    blocks = [re.search(r"ports (\d+)-", (testbed.log_dir(j) / "head-node1.log").read_text()) for j in (long, short)]
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


PREEMPT_EPOCHS = 10  # ~3 s each: far more work left than the ~12 s a drain can take to reach the loop


def preempt(testbed: Testbed, name: str, env: dict[str, str]) -> str:
    """A job that gets Slurm's time-limit signal during its second epoch and requeues."""
    env = {"RAYTRAIN_RAY_BIN": str(REPO / "tests/testbed/ray_that_fails_on.sh"), **env}
    fit = (*FAST_FIT, "--epochs", str(PREEMPT_EPOCHS), "--name", name)
    job = testbed.submit(*WHOLE_NODES, fit=fit, env=env)
    testbed.wait_output(job, rf"^epoch +1/{PREEMPT_EPOCHS} ", timeout=300)
    testbed.run("scancel", "--signal=USR2", "--batch", job)  # what --signal=B:USR2@T delivers
    out = testbed.wait_output(job, r"requeueing job", timeout=120)
    assert "driver exited with status 75" in out
    assert testbed.wait_state(job, {"PENDING"}, timeout=60)["Restarts"] == "1"
    return job


def test_time_limit_signal_checkpoints_requeues_and_resumes(testbed: Testbed) -> None:
    job = preempt(testbed, "preempt", {})
    first = testbed.output(job)
    assert re.search(r"stopped after \d+ batches: the job is ending \(ray-drain\)", first), first
    stopped_at = first.split("preempted: checkpoint ")[1].split()[0]
    info = testbed.wait_done(job, timeout=600)  # Slurm holds a requeued job back for cred_expire (testbed: 20 s)
    out = testbed.output(job)  # both attempts: the log is appended to across requeues
    assert info["JobState"] == "COMPLETED" and exit_code(info) == 0, out
    assert out.startswith(first) and f"resuming from {stopped_at} " in out, out
    assert testbed.log_dir(job, attempt=1).is_dir()
    result = json.loads((testbed.work / "runs/preempt/result.json").read_text())
    assert result["status"] == "completed" and result["epochs_completed"] == PREEMPT_EPOCHS
    # The second attempt starts exactly where the first stopped: nothing trained is lost.
    resumed = result["resumed_from"]
    assert Path(resumed["checkpoint"]).name == stopped_at and resumed["epoch"] >= 1, resumed
    assert result["epochs_this_attempt"] == PREEMPT_EPOCHS - resumed["epoch"]
    assert_cleaned_up(job)


def test_without_ray_drain_the_flag_file_still_checkpoints(testbed: Testbed) -> None:
    job = preempt(testbed, "preempt-flag", {"RAYTRAIN_TEST_NO_DRAIN": "1"})  # a Ray without drain-node
    out = testbed.output(job)
    assert "ray drain-node failed (Error: No such command 'drain-node'.)" in out
    assert re.search(r"stopped after \d+ batches: the job is ending \(flag-file\)", out), out
    run = testbed.work / "runs/preempt-flag"
    saved = out.split("preempted: checkpoint ")[1].split()[0]
    assert (run / saved / "state.pt").is_file() and saved >= "epoch_0001_step_", saved
    testbed.run("scancel", job)  # the resume is the previous test's business
    assert_cleaned_up(job)


def test_auth_that_cannot_be_set_up_stops_the_job(testbed: Testbed) -> None:
    job = testbed.submit(*WHOLE_NODES, fit=FAST_FIT, env={"RAYTRAIN_STATE_DIR": "/proc/raytrain-no-such-dir"})
    info = testbed.wait_done(job, timeout=60)
    out = testbed.output(job)
    assert info["JobState"] == "FAILED" and exit_code(info) == 2, out
    assert re.search(r"raytrain: error: cannot set up token auth in /proc/raytrain-no-such-dir/\d+ .*without auth", out)
    assert "head on" not in out  # no Ray process was started
    assert_cleaned_up(job)
    assert os.environ.get("RAYTRAIN_STATE_DIR") is None
