"""The lockdown probe of a running job on the Slurm testbed: every endpoint of the job refuses requests
without its token, except the documented ones, and the token leaks nowhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc

from tests.conftest import REPO
from tests.listeners import grpc_call, grpc_probe, http_status, job_listeners, ray_worker_ports, still_listening
from tests.slurm_util import Testbed, node_roots

GET_NODES = "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"
# Prometheus exporters (read-only metrics, no auth in Ray); documented in the README.
METRICS = ("metrics_export", "dashboard_metric", "autoscaler_metric")


def in_head_netns(code: str) -> str:
    """Run Python inside node1's network namespace (the head's loopback is only reachable there)."""
    proc = subprocess.run(
        ["nsenter", "--net=/run/netns/rtn1", sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.strip()


def dashboard_status(port: int, path: str, token: str | None, method: str = "GET") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    call = f"http_status('127.0.0.1', {port}, {path!r}, {headers!r}, {method!r})"
    code = f"from tests.listeners import http_status; print({call})"
    return int(in_head_netns(code))


def gcs_call(address: str, token: str | None) -> str:
    with grpc.insecure_channel(address) as channel:
        return grpc_call(channel, GET_NODES, token, timeout=5)


def ray_default_token_mtime(home: Path) -> int | None:
    """Ray's default token file in HOME, shared by all of a user's Ray clusters: a job must never write it."""
    path = home / ".ray/auth_token"
    return path.stat().st_mtime_ns if path.exists() else None


def assert_locked_down(testbed: Testbed, job: str, private: Path, trainers_expected: int, runs: int = 1) -> None:
    """Probe every listening socket of the running JOB (with TRAINERS_EXPECTED training workers in RUNS
    runs), whose private directory is PRIVATE."""
    token = (private / "token").read_text().strip()
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
    torch_ports = range(ports["torch_first"], ports["torch_last"] + 1)
    exceptions = {ports[m] for m in METRICS}
    listeners = job_listeners(job)
    worker_ports = {node: ray_worker_ports(root, job) for node, root in node_roots().items()}
    trainers = {(lst.node, lst.pid) for lst in listeners if lst.process.startswith("ray::RayTrainWo")}
    served = {(lst.node, lst.pid) for lst in listeners if lst.port in worker_ports[lst.node]}
    assert len(trainers) == trainers_expected and trainers <= served  # each training worker's Ray port gets probed
    stores = [lst for lst in listeners if lst.process.startswith("ray::RayTrainWo") and lst.port in torch_ports]
    assert len({(lst.node, lst.port) for lst in stores}) == runs, listeners  # each run's rank 0's TCPStore
    for lst in listeners:
        if lst.loopback or lst.process == "srun":
            continue
        host = {"node1": "10.77.0.11", "node2": "10.77.0.12", "node3": "10.77.0.13"}[lst.node]
        torch_range = lst.port in torch_ports
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


def assert_dashboard_hint(hint: str, log: str, private: Path) -> None:
    """`raytrain dashboard JOB` on the login node (what it printed: HINT) names the tunnel the job's LOG shows
    and the token in its private directory PRIVATE."""
    dash = json.loads((private / "cluster.json").read_text())["dashboard_port"]
    tunnel = f"ssh -N -L 8265:127.0.0.1:{dash} -J "
    assert tunnel in hint and f"{private}/token" in hint, hint
    assert tunnel in log
