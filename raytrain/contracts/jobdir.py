"""A Slurm job's private directory and what the job's processes find in it.

The batch script makes ``<state dir>/<job id>/`` (0700, on storage every node sees) before any Ray
process starts; the node supervisors, the drivers, ``raytrain submit/status/stop/dashboard`` on the login
node and the training workers all locate the job through the names below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from raytrain.contracts import env

TOKEN = "token"  # the job's Ray auth token (0600)
CLUSTER = "cluster.json"  # how to reach the head: written by the head's supervisor, see ClusterFile
CLUSTER_MARK = "slurm-cluster"  # the name of the Slurm cluster the job runs on
PREEMPT_FLAG = "preempt"  # the job ends soon: the fallback to Ray's drain, read by training's rank 0
# (its text: the UNIX time by which the training must have stopped, or empty when Slurm could not say)
DRIVERS = "drivers"  # one <pid>.json per driver running on the cluster (``raytrain status``)
ELASTIC = "elastic"  # while the job's driver trains elastically: a worker node's loss does not stop it
SERVING = "serving"  # the job serves (`--serve`): drivers come from `raytrain submit`
READY = "ready"  # every node of the job's cluster has joined: drivers may start
QUEUE = "queue"  # runs waiting for what they ask for to be free: raytrain.contracts.jobdir.Ticket each
CONTAINER = "container.json"  # the image the job runs in: raytrain.launch.container.Container, from setup
DRIVER_ENDED = "driver-ended"  # the batch script's own driver ended on request (raytrain cancel): its status

# In each attempt's log directory (shared storage), with RAYTRAIN_PROMETHEUS: the job's Prometheus.
PROMETHEUS_CONFIG = "prometheus.yml"  # its configuration: a site's Prometheus can take its scrape job
PROMETHEUS_DATA = "prometheus"  # its time series, kept after the job (prometheus --storage.tsdb.path)
PROMETHEUS_LOG = "prometheus.log"

# The Ray node label every node of a job carries: its Slurm node name.
SLURM_NODE_LABEL = "raytrain.io/slurm-node"
# Ray's own per-node label, used to pin a rank to its planned node.
NODE_ID_LABEL = "ray.io/node-id"

# Slurm step names: the teardown stops these steps of its job, and nothing else.
RAY_STEP_PREFIX = "ray-"  # ray-head-<node>, ray-worker-<node>
DRIVER_STEP = "raytrain-driver"  # a driver started by `raytrain submit`


def note_driver_ended(status: int) -> None:
    """In the batch script's own driver (``RAYTRAIN_BATCH_DRIVER``), ending on request with STATUS (a status
    above 128 that a killed driver would also exit with): say so, so that the job ends with it and does not
    take it for the cluster failing under the driver."""
    if env.BATCH_DRIVER.get() == "1" and (directory := env.JOB_DIR.get()):
        with contextlib.suppress(OSError):  # the job is ending and took its directory with it
            (Path(directory) / DRIVER_ENDED).write_text(f"{status}\n")


def driver_ended(job_dir: Path, status: int) -> bool:
    """Whether the batch script's driver said it ended on request with STATUS."""
    try:
        return (job_dir / DRIVER_ENDED).read_text().strip() == str(status)
    except OSError:
        return False


def write_token(path: Path) -> None:
    """Create a new random Ray token readable by its owner only; the directory must already be private."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def state_dir() -> Path:
    """Where every job keeps its private directory: ``RAYTRAIN_STATE_DIR``, else ``~/.raytrain/jobs``."""
    configured = env.STATE_DIR.get()
    return Path(configured).expanduser() if configured else Path.home() / ".raytrain" / "jobs"


def job_dir(job_id: str) -> Path:
    return state_dir() / job_id


@dataclass(frozen=True, kw_only=True)
class ClusterFile:
    """``cluster.json``: how drivers, workers and the login node reach a job's Ray head. Written (0600)
    by the head's supervisor before Ray starts; it exists while the job runs."""

    head_node: str
    head_ip: str
    gcs_address: str
    dashboard_port: int
    ports: dict[str, int]
    token_path: str
    log_dir: str
    job_id: str | None
    submit_host: str | None
    started: float
    prometheus_port: int | None = None  # the job's Prometheus on the head's loopback, when it runs one

    def write(self, job_dir: Path) -> None:
        """Atomically, readable by the owner only."""
        tmp = job_dir / f".{CLUSTER}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
        tmp.replace(job_dir / CLUSTER)

    @classmethod
    def read(cls, job_dir: Path) -> ClusterFile:
        """Raises FileNotFoundError while the head has not written it (or after the job ended)."""
        raw = json.loads((job_dir / CLUSTER).read_text())
        return cls(**{f.name: raw.get(f.name) for f in dataclasses.fields(cls)})

    @property
    def dashboard_url(self) -> str:
        """The dashboard as seen from the head (it listens on the head's loopback only)."""
        return f"http://127.0.0.1:{self.dashboard_port}"


Phase = Literal["waiting", "placing", "running"]
# How a run on a serving cluster ranks against the others (``raytrain submit --priority``): a higher one is
# admitted first, and one that does not fit asks running runs of lower priority to end soon.
Priority = Literal["low", "normal", "high"]
PRIORITIES: tuple[Priority, ...] = get_args(Priority)  # lowest first


