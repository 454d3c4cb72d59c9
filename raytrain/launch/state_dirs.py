"""Making a job's private directory on shared storage (its Ray token; the head adds cluster.json), and
cleaning up the directories that jobs killed before their own teardown left behind.

The batch script removes its directory as the first step of its teardown, but Slurm SIGKILLs a job
``KillWait`` seconds after SIGTERM and a node can die outright. So each new job removes the directories
of your jobs that Slurm no longer lists on the same cluster (a state dir in a home shared by several
clusters holds jobs of all of them). When squeue cannot answer, nothing is removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from raytrain import private_dirs
from raytrain.contracts.jobdir import (
    CLUSTER,
    CLUSTER_MARK,
    DRIVER_ENDED,
    DRIVERS,
    ELASTIC,
    PREEMPT_FLAG,
    QUEUE,
    READY,
    SERVING,
    TOKEN,
    write_token,
)
from raytrain.errors import UserError


def create(job_dir: Path, cluster: str | None, *, serving: bool = False) -> None:
    """Make JOB_DIR (0700, ours, not a link) hold a fresh token (0600), or raise: the job must not run
    without auth. SERVING: mark it as a serving cluster's."""
    try:
        job_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        private_dirs.ensure(
            job_dir,
            "the job's private directory",
            "the job's token cannot be kept there; set RAYTRAIN_STATE_DIR to a directory only you can read, "
            "on storage every node sees",
        )
        for name in (TOKEN, CLUSTER, PREEMPT_FLAG, CLUSTER_MARK, ELASTIC, SERVING, READY, DRIVER_ENDED):
            (job_dir / name).unlink(missing_ok=True)
        shutil.rmtree(job_dir / DRIVERS, ignore_errors=True)
        shutil.rmtree(job_dir / QUEUE, ignore_errors=True)  # an earlier attempt's tickets
        write_token(job_dir / TOKEN)
        if cluster:
            (job_dir / CLUSTER_MARK).write_text(cluster + "\n")
        if serving:
            (job_dir / SERVING).touch(mode=0o600)
    except OSError as exc:
        raise UserError(
            f"cannot set up token auth in {job_dir} ({exc.strerror or exc}): set RAYTRAIN_STATE_DIR to a "
            "directory you can write, on storage every node sees; the job stops rather than run without auth"
        ) from None


def sweep(state_dir: Path, *, own: str, cluster: str, live: set[str]) -> list[str]:
    """Remove the directories under STATE_DIR of jobs on CLUSTER that are not LIVE; their job ids."""
    removed: list[str] = []
    try:
        entries = sorted(state_dir.iterdir())
    except OSError:
        return removed
    for path in entries:
        if path.name == own or path.name in live or path.is_symlink() or not path.is_dir():
            continue
        try:
            mark = (path / CLUSTER_MARK).read_text().strip()
        except OSError:
            continue  # not a raytrain job directory, or one from before the mark: leave it
        if mark == cluster:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed
