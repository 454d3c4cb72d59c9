"""What Slurm tells a job, read through one small lookup table, and every Slurm command raytrain runs.

This is the only Python module that reads ``SLURM_*`` variables and names a Slurm command; everything else
asks it. Every Slurm command here is bounded in time (a controller that does not answer must not hang a
trap, a teardown or a driver): inside a job, a call that fails or does not answer in time reads as "Slurm
cannot say" (None); on a login node, where a person waits for the answer, it is a one-line UserError.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from raytrain.contracts import env
from raytrain.errors import UserError


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
    node_list: str | None = None  # the allocation's nodes, as a Slurm hostlist ("node[1-3]")

    @property
    def key(self) -> str:
        """A name for the job that stays the same when Slurm requeues it."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


CALL_TIMEOUT_S = 10.0  # the longest any Slurm command may take before it counts as not answering


def _call(argv: list[str], timeout_s: float = CALL_TIMEOUT_S) -> str | None:
    """A Slurm command's output, or None when it fails or does not answer within ``timeout_s``."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout


def live_jobs(timeout_s: float = CALL_TIMEOUT_S) -> set[str] | None:
    """Ids of your jobs Slurm still lists (pending, running, completing, suspended; array tasks also as
    ``<array job>_<task>``), or None when squeue cannot say."""
    out = _call(["squeue", "--noheader", f"--user={os.getuid()}", "--format=%A %i"], timeout_s)
    return None if out is None else set(out.split())


def job_listed(job_key: str, timeout_s: float = CALL_TIMEOUT_S) -> bool | None:
    """Whether Slurm still lists the job (pending, running, suspended, completing), whoever's it is; None
    when squeue cannot say. An ended job is listed no more, or no longer known ("Invalid job id")."""
    try:
        proc = subprocess.run(
            ["squeue", "--noheader", f"--jobs={job_key}", "--format=%T"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode == 0:
        return bool(proc.stdout.strip())
    return False if "Invalid job id" in proc.stderr else None


def job_steps(job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, str] | None:
    """Step id -> step name of the job's running steps, or None when squeue cannot say."""
    out = _call(["squeue", "--steps", "--noheader", f"--jobs={job_id}", "--format=%i %j"], timeout_s)
    if out is None:
        return None
    steps = (line.strip().partition(" ") for line in out.splitlines() if line.strip())
    return {step_id: name for step_id, _, name in steps}


def term_steps(job_id: str, names: Callable[[str], bool], timeout_s: float = CALL_TIMEOUT_S) -> list[str]:
    """SIGTERM the job's steps whose name ``names`` accepts (``scancel --signal=TERM``: their tasks get it,
    and the step ends when they exit; SIGTERM to a step's srun instead kills the step outright); the step
    ids signalled."""
    chosen = [step_id for step_id, name in (job_steps(job_id, timeout_s) or {}).items() if names(name)]
    if not chosen:
        return []
    return chosen if _call(["scancel", "--signal=TERM", *chosen], timeout_s) is not None else []


def allocated_nodes(job: SlurmJob) -> list[str]:
    """The job's nodes in Slurm's order (``scontrol show hostnames``), first the one this runs on, the
    batch script's: its head. A UserError when Slurm cannot say, or when this is not the first node."""
    here = node_name()
    if not job.node_list:
        return [here]
    out = _call(["scontrol", "show", "hostnames", job.node_list])
    names = out.split() if out else []
    if not names:
        raise UserError(f"scontrol cannot expand the job's node list {job.node_list!r}: is slurmctld up?")
    if names[0] != here:
        raise UserError(
            f"the batch script runs on {here}, not on the allocation's first node {names[0]}: "
            "run slurm/ray_cluster.sbatch with sbatch, not as a step of another job"
        )
    return names


class SlurmSilent(UserError):
    """Slurm did not answer (a busy or restarting controller): not the same as "no such job"."""


