"""Every environment variable raytrain reads or sets: name, default and meaning, in one table.

Three kinds: *settings* a user may export before ``sbatch`` (the batch script's header lists exactly
these; a test keeps the two in step), *job* variables raytrain sets for the processes of a job so they
can find each other, and *Ray's own* variables raytrain sets on Ray's behalf. Code reads a variable
through its entry here (``JOIN_TIMEOUT.get()``), never by a bare name.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from raytrain.errors import UserError

Kind = Literal["setting", "job", "ray", "tool"]
LARGEST = 1e9  # no numeric setting means more (seconds: 31 years); inf or 1e300 would overflow a wait


@dataclass(frozen=True)
class Var:
    """One environment variable. ``default`` is the value used when it is unset (None: no value, or one
    computed at run time as ``shown`` describes). A numeric setting names its type and least value."""

    name: str
    kind: Kind
    meaning: str
    default: str | None = None
    shown: str | None = None  # the default as the batch script's header documents it
    number: type[int] | type[float] | None = None
    least: float | None = None

    def get(self, env: Mapping[str, str] | None = None) -> str | None:
        """The value, or the default; an empty value counts as unset."""
        value = (os.environ if env is None else env).get(self.name)
        return value if value else self.default

    def value(self, env: Mapping[str, str] | None = None) -> float:
        """A numeric setting's value (or default), checked: a UserError that names the variable otherwise."""
        assert self.number is not None, f"{self.name} is not numeric"
        raw = self.require(env)
        kind = "a whole number" if self.number is int else "a number"
        try:
            parsed = self.number(raw)
        except ValueError:
            raise UserError(f"{self.name}={raw!r} is not {kind}: {self.hint(kind)}") from None
        if not math.isfinite(parsed) or parsed > LARGEST:
            raise UserError(f"{self.name}={raw} is too large: {self.hint(kind)}")
        if self.least is not None and not parsed >= self.least:
            raise UserError(f"{self.name}={raw} is below {self.least:g}: {self.hint(kind)}")
        return parsed

    def hint(self, kind: str) -> str:
        least = f" of at least {self.least:g}" if self.least is not None else ""
        return f"give {kind}{least} ({self.meaning}; default {self.default}), or unset it"

    def require(self, env: Mapping[str, str] | None = None) -> str:
        value = self.get(env)
        if value is None:
            raise KeyError(f"{self.name} is not set")
        return value

    @property
    def documented_default(self) -> str:
        return self.shown if self.shown is not None else (self.default or "")


TABLE: list[Var] = []


def _var(
    name: str,
    kind: Kind,
    meaning: str,
    default: str | None = None,
    shown: str | None = None,
    *,
    number: type[int] | type[float] | None = None,
    least: float | None = None,
) -> Var:
    var = Var(name=name, kind=kind, meaning=meaning, default=default, shown=shown, number=number, least=least)
    TABLE.append(var)
    return var


