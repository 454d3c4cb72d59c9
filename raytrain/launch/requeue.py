"""Whether a job attempt is requeued when it ends, and requeueing it: the batch script's policy.

The batch script tells what happened (the driver's exit status, a SIGTERM, whether Slurm's time-limit
warning came, whether ``raytrain stop`` asked the job to end, whether it serves); this decides, says why
in one line, and runs ``scontrol requeue`` (bounded in time). The next attempt resumes from the newest
checkpoint under the same run name.

Requeued, at most ``RAYTRAIN_MAX_REQUEUES`` times (Slurm's restart count):
- the driver stopped early with a checkpoint because the job ends soon (exit ``EXIT_PREEMPTED``);
- the cluster failed under the driver (``EXIT_LOST``: a node's Ray died, the driver was killed, worker
  failures ran past ``--max-failures``);
- the driver failed while the job was ending (its checkpoint may have been cut short; the newest intact
  one is resumed from);
- a SIGTERM from Slurm's time limit (its reason is ``TimeLimit``; or, when squeue does not answer in
  time, the warning came first): what the time limit interrupts is requeued, even a checkpoint that
  outlasted the warning's lead or a script that never asked ``ending_soon()``.
Never requeued: a serving cluster (its drivers are told the job ends, and are resubmitted), a job that
``raytrain stop`` or ``scancel`` ended, a driver that completed or failed on its own, or whose run was
cancelled (``raytrain cancel``), even as the job was ending or while it still checkpointed when the time
limit came.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain import slurm_env
from raytrain.contracts import env
from raytrain.contracts.result import EXIT_LOST, EXIT_OK, EXIT_PREEMPTED

TERM_REASON_TIMEOUT_S = 2.0  # squeue's answer to "why SIGTERM?": short, inside Slurm's KillWait
REQUEUE_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Ending:
    """How an attempt ends, as the batch script saw it."""

    on_term: bool  # a SIGTERM ends it
    driver_status: int | None  # the driver's exit status, once it has ended (then it decides, SIGTERM or not)
    warned: bool  # Slurm's time-limit warning (SIGUSR2) came
    stopping: bool  # `raytrain stop` asked the job to end
    serving: bool
    term_reason: str | None = None  # squeue's reason while Slurm ends the job (TimeLimit, None, ...)
    cancelled: bool = False  # the driver's run was cancelled (raytrain cancel): the job ends with it


def why_requeue(ending: Ending) -> str | None:
    """Why the attempt is requeued, or None when it is not (before the cap on restarts)."""
    if ending.serving or ending.stopping or ending.cancelled:
        return None
    status = ending.driver_status
    if ending.on_term and status is None:  # the driver was still at work: what did the SIGTERM interrupt?
        if ending.term_reason == "TimeLimit":
            return "it reached its time limit"
        if ending.term_reason is None and ending.warned:
            return "it reached its time limit (after the warning; squeue did not say)"
        return None
    if status == EXIT_PREEMPTED:
        return "the driver stopped early with a checkpoint"
    if status == EXIT_LOST:
        return "the cluster failed under the driver"
    if status is not None and status != EXIT_OK and ending.warned:
        return f"the driver failed (status {status}) while the job was ending"
    return None


def decide(ending: Ending, restart_count: int, max_requeues: int) -> tuple[bool, str | None]:
    """(requeue?, the line that says why or why not; None when there is nothing to say)."""
    why = why_requeue(ending)
    if why is None:
        return False, None
    if restart_count >= max_requeues:
        return False, (
            f"not requeueing ({why}): the job has restarted {restart_count} times ({env.MAX_REQUEUES.name}="
            f"{max_requeues}); resubmit the same command to resume from the newest checkpoint"
        )
    return True, why


def run(job: slurm_env.SlurmJob, ending: Ending, max_requeues: int) -> tuple[bool, list[str]]:
    """Decide, and requeue when decided: (requeued?, lines to log; errors start with 'error: ')."""
    if ending.on_term and ending.driver_status is None:
        ending = Ending(**{**ending.__dict__, "term_reason": slurm_env.reason(job.job_id, TERM_REASON_TIMEOUT_S)})
    requeue, said = decide(ending, job.restart_count, max_requeues)
    if not requeue:
        return False, [said] if said else []
    failed = slurm_env.requeue(job.job_id, REQUEUE_TIMEOUT_S)
    if failed is not None:
        return False, [f"error: scontrol requeue failed ({failed}): resubmit the same command to resume"]
    return True, [
        f"requeueing job {job.job_id} (restart {job.restart_count + 1} of at most {max_requeues}): {said}; "
        "the next attempt resumes from the newest checkpoint"
    ]