def job_info(job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, str] | None:
    """``scontrol show job -o JOB`` as fields (JobId, JobState, ArrayJobId, StartTime, ...); None when
    Slurm no longer knows the job ("Invalid job id"); SlurmSilent when it does not answer."""
    argv = ["scontrol", "show", "job", "-o", job_id]
    try:
        proc = subprocess.run([need(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmSilent(f"scontrol did not answer about job {job_id} in {timeout_s:.0f} s: is Slurm up?") from None
    except OSError as exc:  # a host out of processes or memory
        raise SlurmSilent(f"cannot run scontrol ({exc.strerror or exc}): try again") from None
    if proc.returncode == 0 and "JobId=" in proc.stdout:
        return dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)
    if "Invalid job id" in proc.stderr:
        return None
    raise SlurmSilent(f"scontrol could not say about job {job_id} ({_why(proc)}): is Slurm up? Try again")


FINISHED = (
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


def time_limit_s(job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> int | None:
    """The job's time limit in seconds (``squeue %l``); None when unlimited or when squeue cannot say."""
    out = _call(["squeue", "--noheader", f"--jobs={job_id}", "--format=%l"], timeout_s)
    return parse_duration(out) if out else None


def time_left_s(job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> int | None:
    """Seconds until Slurm ends the job (``squeue %L``); None when unlimited or when squeue cannot say."""
    out = _call(["squeue", "--noheader", f"--jobs={job_id}", "--format=%L"], timeout_s)
    return parse_duration(out) if out else None


def reason(job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> str | None:
    """Slurm's reason for the job's state (``squeue %r``): ``TimeLimit`` while Slurm ends it at its time
    limit, ``None`` (the word) after an ``scancel``; None when squeue cannot say."""
    out = _call(["squeue", "--noheader", f"--jobs={job_id}", "--format=%r"], timeout_s)
    if out is None or not out.strip():
        return None
    return out.strip()


def requeue(job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> str | None:
    """``scontrol requeue JOB`` (allowed while the job runs or is being ended at its time limit): None when
    it worked, else why not."""
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"scontrol did not answer within {timeout_s:.0f} s"
    except OSError as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit status {proc.returncode}")


_DURATION = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def parse_duration(text: str) -> int | None:
    """A Slurm time (``--time``, ``squeue %l``/``%L``) in seconds: ``M``, ``M:S``, ``H:M:S``, ``D-H``,
    ``D-H:M``, ``D-H:M:S``; None for ``UNLIMITED``/``INFINITE``/``NOT_SET``. ValueError if it is none."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "NOT_SET", "N/A"):
        return None
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a Slurm time")
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    assert a is not None
    if days is not None:  # D-H, D-H:M, D-H:M:S
        return ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return (a * 60 + (b or 0)) * 60 + c
    if b is not None:  # M:S
        return a * 60 + b
    return a * 60  # M


def parse_time_option(text: str) -> int | None:
    """A ``--time`` as Slurm applies it, in seconds: ``parse_duration``'s, rounded up to a whole minute (Slurm
    keeps time limits in minutes and rounds seconds up: ``--time=1:30`` is a 2-minute limit); None for no
    limit (``UNLIMITED``, or ``0``, which asks Slurm for none)."""
    seconds = parse_duration(text)
    return -(-seconds // 60) * 60 if seconds else None


def clock(seconds: int) -> str:
    """Seconds as Slurm writes a time: ``4:00`` (M:SS), ``1:00:00``, ``1-00:00:00``."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


SIGNAL_EARLY_S = 60  # Slurm checks time limits periodically: a --signal can come up to a minute before its time


def check_time_limit(limit_s: int | None, lead_s: int) -> None:
    """Refuse a time limit the time-limit warning could come before training starts: every attempt would be
    told it ends before it trained, and requeue without training until the cap. None: unlimited, unknown."""
    least = lead_s + SIGNAL_EARLY_S
    if limit_s is not None and limit_s <= least:
        raise UserError(
            f"the job's time limit ({clock(limit_s)}) leaves no time to train before the warning that comes "
            f"{lead_s} s before it (--signal=B:USR2@{lead_s}; Slurm may send it up to {SIGNAL_EARLY_S} s earlier): "
            f"ask for a --time longer than {clock(least)} plus start-up, or a shorter --signal=B:USR2@N with "
            f"{env.SIGNAL_LEAD.name}=N"
        )


def parse_signal_lead(spec: str) -> int:
    """Seconds before the time limit that ``--signal=[{R|B}:]SIG[@TIME]`` fires (Slurm: 60 without @TIME).
    ValueError if it is not such a spec."""
    m = re.fullmatch(r"(?:[RB]+:)?[A-Za-z0-9]+(?:@(\d+))?", spec.strip())
    if not m:
        raise ValueError(f"{spec!r} is not an sbatch --signal")
    return int(m.group(1)) if m.group(1) else 60


SRUN = "srun"  # what starts a step (and, with the Pyxis plugin, a container)
NODE_NAME = "SLURMD_NODENAME"  # the node a step runs on, as Slurm names it
VARIABLES = ("SLURM_*", NODE_NAME)  # every variable Slurm sets for a job's processes (a * is a prefix)


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """The Slurm node this runs on (``SLURMD_NODENAME``), else the host's name."""
    return (os.environ if environ is None else environ).get(NODE_NAME) or socket.gethostname()


def gpu_indices(environ: Mapping[str, str] | None = None) -> list[str]:
    """The node's GPUs Slurm gave this step, by their index on the node; outside a step (the batch script)
    the job's. Empty when Slurm names none (a count only, or no GPUs). A step never reads the job's: srun
    copies SLURM_JOB_GPUS from the batch script, where it names the first node's GPUs, not this one's."""
    env = os.environ if environ is None else environ
    ids = env.get("SLURM_STEP_GPUS") if "SLURM_STEP_ID" in env else env.get("SLURM_JOB_GPUS")
    listed = [i.strip() for i in (ids or "").split(",")]
    return listed if all(i.isdigit() for i in listed) else []


def srun_takes(option: str) -> bool:
    """srun here takes OPTION (a SPANK plugin's, such as Pyxis's --container-image, shows in its help)."""
    out = _call([SRUN, "--help"])
    return out is not None and option in out


def srun_step(
    *,
    node: str,
    name: str,
    argv: Sequence[str],
    job_id: str | None = None,
    output: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``srun`` running ARGV as a step named NAME on NODE of this job (or of ``job_id``, from a login node:
    then Ctrl-C ends the step and the caller's environment goes with it). ``--overlap``: other steps share
    the node; ``--whole``: the step sees every CPU and GPU the job has there. OUTPUT: appended to. EXTRA:
    more srun options (a container's, under Pyxis)."""
    cmd = [need("srun") if job_id else "srun"]
    cmd += [f"--jobid={job_id}", "--quit-on-interrupt", "--export=ALL"] if job_id else []
    cmd += ["--nodes=1", "--ntasks=1", f"--nodelist={node}", "--whole", "--overlap", f"--job-name={name}"]
    cmd += [f"--output={output}", "--open-mode=append"] if output is not None else []
    return [*cmd, *extra, *argv]


def srun_on_each(nodes: Sequence[str], *, name: str, argv: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """``srun`` running ARGV once on each of NODES of this job, as one step named NAME (``--overlap``)."""
    count = len(nodes)
    cmd = ["srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}"]
    return [*cmd, "--overlap", f"--job-name={name}", *extra, *argv]


# From a login node: a person waits for these, so a failure is a one-line error rather than "cannot say".

LOGIN_TIMEOUT_S = CALL_TIMEOUT_S * 6  # sbatch and sinfo on a busy controller


def need(tool: str) -> str:
    """The path of a Slurm command, or a UserError saying where to run this."""
    path = shutil.which(tool)
    if path is None:
        raise UserError(f"{tool} not found: run this on a Slurm login node (or put Slurm's commands on PATH)")
    return path


def _answer(
    argv: Sequence[str], extra_env: Mapping[str, str] | None, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **extra_env} if extra_env else None
    try:
        return subprocess.run(
            [need(argv[0]), *argv[1:]], capture_output=True, text=True, env=environ, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"{argv[0]} did not answer within {timeout_s:.0f} s: is Slurm up?") from None


def _why(proc: subprocess.CompletedProcess[str]) -> str:
    err = proc.stderr.strip()
    return err.splitlines()[-1] if err else f"exit status {proc.returncode}"


@dataclass(frozen=True)
class NodeKind:
    name: str
    cpus: int
    gpus: int


def gres_gpus(gres: str) -> int:
    """GPUs in a GRES field (``sinfo %G``): ``gpu:4``, ``gpu:a100:4(S:0-1)``, ``gpu:2,shard:8``, ``(null)``."""
    return sum(_int(item) or 0 for item in gres.split(",") if item.startswith("gpu:"))


_UNUSABLE = ("down", "drain", "fail", "maint", "inval", "unk", "reboot", "power", "futur")


def parse_sinfo(text: str, partition: str | None) -> list[NodeKind]:
    """Usable nodes of the partition (the default one, marked ``*``, when None) from
    ``sinfo --noheader --Node --format=%N|%c|%G|%T|%P``."""
    nodes: dict[str, NodeKind] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, cpus, gres, state, part = fields
        default = part.endswith("*")
        if (partition is None and not default) or (partition is not None and part.rstrip("*") != partition):
            continue
        if state.lower().startswith(_UNUSABLE):
            continue
        nodes[name] = NodeKind(name=name, cpus=int(cpus), gpus=gres_gpus(gres))
    return list(nodes.values())


def nodes(partition: str | None) -> list[NodeKind]:
    """The partition's usable nodes, as ``sinfo`` lists them."""
    info = _answer(["sinfo", "--noheader", "--Node", "--format=%N|%c|%G|%T|%P"], None, LOGIN_TIMEOUT_S)
    if info.returncode != 0:
        raise UserError(f"sinfo failed ({_why(info)}): check the Slurm client on this host")
    return parse_sinfo(info.stdout, partition)


def sbatch(args: Sequence[str], extra_env: Mapping[str, str]) -> str:
    """Submit ``sbatch ARGS`` (with ``extra_env`` added to this environment); the new job's id."""
    proc = _answer(["sbatch", "--parsable", *args], extra_env, LOGIN_TIMEOUT_S)
    if proc.returncode != 0:
        raise UserError(f"sbatch refused the job: {_why(proc)}")
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str) -> str | None:
    """Slurm's state of a job (RUNNING, COMPLETED, ...), or None once Slurm no longer knows it (SlurmSilent
    when it does not answer)."""
    info = job_info(job_id)
    return info.get("JobState") if info else None


def stdout_of(job_id: str) -> Path | None:
    """Where a job's batch output goes (``StdOut``), when Slurm says."""
    try:
        info = job_info(job_id, LOGIN_TIMEOUT_S)
    except SlurmSilent:
        return None
    return Path(info["StdOut"]) if info and info.get("StdOut") else None


def signal_batch(job_id: str, signal_name: str) -> None:
    """Send SIGNAL_NAME to the job's batch script only (``scancel --batch``), or a UserError."""
    proc = _answer(["scancel", "--batch", f"--signal={signal_name}", job_id], None, CALL_TIMEOUT_S)
    if proc.returncode != 0:
        raise UserError(f"scancel could not signal job {job_id}: {_why(proc)}")


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
        node_list=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
    )