# --- settings: what a user may export before sbatch (documented in slurm/ray_cluster.sbatch) ---------
PYTHON = _var("RAYTRAIN_PYTHON", "setting", "interpreter with raytrain installed", "python3", "python3 on PATH")
IFNAME = _var(
    "RAYTRAIN_IFNAME", "setting", "interface for Ray, NCCL and Gloo traffic", shown="the one that routes to the head"
)
HEAD_IP = _var("RAYTRAIN_HEAD_IP", "setting", "the head's address", shown="what its Slurm node name resolves to")
JOIN_TIMEOUT = _var("RAYTRAIN_JOIN_TIMEOUT", "setting", "seconds for every node to join", "180", number=float, least=1)
LOG_DIR = _var(
    "RAYTRAIN_LOG_DIR", "setting", "logs go to <this>/<job id>/attempt-<n>/", shown="$SLURM_SUBMIT_DIR/raytrain-logs"
)
STATE_DIR = _var(
    "RAYTRAIN_STATE_DIR", "setting", "private per-job dirs (token, cluster.json)", shown="~/.raytrain/jobs"
)
TMPDIR = _var("RAYTRAIN_TMPDIR", "setting", "node-local parent of Ray's temp dir", "/tmp")
PORT_BASE = _var(
    "RAYTRAIN_PORT_BASE", "setting", "first port of the per-job port blocks", "20000", number=int, least=1024
)
PORT_BLOCK = _var("RAYTRAIN_PORT_BLOCK", "setting", "ports per block", "500", number=int, least=1)
PORT_BLOCKS = _var("RAYTRAIN_PORT_BLOCKS", "setting", "blocks, claimed per node with a lock", "25", number=int, least=1)
MAX_REQUEUES = _var(
    "RAYTRAIN_MAX_REQUEUES", "setting", "requeues after a time limit or a lost node", "3", number=int, least=0
)
SIGNAL_LEAD = _var(
    "RAYTRAIN_SIGNAL_LEAD",
    "setting",
    "seconds the time-limit warning comes early (--signal=B:USR2@N)",
    "300",
    number=int,
    least=1,
)
RAY_BIN = _var(
    "RAYTRAIN_RAY_BIN",
    "setting",
    "command that runs Ray's CLI (a wrapper; with a container, the image runs it)",
    shown="$RAYTRAIN_PYTHON -m ray.scripts.scripts",
)
STOP_GRACE = _var(
    "RAYTRAIN_STOP_GRACE", "setting", "seconds a node's Ray gets to stop before SIGKILL", "3", number=float, least=0
)
REJOIN_EVERY = _var(
    "RAYTRAIN_REJOIN_EVERY",
    "setting",
    "elastic: most seconds between tries to start a lost node's Ray again",
    "30",
    number=float,
    least=3,  # a node that is down gets an srun (and a container start) this often
)
ELASTIC_CHECK = _var(
    "RAYTRAIN_ELASTIC_CHECK",
    "setting",
    "elastic fit runs: seconds between looks for nodes to grow onto",
    "30",
    number=float,
    least=1,
)
STORAGE = _var("RAYTRAIN_STORAGE", "setting", "checkpoint root for fit (--storage)", "runs")
PROGRESS_EVERY = _var(
    "RAYTRAIN_PROGRESS_EVERY", "setting", "seconds between progress lines in a log", "30", number=float, least=0
)
STORAGE_TIMEOUT = _var(
    "RAYTRAIN_STORAGE_TIMEOUT",
    "setting",
    "seconds storage may take to answer before a run stops",
    "120",
    number=float,
    least=1,
)
PROMETHEUS = _var(
    "RAYTRAIN_PROMETHEUS", "setting", "run a Prometheus for the job: 1, or its binary's path", shown="off"
)
CONTAINER = _var(
    "RAYTRAIN_CONTAINER", "setting", "image every Ray process and driver runs in (see README: Containers)", shown="none"
)
ContainerRuntime = Literal["apptainer", "pyxis", "podman"]
CONTAINER_RUNTIMES: tuple[ContainerRuntime, ...] = get_args(ContainerRuntime)  # what CONTAINER_RUNTIME may name
CONTAINER_RUNTIME = _var(
    "RAYTRAIN_CONTAINER_RUNTIME",
    "setting",
    f"{', '.join(CONTAINER_RUNTIMES[:-1])} or {CONTAINER_RUNTIMES[-1]}",
    shown="found on the head, by the image",
)
CONTAINER_MOUNTS = _var(
    "RAYTRAIN_CONTAINER_MOUNTS",
    "setting",
    "more binds, SRC[:DST[:OPTS]],...",
    shown="home, submit dir, job dirs, temp root",
)
CONTAINER_FLAGS = _var("RAYTRAIN_CONTAINER_FLAGS", "setting", "more flags for the runtime (shell words)", shown="none")
CONTAINER_PYTHON = _var("RAYTRAIN_CONTAINER_PYTHON", "setting", "the image's interpreter with raytrain", "python3")
CONTAINER_ENV = _var(
    "RAYTRAIN_CONTAINER_ENV",
    "setting",
    "host variables Podman passes in, Pyxis sets over the image's: NAME or PREFIX*,...",
    shown="none",
)

# --- job: set by raytrain for the processes of a job ------------------------------------------------
JOB_DIR = _var("RAYTRAIN_JOB_DIR", "job", "the job's private directory (token, cluster.json, flags)")
JOB_START = _var("RAYTRAIN_JOB_START", "job", "Unix time the batch job started, for start-up timings")
BATCH_DRIVER = _var("RAYTRAIN_BATCH_DRIVER", "job", "1 in the batch script's own driver (the job ends with it)")
TORCH_PORTS = _var("RAYTRAIN_TORCH_PORTS", "job", "first-last: the job's port range for torch's rendezvous")
DASHBOARD_URL = _var("RAYTRAIN_DASHBOARD_URL", "job", "the dashboard as the driver on the head reaches it")
CONTAINED = _var("RAYTRAIN_CONTAINED", "job", "1 in a process raytrain started inside the job's image")
PRIORITY = _var(
    "RAYTRAIN_PRIORITY", "job", "the priority of a driver's runs on a shared cluster: low, normal or high", "normal"
)
ANCHOR = _var(
    "RAYTRAIN_ANCHOR_PID",
    "job",
    "Podman: the host process (its podman run) whose end means the container's processes end too",
)

