"""A running job's cluster, from the login node: ``raytrain submit``, ``status``, ``cancel`` and ``stop``.

Everything goes through Slurm itself, so only the job's owner can use the cluster: drivers and the status
probe run in steps of the job on its head node (``srun --jobid=JOB --overlap``), and a stop is a signal to
the job's batch script (``scancel --batch --signal=USR1``).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from raytrain import slurm_env, waits
from raytrain.contracts import env, jobdir
from raytrain.contracts.jobdir import EndRequest, Priority, Ticket
from raytrain.errors import UserError
from raytrain.service.dashboard import cluster_of


def _on_head(job_id: str, step_name: str, argv: Sequence[str]) -> list[str]:
    """srun a command in a step of JOB_ID on its head node, sharing the job's resources."""
    return slurm_env.srun_step(node=cluster_of(job_id).head_node, name=step_name, argv=argv, job_id=job_id)


Echo = Callable[[str], None]
NOT_RAYTRAIN_AFTER_S = 120.0  # a running job with no raytrain directory by then is not a raytrain cluster
_POLL_S = 1.0
SLURM_SILENCE_S = 300.0  # a wait for a job gives up after Slurm's controller has not answered for this long
CANCEL_SLACK_S = 60.0  # beyond its grace, for a cancelled run's controller to stop its workers and go


def checked_id(job_id: str) -> str:
    """JOB_ID as a plain Slurm job id, or a UserError (an array task, a path, anything else)."""
    if re.fullmatch(r"\d+", job_id):
        return job_id
    if re.fullmatch(r"\d+_\d+", job_id):
        info = None
        with contextlib.suppress(slurm_env.SlurmSilent):  # the id's shape is wrong either way
            info = slurm_env.job_info(job_id)
        own = f" ({job_id} is job {info['JobId']})" if info and info.get("JobId") else ""
        raise UserError(
            f"{job_id} is a task of a job array: give the task's own job id{own}, as squeue -j {job_id} -o %A prints it"
        )
    raise UserError(f"{job_id!r} is not a Slurm job id: give the number sbatch printed (squeue --me lists your jobs)")


def _state(job_id: str) -> str:
    info = slurm_env.job_info(job_id)
    if info is None:
        raise UserError(f"Slurm knows no job {job_id}: check the id with squeue --me")
    owner = re.fullmatch(r"(.*)\((\d+)\)", info.get("UserId", ""))
    if owner and int(owner[2]) != os.getuid():
        raise UserError(
            f"job {job_id} is {owner[1]}'s, not yours: raytrain reaches the clusters of your own jobs only "
            "(squeue --me lists them)"
        )
    state = info.get("JobState", "UNKNOWN")
    if state.startswith(slurm_env.FINISHED):
        raise UserError(
            f"job {job_id} has ended ({state}): start a serving cluster with "
            "sbatch [options] slurm/ray_cluster.sbatch --serve, and submit to its job id"
        )
    return state


def running_cluster(job_id: str) -> Path:
    """The private directory of a running raytrain cluster of job JOB_ID, or a UserError that says why not."""
    job_id = checked_id(job_id)
    state = _state(job_id)
    directory = jobdir.job_dir(job_id)
    if not (directory / jobdir.CLUSTER).exists():
        raise UserError(
            f"job {job_id} is {state.lower()} and has no raytrain cluster up in {directory.parent}: wait until it "
            "runs (raytrain submit waits), check RAYTRAIN_STATE_DIR if the job set it, or squeue --me"
        )
    return directory


def wait_for_cluster(job_id: str, echo: Echo, *, wait: bool = True, serving: bool = False) -> Path:
    """The job's private directory once every node of its cluster has joined; while the job is pending or
    booting, a line and a wait (``wait`` False: a UserError at once). Ends with the job. ``serving``: a
    UserError as soon as its cluster shows it does not serve drivers from ``raytrain submit``."""
    directory = jobdir.job_dir(job_id)
    said = None
    first_running: float | None = None
    silent_since: float | None = None

    def ready() -> Path | None:
        nonlocal said, first_running, silent_since
        try:
            state = _state(job_id)
            silent_since = None
        except slurm_env.SlurmSilent:  # a busy controller: the job's own files still tell when it is up
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > SLURM_SILENCE_S:
                raise UserError(
                    f"Slurm's controller has not answered for {SLURM_SILENCE_S:.0f} s while waiting for job "
                    f"{job_id}: check it with squeue, then submit again (the job is left as it is)"
                ) from None
            state = "UNKNOWN"
        if serving and (directory / jobdir.CLUSTER).exists() and not (directory / jobdir.SERVING).exists():
            raise UserError(
                f"job {job_id} runs a driver of its own (it was not started with --serve): submit to a serving "
                "cluster (sbatch [options] slurm/ray_cluster.sbatch --serve), or watch this one with raytrain status"
            )
        if (directory / jobdir.READY).exists() and (directory / jobdir.CLUSTER).exists():
            return directory
        if state == "RUNNING":
            first_running = first_running or time.monotonic()
            if not directory.exists() and time.monotonic() - first_running > NOT_RAYTRAIN_AFTER_S:
                raise UserError(
                    f"job {job_id} has run for {NOT_RAYTRAIN_AFTER_S:.0f} s without a raytrain directory in "
                    f"{directory.parent}: it is not a raytrain cluster (or set another RAYTRAIN_STATE_DIR)"
                )
        phase = {
            "PENDING": f"pending (squeue -j {job_id} says why)",
            "UNKNOWN": "in a state Slurm's controller does not say (it does not answer)",
        }.get(state, "starting its cluster")
        if not wait:
            raise UserError(f"job {job_id} is {phase}: submit again once it serves, or without --no-wait to wait")
        if phase != said:
            echo(f"job {job_id} is {phase}; waiting for it (Ctrl-C stops waiting, not the job)")
            said = phase
        return None

    return waits.forever(ready, every_s=_POLL_S)  # ends with the job: _state raises once it has ended