def rank_of(priority: str) -> int:
    return PRIORITIES.index(priority)


@dataclass(frozen=True, kw_only=True)
class Ticket:
    """A run's place in the job's queue (``queue/<seq>.json``), for the run's whole life: ``waiting`` for
    its turn, ``placing`` its workers (admitted, or restarting them after a failure: nobody else is admitted
    meanwhile, as the resources it is about to take still look free), ``running``. Removed when it ends."""

    seq: int  # time of arrival (ns): the order runs are admitted in
    run: str  # the run's name
    cluster: str  # the Ray cluster (its GCS address) it was taken on: tickets of an earlier attempt are dropped
    ray_job: str  # the Ray job (driver) it belongs to: a ticket of a dead driver is dropped
    driver_pid: int
    host: str
    workers: int  # what it asks for: this many workers (at least; elastic) of per_worker each
    per_worker: dict[str, float]
    since: float
    phase: Phase = "waiting"
    # The Ray actor that runs its driver, when that is an actor (a sweep's trial): dropped once it is dead,
    # which ending its Ray job does not tell (the sweep's driver lives on).
    actor: str | None = None
    priority: Priority = "normal"
    # Whether it can yield its room to a run of higher priority: its driver (raytrain's) queues it again and
    # resumes it. A script's trainer cannot: it is never asked.
    yields: bool = False
    why: str | None = None  # what a waiting run waits for, as its driver last said it
    batch: bool = False  # the batch script's own driver holds it (RAYTRAIN_BATCH_DRIVER): the job ends with it

    @property
    def order(self) -> tuple[int, int]:
        """The admission order: higher priority first, then first come first (a run that yielded its room
        keeps its ticket, so its place, while it waits to resume)."""
        return (-rank_of(self.priority), self.seq)

    @property
    def file_name(self) -> str:
        return f"{self.seq}.json"

    def write(self, queue: Path) -> None:
        tmp = queue / f".{self.file_name}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        tmp.replace(queue / self.file_name)

    @classmethod
    def read_all(cls, queue: Path) -> list[Ticket]:
        """The queue, first come first, skipping files that vanish or do not parse meanwhile."""
        found = []
        for path in queue.glob("*.json"):
            try:
                raw = json.loads(path.read_text())
                found.append(cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}))
            except (OSError, ValueError, TypeError, KeyError):
                continue
        return sorted(found, key=lambda t: t.seq)

    def describe(self) -> str:
        need = ", ".join(f"{v:g} {k}" for k, v in sorted(self.per_worker.items()) if v)
        return (
            f"run {self.run!r} (priority {self.priority}, driver pid {self.driver_pid} on {self.host}): "
            f"{self.workers} worker(s) of {need}"
        )

    @property
    def request_file(self) -> str:
        return request_name(self.ray_job, self.run)

    def held_by(self, ray_job: str, run: str) -> bool:
        """Whether it is this process's ticket for the run named RUN of Ray job RAY_JOB."""
        return (self.ray_job, self.run, self.driver_pid) == (ray_job, run, os.getpid())


def batch_run_cancelled(job_dir: Path) -> bool:
    """Whether ``raytrain cancel`` asked a run of the batch script's own driver to end, the driver not done
    yet (its ticket goes when it ends): a SIGTERM from the time limit can find it still checkpointing."""
    queue = job_dir / QUEUE
    for ticket in Ticket.read_all(queue) if queue.is_dir() else []:
        asked = EndRequest.read(queue / ticket.request_file) if ticket.batch else None
        if asked is not None and asked.why == CANCEL:
            return True
    return False


def request_name(ray_job: str, run: str) -> str:
    """The file in the queue by which a run is asked to end (``EndRequest``): named by what its training
    workers know of themselves (their Ray job and their run's name), so that rank 0 can look for it."""
    return f"{ray_job}-{hashlib.sha256(run.encode()).hexdigest()[:16]}.end"


EndWhy = Literal["yield", "cancel"]
YIELD: EndWhy = "yield"  # to a run of higher priority: it queues again and resumes when room returns
CANCEL: EndWhy = "cancel"  # by raytrain cancel: it ends


@dataclass(frozen=True, kw_only=True)
class EndRequest:
    """``queue/<request_name>``: a run is asked to end soon, by a higher-priority run that waits for its room
    (``yield``: it checkpoints, queues again and resumes when room returns) or by ``raytrain cancel``
    (``cancel``: it checkpoints and ends; a run that waits ends at once). Its training learns of it through
    ``raytrain.ending_soon()``, as of a preemption; the deadline is the UNIX time it should have stopped by."""

    why: EndWhy
    by: str  # who asked, for the lines that say so
    deadline: float
    at: float
    asker: int | None = None  # the ticket (seq) of the run that asked it to yield: withdrawn once that one goes

    def write(self, queue: Path, name: str) -> None:
        tmp = queue / f".{name}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        tmp.replace(queue / name)

    @classmethod
    def read(cls, path: Path | str) -> EndRequest | None:
        """The request at PATH, or None if there is none (or it vanished, or does not parse)."""
        try:
            raw = json.loads(Path(path).read_text())
            return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})
        except (OSError, ValueError, TypeError, KeyError):
            return None
