"""What Slurm tells a job, read through one small lookup table, and which of your jobs Slurm still lists.

This is the only Python module that reads ``SLURM_*`` variables; everything else asks it.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass


def _int(value: str | None) -> int | None:
    """Slurm counts come as "4", "4(x2)" or "gpu:a100:4"; take the last integer."""
    if not value:
        return None
    numbers = re.findall(r"\d+", value.split("(")[0])
    return int(numbers[-1]) if numbers else None


@dataclass(frozen=True)
class SlurmJob:
    """The parts of a Slurm job's environment raytrain uses."""

    job_id: str
    array_job_id: str | None
    array_task_id: str | None
    job_name: str | None
    restart_count: int
    num_nodes: int | None
    cpus_on_node: int | None
    gpus_on_node: int | None
    mem_per_node_mb: int | None
    submit_host: str | None
    submit_dir: str | None
    cluster_name: str | None

    @property
    def key(self) -> str:
        """A name for the job that stays the same when Slurm requeues it."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


def live_jobs(timeout_s: float = 20) -> set[str] | None:
    """Ids of your jobs Slurm still lists (pending, running, completing; array tasks also as
    ``<array job>_<task>``), or None when squeue cannot say."""
    try:
        proc = subprocess.run(
            ["squeue", "--noheader", f"--user={os.getuid()}", "--format=%A %i"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return set(proc.stdout.split())


def term_steps(job_id: str, names: set[str], timeout_s: float = 20) -> None:
    """SIGTERM the job's steps of these names (``scancel --signal=TERM``: their tasks get it, and the
    step ends when they exit; SIGTERM to a step's srun instead kills the step outright)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(
            ["squeue", "--steps", "--noheader", f"--jobs={job_id}", "--format=%i %j"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
        for line in listed.splitlines():
            step_id, _, name = line.strip().partition(" ")
            if name in names:
                subprocess.run(["scancel", "--signal=TERM", step_id], capture_output=True, timeout=timeout_s)


def job_label(environ: Mapping[str, str] | None = None) -> str:
    """The Slurm job id, or "local" outside a job: what metrics are tagged with."""
    job = current(environ)
    return job.job_id if job else "local"


def current(environ: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The enclosing Slurm job, or None outside one."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    return SlurmJob(
        job_id=job_id,
        array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
        array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
        job_name=env.get("SLURM_JOB_NAME"),
        restart_count=_int(env.get("SLURM_RESTART_COUNT")) or 0,
        num_nodes=_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")),
        cpus_on_node=_int(env.get("SLURM_CPUS_ON_NODE")),
        gpus_on_node=_int(env.get("SLURM_GPUS_ON_NODE")),
        mem_per_node_mb=_int(env.get("SLURM_MEM_PER_NODE")),
        submit_host=env.get("SLURM_SUBMIT_HOST"),
        submit_dir=env.get("SLURM_SUBMIT_DIR"),
        cluster_name=env.get("SLURM_CLUSTER_NAME"),
    )