def submit(
    job_id: str, argv: Sequence[str], *, wait: bool = True, priority: Priority = "normal", echo: Echo = print
) -> int:
    """Run a driver (``fit ...`` or any command) on the job's serving cluster, once it is up; its output
    streams here; its exit status is returned. Its runs wait their turn by ``priority``."""
    job_id = checked_id(job_id)
    if not argv:
        raise UserError(f"nothing to run: raytrain submit {job_id} -- fit ... (or -- python train.py ...)")
    directory = wait_for_cluster(job_id, echo, wait=wait, serving=True)
    cmd = _on_head(
        job_id,
        jobdir.DRIVER_STEP,
        [sys.executable, "-m", "raytrain.launch", "exec", "--job-dir", str(directory), "--", *argv],
    )
    environ = {k: v for k, v in os.environ.items() if k != env.BATCH_DRIVER.name}  # the job does not end with it
    return subprocess.run(cmd, env={**environ, env.PRIORITY.name: priority}).returncode


def cancel(job_id: str, run: str, *, grace_s: float, echo: Echo = print) -> None:
    """End the run named RUN on the job's cluster: a waiting run at once; a running one checkpoints at its
    training's next ``ending_soon()`` check and ends, or is stopped once ``grace_s`` has passed. Returns once
    it has ended (a UserError if it has not, a minute after that)."""
    queue = running_cluster(job_id) / jobdir.QUEUE
    deadline = time.time() + grace_s
    by = f"{getpass.getuser()} with raytrain cancel"
    said: set[int] = set()

    def ended() -> bool:
        # Every run of that name is asked (several drivers may run one of that name, each its own ticket).
        mine = [t for t in Ticket.read_all(queue) if t.run == run]
        for ticket in mine:
            asked = EndRequest.read(queue / ticket.request_file)
            if asked is None or asked.why != jobdir.CANCEL:
                EndRequest(why=jobdir.CANCEL, by=by, deadline=deadline, at=time.time()).write(
                    queue, ticket.request_file
                )
            if ticket.seq not in said:
                said.add(ticket.seq)
                how = (
                    "at once" if ticket.phase == "waiting" else f"at its next check, stopped in {grace_s:.0f} s if not"
                )
                echo(
                    f"run {run!r} ({ticket.phase}, driver pid {ticket.driver_pid} on {ticket.host}): asked to end {how}"
                )
        return not mine

    if not any(t.run == run for t in Ticket.read_all(queue)):
        raise UserError(
            f"job {job_id} has no run named {run!r} running or waiting: raytrain status {job_id} lists them"
        )
    if waits.until(ended, timeout_s=grace_s + CANCEL_SLACK_S, every_s=_POLL_S) is None:
        raise UserError(
            f"run {run!r} still holds its place {grace_s + CANCEL_SLACK_S:.0f} s after the cancel: its driver may have "
            f"died without a word (raytrain status {job_id} shows it); raytrain stop {job_id} ends every run"
        )
    echo(f"run {run!r}: ended")


def status(job_id: str) -> int:
    directory = running_cluster(job_id)
    cmd = _on_head(
        job_id, "raytrain-status", [sys.executable, "-m", "raytrain.launch", "status", "--job-dir", str(directory)]
    )
    return subprocess.run(cmd).returncode


def stop(job_id: str, timeout_s: float = 60) -> str:
    """Ask the job's batch script to end the job, and wait until it has: returns the job's final state."""
    running_cluster(job_id)  # a clear error if it is not a running raytrain cluster of ours
    slurm_env.signal_batch(job_id, "USR1")

    def ended() -> str | None:
        try:
            state = slurm_env.job_state(job_id)
        except slurm_env.SlurmSilent:
            return None  # a busy controller: ask again, until the deadline
        return (state or "gone") if state is None or state.startswith(slurm_env.FINISHED) else None

    if (state := waits.until(ended, timeout_s=timeout_s, every_s=0.5)) is not None:
        return state
    try:
        now = slurm_env.job_state(job_id) or "gone"
    except slurm_env.SlurmSilent:
        now = "in a state Slurm does not say"
    raise UserError(
        f"job {job_id} is still {now} {timeout_s:.0f} s after the stop request: "
        f"see its log, or cancel it with scancel {job_id}"
    )
