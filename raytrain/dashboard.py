"""``raytrain dashboard JOBID``: how to reach a running job's Ray dashboard, which listens on the head's
loopback only, through an ssh tunnel via the login node, and where its token is."""

from __future__ import annotations

import getpass
import json
import os
import socket
from pathlib import Path

from raytrain.errors import UserError
from raytrain.launch.jobdir import CLUSTER_FILE

LOCAL_PORT = 8265


def state_dir() -> Path:
    """Where slurm/ray_cluster.sbatch keeps each job's private directory (``RAYTRAIN_STATE_DIR``)."""
    return Path(os.environ.get("RAYTRAIN_STATE_DIR") or Path.home() / ".raytrain" / "jobs")


def hint(job_id: str, *, login_host: str | None = None) -> str:
    path = state_dir() / job_id / CLUSTER_FILE
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"no running raytrain cluster for job {job_id} in {path.parent} (it exists while the job runs): "
            "check the job id with squeue --me, and RAYTRAIN_STATE_DIR if the job set it"
        ) from None
    user = getpass.getuser()
    head, port = info["head_node"], info["dashboard_port"]
    login = login_host or info.get("submit_host") or socket.gethostname()
    return "\n".join(
        [
            f"Ray dashboard of job {job_id}: {head}, 127.0.0.1:{port} (loopback only; token auth on)",
            f"  from your machine: ssh -N -L {LOCAL_PORT}:127.0.0.1:{port} -J {user}@{login} {user}@{head}",
            f"  then open http://localhost:{LOCAL_PORT} and paste the token from {info['token_path']} "
            "(0600, removed when the job ends; never share it)",
            f"  Jobs API through the same tunnel: RAY_ADDRESS=http://localhost:{LOCAL_PORT} RAY_AUTH_MODE=token "
            "RAY_AUTH_TOKEN_PATH=<a private copy of that file> ray job list",
        ]
    )