# --- Ray's own, set by raytrain ---------------------------------------------------------------------
RAY_ADDRESS = _var("RAY_ADDRESS", "ray", "the GCS a driver joins (unset: raytrain starts a local Ray)")
RAY_AUTH_MODE = _var("RAY_AUTH_MODE", "ray", "'token' on every Ray process, driver and CLI call")
RAY_AUTH_TOKEN_PATH = _var("RAY_AUTH_TOKEN_PATH", "ray", "the job's token file")
RAY_AUTH_TOKEN = _var("RAY_AUTH_TOKEN", "ray", "a token by value: always unset, so the file wins")
USAGE_STATS = _var("RAY_USAGE_STATS_ENABLED", "ray", "Ray's usage reporting: off", "0")
DRAIN_TIMEOUT = _var(
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S",
    "ray",
    "Ray's drain on SIGTERM (30 s) outlasts Slurm's KillWait: stop at once",
    "0",
)
HEALTH_CHECK = _var(
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",
    "ray",
    "Train controller's poll of its workers: how soon a report, a failure or the run's end is seen (Ray: 2 s; "
    "1 s costs no CPU that 5 s does not, measured with 8 workers on 2 cores)",
    "1",
)
PARQUET_FOOTER_ACTORS = _var(
    "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS",
    "ray",
    "Ray Data's Parquet footer readers per read (Ray: 32 actors, each a new process, even for one file)",
    "4",
)
DATA_METADATA_THREAD = _var(
    "RAY_DATA_METADATA_PREFETCH_ON_THREAD",
    "ray",
    "Ray Data's fetch of each block's metadata on a thread of its own, which hands the block on only at a "
    "later step of its scheduler: off, each block goes on as its task yields it (a streamed pass's first "
    "batch 0.1 s sooner, BENCHMARKS.md)",
    "0",
)
PREEMPTION_WATCHER = _var(
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
    "ray",
    "Ray Train's watch for drained nodes (an actor a run): off on a private local cluster, which nobody drains",
    "0",
)
TRAIN_CALLBACKS = _var(
    "RAY_TRAIN_CALLBACKS", "ray", "Ray Train callbacks every trainer of a driver loads: raytrain's service callback"
)
JOB_CONFIG = _var(
    "RAY_JOB_CONFIG_JSON_ENV_VAR",
    "ray",
    "the Ray job's config that ray.init() in a driver reads: a script's runtime_env gains the variables its "
    "tasks and actors need for raytrain's callback (a Ray Tune trial that runs a TorchTrainer, say)",
)
DEDUP_ALLOW = _var(
    "RAY_DEDUP_LOGS_ALLOW_REGEX",
    "ray",
    "worker log lines Ray never folds into '[repeated Nx]': raytrain's line per report",
    r"raytrain: (epoch|report) ",
)
GCS_RECONNECT = _var(
    "RAY_gcs_rpc_server_reconnect_timeout_s",
    "ray",
    "how long Ray's GCS client retries a GCS that went away before it ends its process (Ray: 60 s); "
    "raytrain's helpers that only read the GCS bound each read themselves instead",
    "86400",
)
TUNE_OUTPUT = _var(
    "RAY_AIR_NEW_OUTPUT",
    "ray",
    "Ray Tune's tables and banners in a sweep's driver (Ray: on); off, the sweep says a line per trial event",
    "0",
)
TUNE_TRIAL_ERRORS = _var(
    "TUNE_PRINT_ALL_TRIAL_ERRORS",
    "ray",
    "Ray Tune's traceback per failed trial (Ray: on); off, the sweep says one line (a preempted trial is one)",
    "0",
)
TUNE_STRICT_METRIC = _var(
    "TUNE_DISABLE_STRICT_METRIC_CHECKING",
    "ray",
    "Ray Tune's error at a report without the sweep's metric (Ray: an error); off, as a preempted epoch's "
    "report may lack it (the sweep checks the metric of a workload it does not know itself)",
    "1",
)
DASHBOARD_METRIC_PORT = _var("DASHBOARD_METRIC_PORT", "ray", "the dashboard's Prometheus port (Ray: 44227)")
AUTOSCALER_METRIC_PORT = _var("AUTOSCALER_METRIC_PORT", "ray", "the autoscaler's Prometheus port (Ray: 44217)")
PROMETHEUS_HOST = _var(
    "RAY_PROMETHEUS_HOST", "ray", "the Prometheus the dashboard's metrics views query: the job's, when it runs one"
)
NCCL_IFNAME = _var("NCCL_SOCKET_IFNAME", "ray", "NCCL's interface: kept when set, else the node's Ray interface")
GLOO_IFNAME = _var("GLOO_SOCKET_IFNAME", "ray", "Gloo's interface: kept when set, else the node's Ray interface")

