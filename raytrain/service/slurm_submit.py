"""``raytrain fit --slurm``: size an allocation from what ``sinfo`` reports, submit the batch script, and
follow its log until the first epoch line (Ctrl-C stops following, not the job)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import raytrain
from raytrain import slurm_env, waits
from raytrain.contracts import env
from raytrain.errors import UserError
from raytrain.service.cluster import NodeInfo
from raytrain.service.config import ScaleConfig
from raytrain.service.placement import make_plan

Echo = Callable[[str], None]
FIRST_REPORT = re.compile(r"^(epoch|report) +\d+")


def option_of(sbatch_args: Sequence[str], long: str, short: str | None = None) -> str | None:
    """The value of an sbatch option as given: ``--long=V``, ``--long V``, ``-sV`` or ``-s V`` (the last wins)."""
    found = None
    for i, arg in enumerate(sbatch_args):
        following = sbatch_args[i + 1] if i + 1 < len(sbatch_args) else None
        if arg.startswith(f"{long}="):
            found = arg.split("=", 1)[1]
        elif arg == long or (short is not None and arg == short):
            found = following
        elif short is not None and arg.startswith(short) and not arg.startswith("--"):
            found = arg[len(short) :]
    return found


def partition_of(sbatch_args: Sequence[str]) -> str | None:
    return option_of(sbatch_args, "--partition", "-p")


def signal_lead(sbatch_args: Sequence[str]) -> int:
    """Seconds before the time limit that the job's warning comes: from ``--signal`` when given, else the
    batch script's own (``RAYTRAIN_SIGNAL_LEAD``, its header's value)."""
    given = option_of(sbatch_args, "--signal")
    if given is None:
        return int(env.SIGNAL_LEAD.value())
    try:
        return slurm_env.parse_signal_lead(given)
    except ValueError:
        raise UserError(f"--signal={given} is not an sbatch signal: give e.g. --signal=B:USR2@300") from None


def check_time(sbatch_args: Sequence[str]) -> int:
    """Refuse a ``--time`` the warning comes before (one line, before anything is submitted); the lead."""
    lead = signal_lead(sbatch_args)
    given = option_of(sbatch_args, "--time", "-t")
    if given is not None:
        try:
            limit = slurm_env.parse_time_option(given)
        except ValueError:
            raise UserError(f"--time={given} is not a Slurm time: give e.g. --time=30 or --time=4:00:00") from None
        slurm_env.check_time_limit(limit, lead)
    return lead


def _typical(nodes: Sequence[slurm_env.NodeKind]) -> slurm_env.NodeKind:
    """The most common node shape (a partition is usually homogeneous)."""
    shape, _ = collections.Counter((n.cpus, n.gpus) for n in nodes).most_common(1)[0]
    return slurm_env.NodeKind(name="*", cpus=shape[0], gpus=shape[1])


def size(nodes: Sequence[slurm_env.NodeKind], scale: ScaleConfig, where: str) -> list[str]:
    """sbatch options for an allocation that holds the run ``scale`` asks for, or a UserError."""
    if not nodes:
        raise UserError(f"sinfo shows no usable nodes in {where}: pick a partition with sbatch's --partition")
    node = _typical(nodes)
    gpu = scale.device == "gpu" or (scale.device == "auto" and node.gpus > 0)
    if gpu and node.gpus == 0:
        raise UserError(f"--device gpu, but the nodes of {where} have no GPUs (sinfo): pick a GPU partition")
    if gpu:
        workers = scale.workers or node.gpus
        count = math.ceil(workers / node.gpus)
        per_node = min(node.gpus, workers)
        cpus = max(1, node.cpus * per_node // node.gpus)
        opts = [f"--nodes={count}", f"--gpus-per-node={per_node}", f"--cpus-per-task={cpus}"]
    else:
        workers = scale.workers or 1
        fits = next((n for n in range(1, workers + 1) if _cpu_plan_fits(node, n, scale)), None)
        if fits is None:
            raise UserError(
                f"--cpus-per-worker {scale.cpus_per_worker:g} does not fit on the {node.cpus}-CPU nodes of {where} "
                "with a CPU left for data loading: lower --cpus-per-worker or pick a partition with larger nodes"
            )
        count = fits
        opts = [f"--nodes={count}", "--gpus-per-node=0", f"--cpus-per-task={node.cpus}"]
    if count > len(nodes):
        kind = f"{node.gpus} GPUs" if gpu else f"{node.cpus} CPUs"
        raise UserError(
            f"--workers {workers} needs {count} nodes of {kind}, but {where} has {len(nodes)} usable: "
            f"ask for fewer workers, or pick a larger partition (--partition)"
        )
    return ["--ntasks-per-node=1", *opts]


def _cpu_plan_fits(node: slurm_env.NodeKind, count: int, scale: ScaleConfig) -> bool:
    """Whether the placement plan takes COUNT nodes of this shape: the allocation is sized by the same rules
    that will place the workers in it (a CPU per node left to data loading, CPUs shared when not given)."""
    shape = [NodeInfo(node_id=f"n{i}", hostname=f"n{i}", ip="", cpus=node.cpus, gpus=0) for i in range(count)]
    try:
        make_plan(shape, dataclasses.replace(scale, device="cpu", workers=scale.workers or 1))
    except UserError:
        return False
    return True


def batch_script() -> Path:
    """slurm/ray_cluster.sbatch: beside the package in a source checkout, else where the wheel put it."""
    here = Path(raytrain.__file__).resolve().parents[1] / "slurm" / "ray_cluster.sbatch"
    installed = Path(sys.prefix) / "share" / "raytrain" / "ray_cluster.sbatch"
    for path in (here, installed):
        if path.is_file():
            return path
    raise UserError(f"cannot find the batch script (looked for {here} and {installed}): reinstall raytrain")


def submit(
    fit_args: Sequence[str],
    sbatch_args: Sequence[str],
    scale: ScaleConfig,
    echo: Echo,
    settings: Mapping[str, str] | None = None,
) -> int:
    """Size, submit, print the job id and log, and follow the log to the first epoch line."""
    if job := _inside_job():
        raise UserError(f"--slurm submits a new job, but this runs inside job {job}: drop --slurm")
    lead = check_time(sbatch_args)
    partition = partition_of(sbatch_args)
    where = f"partition {partition}" if partition else "the default partition"
    sizing = size(slurm_env.nodes(partition), scale, where)
    # The job checks its time limit against the lead it was submitted with.
    job_id = slurm_env.sbatch(
        [*sizing, *sbatch_args, str(batch_script()), *fit_args], {env.SIGNAL_LEAD.name: str(lead), **(settings or {})}
    )
    log = slurm_env.stdout_of(job_id) or Path.cwd() / f"raytrain-{job_id}.out"
    echo(f"submitted job {job_id} ({' '.join(sizing)}); log: {log}")
    return follow(job_id, log, echo)


def _inside_job() -> str | None:
    job = slurm_env.current()
    return job.job_id if job else None


_UNDER_WAY = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")


def follow(job_id: str, log: Path, echo: Echo, poll_s: float = 0.5) -> int:
    """Print the job's log as it grows until the first epoch line; 0 then, or the job's failure."""
    offset, pending_said = 0, False
    silent_since: float | None = None

    def step() -> str | None:
        nonlocal offset, pending_said, silent_since
        try:
            state: str | None = slurm_env.job_state(job_id) or "GONE"
            silent_since = None
        except slurm_env.SlurmSilent:  # a busy controller: follow the log meanwhile, for a while
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > slurm_env.LOGIN_TIMEOUT_S:
                raise
            state = None
        if state == "PENDING" and not pending_said:
            echo(f"job {job_id} is pending (squeue -j {job_id} says why); Ctrl-C stops following, not the job")
            pending_said = True
        if log.exists():
            with log.open("rb") as f:
                f.seek(offset)
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                echo(line)
                if FIRST_REPORT.match(line):
                    echo(
                        f"training is under way; the job goes on. Follow it: tail -f {log}; "
                        f"raytrain status {job_id}; raytrain stop {job_id}"
                    )
                    return "training"
        if state is not None and state not in _UNDER_WAY:
            echo(f"job {job_id} ended ({state}) before its first epoch: see {log}")
            return "ended"
        return None

    try:
        return 0 if waits.forever(step, every_s=poll_s) == "training" else 1  # the first epoch, or the job's end
    except KeyboardInterrupt:
        echo(f"stopped following; job {job_id} goes on (log: {log}; raytrain stop {job_id} ends it)")
        return 0
