"""Telling the running training that the job ends soon: Ray's node drain, plus a flag file.

``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` (with a deadline) is what
``ray.train.get_preemption_info()`` reports inside the training loop, but the command is hidden and may
change; the flag file in the job's private directory is read by rank 0 whatever happens to it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from raytrain import slurm_env
from raytrain.contracts.jobdir import PREEMPT_FLAG, SLURM_NODE_LABEL
from raytrain.ray_internals import GcsGone, GcsReader

_MARGIN_S = 20  # left for teardown and requeue after the training has stopped


def write_flag(job_dir: Path, deadline: float) -> Path:
    """Drop the fallback flag (only while the job's private directory exists), with the UNIX time the
    training must have stopped by (``deadline_for``)."""
    flag = job_dir / PREEMPT_FLAG
    tmp = job_dir / f".{PREEMPT_FLAG}.{os.getpid()}"  # then renamed: rank 0 never reads it half-written
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{deadline:.3f}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, flag)
    return flag


def request(address: str, job_dir: Path, nodes: Sequence[str], ray_cmd: Sequence[str], deadline: float) -> str:
    """Drain one node for preemption, or drop the flag if that cannot be done; returns what happened.

    One node, not all: a drained node takes no new work, so draining every node would stop Ray Data from
    scheduling the tasks that feed the next batches, and training would wait for data instead of
    checkpointing. The second node in Slurm order is drained (it hosts ranks right after the head's).
    A one-node job, or a failed drain, gets the flag at once.
    """
    if len(nodes) < 2:
        flag = write_flag(job_dir, deadline)
        return f"one-node job: wrote {flag} for the training to find (draining its only node would stall data)"
    try:
        table = GcsReader(address)
        try:
            alive = table.alive()
        finally:
            table.close()
    except GcsGone as exc:
        flag = write_flag(job_dir, deadline)
        return f"cannot drain {nodes[1]} ({exc}); the training learns of it from {flag}"
    node_ids = [n["NodeID"] for n in alive if (n.get("Labels") or {}).get(SLURM_NODE_LABEL) == nodes[1]]
    deadline_s = max(1, round(deadline - time.time()))
    procs = [
        subprocess.Popen(
            [
                *ray_cmd,
                "drain-node",
                f"--address={address}",
                f"--node-id={node_id}",
                "--reason=DRAIN_NODE_REASON_PREEMPTION",
                "--reason-message=Slurm ends the job soon",
                f"--deadline-remaining-seconds={deadline_s}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node_id in node_ids
    ]
    failed = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            err = "timed out"
        if p.returncode != 0:
            failed.append(((err or "").strip().splitlines() or ["?"])[-1])
    if failed or not procs:
        why = failed[0] if failed else f"{nodes[1]} is not in the cluster"
        flag = write_flag(job_dir, deadline)
        return f"ray drain-node failed ({why}); the training learns of it from {flag}"
    return f"drained {nodes[1]} for preemption (deadline {deadline_s} s)"


def deadline_for(job_id: str | None, lead_s: int, signalled_at: float) -> float:
    """The UNIX time the training must have stopped by: the warning's lead after the signal came
    (``signalled_at``, stamped by the batch script's trap: the helpers start later), or the job's end when
    that is sooner (squeue, bounded; an ``scancel --signal=USR2`` stands for the warning), less a margin
    for teardown and requeue; never sooner than 10 s after the signal."""
    end = signalled_at + lead_s
    left = slurm_env.time_left_s(job_id, timeout_s=5) if job_id else None
    if left is not None:
        end = min(end, time.time() + left)
    return max(signalled_at + 10, end - _MARGIN_S)