# --- other tools' own, set by raytrain for the Ray processes of a job: kept in directories of the user's own -----
TMP = _var("TMPDIR", "tool", "where Python's tempfile (and torch, and Ray Train's staging) write: a private dir")
INDUCTOR_CACHE = _var(
    "TORCHINDUCTOR_CACHE_DIR",
    "tool",
    "torch.compile's cache (torch's default /tmp/torchinductor_<user> can be created first by anyone)",
)
MLFLOW_URI = _var("MLFLOW_TRACKING_URI", "tool", "MLflow's tracking URI: --tracker mlflow's default, when set")
MLFLOW_EXPERIMENT = _var("MLFLOW_EXPERIMENT_NAME", "tool", "the MLflow experiment a run logs into (else raytrain)")
MLFLOW_RETRIES = _var("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "tool", "MLflow's retries of a request (its own: 7)", "2")
MLFLOW_TIMEOUT = _var("MLFLOW_HTTP_REQUEST_TIMEOUT", "tool", "seconds an MLflow request may take (its own: 120)", "10")
MLFLOW_FILE_STORE = _var(
    "MLFLOW_ALLOW_FILE_STORE",
    "tool",
    "MLflow's file store, in maintenance since 3.7: the default beside the runs",
    "true",
)
TRITON_CACHE = _var("TRITON_CACHE_DIR", "tool", "Triton's kernel cache: beside torch's, in the user's private dir")

# Ray settings raytrain changes from Ray's defaults in every process it starts, unless the user set them.
RAY_DEFAULTS = (HEALTH_CHECK, PARQUET_FOOTER_ACTORS, DATA_METADATA_THREAD)
# And those it changes for a private local cluster only (on Slurm a drained node is how preemption arrives).
LOCAL_RAY_DEFAULTS = (PREEMPTION_WATCHER,)
# And those a sweep's driver changes from Ray Tune's.
TUNE_DEFAULTS = (TUNE_OUTPUT, TUNE_TRIAL_ERRORS, TUNE_STRICT_METRIC)


# What RAY_TRAIN_CALLBACKS names: loaded by every Ray Train run of a driver on a raytrain cluster.
SERVICE_CALLBACK = "raytrain.service.callback.ServiceCallback"


def add_service_callback(environ: dict[str, str] | os._Environ[str]) -> None:
    """Have every Ray Train run started from this environment load raytrain's service callback (the
    placement check, the job's rendezvous ports, result.json for scripts), keeping the user's own."""
    present = [c.strip() for c in environ.get(TRAIN_CALLBACKS.name, "").split(",") if c.strip()]
    if SERVICE_CALLBACK not in present:
        environ[TRAIN_CALLBACKS.name] = ",".join([*present, SERVICE_CALLBACK])


# What every task and actor of a script's Ray job gets from the driver's environment: a TorchTrainer started
# in one (a Ray Tune trial's) then loads raytrain's callback and finds the job, as the driver's own would.
ACTOR_VARIABLES = (TRAIN_CALLBACKS, JOB_DIR, JOB_START, PRIORITY)


def pass_to_actors(environ: dict[str, str]) -> None:
    """Put ACTOR_VARIABLES (those ENVIRON has) in the runtime_env of the Ray job a driver's ray.init()
    starts (``RAY_JOB_CONFIG_JSON_ENV_VAR``), keeping any the job config names already."""
    config = json.loads(environ.get(JOB_CONFIG.name) or "{}") or {}
    runtime_env = config["runtime_env"] = config.get("runtime_env") or {}
    env_vars = runtime_env["env_vars"] = runtime_env.get("env_vars") or {}
    for var in ACTOR_VARIABLES:
        if var.name in environ:
            env_vars.setdefault(var.name, environ[var.name])
    add_service_callback(env_vars)  # a list the job config named already gets raytrain's callback too
    environ[JOB_CONFIG.name] = json.dumps(config)


def never_dedup_report_lines(environ: dict[str, str] | os._Environ[str]) -> None:
    """Keep Ray's log deduplication off the service callback's report lines (they differ only in their
    numbers, which Ray's deduplication ignores), and on everything else, the user's own pattern included."""
    assert DEDUP_ALLOW.default is not None
    theirs = environ.get(DEDUP_ALLOW.name)
    if not theirs or DEDUP_ALLOW.default not in theirs:
        environ[DEDUP_ALLOW.name] = f"(?:{theirs})|{DEDUP_ALLOW.default}" if theirs else DEDUP_ALLOW.default


def settings() -> list[Var]:
    """The variables a user sets, in the order the batch script documents them."""
    return [v for v in TABLE if v.kind == "setting"]


def check_settings(env: Mapping[str, str] | None = None) -> None:
    """Every numeric setting parses and is in range, or a UserError naming the first that is not."""
    for var in settings():
        if var.number is not None:
            var.value(env)


def apply_ray_defaults(env: dict[str, str] | os._Environ[str], *, local: bool = False, tune: bool = False) -> None:
    for var in (*RAY_DEFAULTS, *(LOCAL_RAY_DEFAULTS if local else ()), *(TUNE_DEFAULTS if tune else ())):
        assert var.default is not None
        env.setdefault(var.name, var.default)
