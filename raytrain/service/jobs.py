"""A running job's cluster, from the login node: ``raytrain submit``, ``status`` and ``stop``.

Everything goes through Slurm itself, so only the job's owner can use the cluster: drivers and the status
probe run in steps of the job on its head node (``srun --jobid=JOB --overlap``), and a stop is a signal to
the job's batch script (``scancel --batch --signal=USR1``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from raytrain.contracts import jobdir
from raytrain.errors import UserError
from raytrain.service.dashboard import cluster_of

_FINISHED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise UserError(f"{tool} not found: run this on a Slurm login node (or put Slurm's commands on PATH)")
    return path


def _on_head(job_id: str, step_name: str, argv: Sequence[str]) -> list[str]:
    """srun a command in a step of JOB_ID on its head node, sharing the job's resources."""
    head = cluster_of(job_id).head_node
    return [
        _need("srun"),
        f"--jobid={job_id}",
        "--overlap",
        "--whole",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={head}",
        f"--job-name={step_name}",
        "--quit-on-interrupt",
        "--export=ALL",
        *argv,
    ]


def submit(job_id: str, argv: Sequence[str]) -> int:
    """Run a driver (``fit ...`` or any command) on the job's cluster; its output streams here; its exit
    status is returned."""
    if not argv:
        raise UserError(f"nothing to run: raytrain submit {job_id} -- fit ... (or -- python train.py ...)")
    directory = jobdir.job_dir(job_id)
    cmd = _on_head(
        job_id,
        jobdir.DRIVER_STEP,
        [sys.executable, "-m", "raytrain.launch", "exec", "--job-dir", str(directory), "--", *argv],
    )
    return subprocess.run(cmd).returncode


def status(job_id: str) -> int:
    directory = jobdir.job_dir(job_id)
    cmd = _on_head(
        job_id, "raytrain-status", [sys.executable, "-m", "raytrain.launch", "status", "--job-dir", str(directory)]
    )
    return subprocess.run(cmd).returncode


def job_state(job_id: str) -> str | None:
    """Slurm's state of a job (RUNNING, COMPLETED, ...), or None once Slurm no longer knows it."""
    proc = subprocess.run([_need("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True)
    for field in proc.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return None


def stop(job_id: str, timeout_s: float = 60) -> str:
    """Ask the job's batch script to end the job, and wait until it has: returns the job's final state."""
    cluster_of(job_id)  # a clear error if it is not a running raytrain cluster of ours
    proc = subprocess.run([_need("scancel"), "--batch", "--signal=USR1", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"scancel could not signal job {job_id}: {proc.stderr.strip() or proc.returncode}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state is None or state.startswith(_FINISHED):
            return state or "gone"
        time.sleep(0.5)
    raise UserError(
        f"job {job_id} is still {job_state(job_id)} {timeout_s:.0f} s after the stop request: "
        f"see its log, or cancel it with scancel {job_id}"
    )
