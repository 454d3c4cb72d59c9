"""``raytrain dashboard JOBID``: how to reach a running job's Ray dashboard (and its Prometheus, when it
runs one), which listen on the head's loopback only, through an ssh tunnel via the login node, and where
the dashboard's token is."""

from __future__ import annotations

import getpass
import socket

from raytrain.contracts import jobdir
from raytrain.errors import UserError

LOCAL_PORT = 8265
PROMETHEUS_PORT = 9090


def cluster_of(job_id: str) -> jobdir.ClusterFile:
    """The running job's cluster.json, or a UserError that says how to find the job."""
    if not job_id.isdigit():
        raise UserError(f"{job_id!r} is not a Slurm job id: give the number sbatch printed (squeue --me lists yours)")
    directory = jobdir.job_dir(job_id)
    try:
        return jobdir.ClusterFile.read(directory)
    except FileNotFoundError:
        raise UserError(
            f"no running raytrain cluster for job {job_id} in {directory.parent} (it exists while the job runs): "
            "check the job id with squeue --me, and RAYTRAIN_STATE_DIR if the job set it"
        ) from None


def hint(job_id: str, *, login_host: str | None = None) -> str:
    info = cluster_of(job_id)
    user = getpass.getuser()
    head, port = info.head_node, info.dashboard_port
    login = login_host or info.submit_host or socket.gethostname()
    prometheus = (
        [
            f"  the job's Prometheus through the same tunnel: add -L {PROMETHEUS_PORT}:127.0.0.1:"
            f"{info.prometheus_port} to that ssh command, then open http://localhost:{PROMETHEUS_PORT} "
            "(raytrain's series: ray_raytrain_*)"
        ]
        if info.prometheus_port
        else []
    )
    return "\n".join(
        [
            f"Ray dashboard of job {job_id}: {head}, 127.0.0.1:{port} (loopback only; token auth on)",
            f"  from your machine: ssh -N -L {LOCAL_PORT}:127.0.0.1:{port} -J {user}@{login} {user}@{head}",
            f"  then open http://localhost:{LOCAL_PORT} and paste the token from {info.token_path} "
            "(0600, removed when the job ends; never share it)",
            f"  Jobs API through the same tunnel: RAY_ADDRESS=http://localhost:{LOCAL_PORT} RAY_AUTH_MODE=token "
            "RAY_AUTH_TOKEN_PATH=<a private copy of that file> ray job list",
            *prometheus,
        ]
    )
