"""Finding, starting and describing the Ray cluster a run trains on.

Inside a ``slurm/ray_cluster.sbatch`` job, ``RAY_ADDRESS`` (and the job's token) are set and ``connect``
joins that cluster. Anywhere else it starts a private local Ray: a 0700 temp dir of its own, token auth on
with a fresh token, the dashboard on loopback, and the resources Slurm granted when run inside an
allocation. Either way every Ray Train run of the process loads raytrain's service callback
(``RAY_TRAIN_CALLBACKS``). This module and ``launch/`` are the only places that start Ray or read its
location.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from raytrain import private_dirs, processes, ray_internals, slurm_env
from raytrain.contracts import env, jobdir
from raytrain.errors import UserError

log = logging.getLogger(__name__)

# How long a local run's Ray processes get to exit after ray.shutdown() before they are killed.
LOCAL_STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node as placement sees it."""

    node_id: str
    hostname: str
    ip: str
    cpus: float
    gpus: int
    is_driver: bool = False
    object_store_bytes: int = 0


@dataclass(frozen=True)
class ClusterInfo:
    """Where training runs: the nodes, and how a user reaches the cluster."""

    nodes: tuple[NodeInfo, ...]
    address: str
    local: bool
    dashboard_url: str | None = None
    token_path: str | None = None

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def object_store_bytes(self) -> int:
        return sum(n.object_store_bytes for n in self.nodes)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_resources() -> tuple[int, int]:
    """CPUs and GPUs this process may use: Slurm's grant inside an allocation, else the machine's."""
    job = slurm_env.current()
    cpus = (job.cpus_on_node if job else None) or len(os.sched_getaffinity(0))
    if job and job.gpus_on_node is not None:
        return cpus, job.gpus_on_node
    return cpus, ray_internals.visible_gpus()


def local_node() -> NodeInfo:
    """This machine described as the single node a local cluster would have, without starting Ray."""
    cpus, gpus = local_resources()
    hostname = socket.gethostname()
    return NodeInfo(node_id="local", hostname=hostname, ip=_primary_ip(), cpus=cpus, gpus=gpus, is_driver=True)


def _primary_ip() -> str:
    """The address other hosts would use to reach this one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only a route lookup
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def enable_token_auth(token_path: str) -> None:
    """Turn on Ray token auth for this process and everything it starts, reading the token from a file.

    The mode must be set explicitly: Ray enables it silently on a head that finds ``~/.ray/auth_token``
    while clients given an address do not. Ray caches its config when first imported, and the token
    when first read, so refresh both if that already happened: a second cluster in the same process has
    a new token.
    """
    os.environ[env.RAY_AUTH_MODE.name] = "token"
    os.environ[env.RAY_AUTH_TOKEN_PATH.name] = token_path
    os.environ.pop(env.RAY_AUTH_TOKEN.name, None)
    ray_internals.reset_auth_cache()


# Raylet advisories the driver would print on every epoch of a small node, that need no action: Ray
# starts more worker processes than its startup concurrency (the node's CPU count) whenever actors and
# tasks with fractional CPUs run side by side, which is how training workers and Ray Data share a node.
_ADVISORIES = ("maximum expected startup concurrency",)


class _DropAdvisories(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Progress bars disabled" not in record.getMessage()


def _quiet_ray_logging() -> None:
    """Keep Ray's INFO chatter and known advisories out of the terminal; warnings and errors still show.

    Ray Data logs to its own console handler at INFO (its DEBUG log file in the session dir stays).
    """
    for name in ("ray", "ray.train", "ray.tune"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import ray.data  # noqa: F401  (configures Ray Data's loggers, which are adjusted below)

    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setLevel(logging.WARNING)
            handler.addFilter(_DropAdvisories())
    ray_internals.filter_driver_log_lines(lambda lines: all(any(a in ln for a in _ADVISORIES) for ln in lines))


def _nodes() -> tuple[NodeInfo, ...]:
    import ray

    driver_node = ray.get_runtime_context().get_node_id()
    nodes = []
    for raw in ray.nodes():
        if not raw.get("Alive"):
            continue
        res = raw.get("Resources", {})
        nodes.append(
            NodeInfo(
                node_id=raw["NodeID"],
                hostname=(raw.get("Labels") or {}).get(jobdir.SLURM_NODE_LABEL)
                or raw.get("NodeManagerHostname")
                or raw["NodeManagerAddress"],
                ip=raw["NodeManagerAddress"],
                cpus=float(res.get("CPU", 0.0)),
                gpus=int(res.get("GPU", 0)),
                is_driver=raw["NodeID"] == driver_node,
                object_store_bytes=int(res.get("object_store_memory", 0)),
            )
        )
    return tuple(nodes)


def _exists(path: str) -> bool:
    return os.path.exists(path)


def not_seeing(path: str, nodes: Sequence[NodeInfo], timeout_s: float = 60) -> list[str]:
    """The nodes (hostnames) on which ``path`` does not exist: one tiny task pinned to each node looks."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    look = ray.remote(num_cpus=0, max_retries=0)(_exists)
    refs = {
        node.hostname: look.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        ).remote(path)
        for node in nodes
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        silent = sorted(host for host, ref in refs.items() if ref not in ready)
        raise UserError(
            f"{', '.join(silent)} did not answer within {timeout_s:.0f} s whether they see {path}: their storage "
            "(or Ray) stalls; check the mount there, then run again"
        )
    seen = dict(zip(refs, ray.get(list(refs.values())), strict=True))
    return sorted(host for host, found in seen.items() if not found)


def job_start_time() -> float | None:
    """When the batch job started (set by slurm/ray_cluster.sbatch), for start-up timings."""
    raw = env.JOB_START.get()
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def mark_elastic(job_dir: str | None, elastic: bool) -> None:
    """While an elastic run trains in a batch job (JOB_DIR): tell the batch script's watcher that losing a
    worker node's Ray does not end the run (Ray Train goes on with the nodes left and grows back when the
    watcher has started Ray there again; losing the head still ends it). ``elastic`` False: the run ended."""
    if not job_dir:
        return
    marker = os.path.join(job_dir, jobdir.ELASTIC)
    if elastic:
        with open(marker, "w") as f:
            f.write(f"{os.getpid()}\n")
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker)


def preempt_flag_path() -> str | None:
    """Where slurm/ray_cluster.sbatch drops its fallback preemption flag (in the job's private dir)."""
    job_dir = env.JOB_DIR.get()
    return os.path.join(job_dir, jobdir.PREEMPT_FLAG) if job_dir else None


def expected_local_node() -> NodeInfo | None:
    """The node a local cluster would have, known before starting it; None when joining a cluster."""
    return None if env.RAY_ADDRESS.get() or attached() else local_node()


@contextlib.contextmanager
def connect(*, dashboard: bool = True) -> Iterator[ClusterInfo]:
    """Join the job's Ray cluster (``RAY_ADDRESS``) or run a private local one for the duration."""
    address = env.RAY_ADDRESS.get()
    _quiet_ray_logging()
    env.add_service_callback(os.environ)
    if attached():
        yield from _within()
        return
    _import_trainer_meanwhile()
    if address:
        yield from _join(address)
    else:
        yield from _start_local(dashboard=dashboard)


def attached() -> bool:
    """Whether this process is a task or actor of a Ray cluster already (a sweep's trial): it trains on
    that cluster, and neither joins another nor shuts this one down."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _within() -> Iterator[ClusterInfo]:
    import ray

    yield ClusterInfo(
        nodes=_nodes(),
        address=str(ray.get_runtime_context().gcs_address),
        local=False,
        dashboard_url=env.DASHBOARD_URL.get(),
        token_path=env.RAY_AUTH_TOKEN_PATH.get(),
    )


def _import_trainer_meanwhile() -> None:
    """Import Ray Train's torch trainer (torch with it: 3 s of CPU) in a thread while Ray starts or is
    joined, which is mostly waiting, rather than after: every run's driver needs it next. A failure is
    left for the import that needs it to report."""

    def load() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module("ray.train.torch")

    threading.Thread(target=load, name="raytrain-import", daemon=True).start()


def _join(address: str) -> Iterator[ClusterInfo]:
    token_path = env.RAY_AUTH_TOKEN_PATH.get()
    if env.RAY_AUTH_MODE.get() == "token" and not (env.RAY_AUTH_TOKEN.get() or os.path.exists(token_path or "")):
        raise UserError(
            f"RAY_ADDRESS={address} uses token auth but no token is readable: "
            "set RAY_AUTH_TOKEN_PATH to the job's token file (see the job log)"
        )
    if token_path:
        enable_token_auth(token_path)
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise UserError(
            f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({exc}): run inside the job that "
            "started it, or unset RAY_ADDRESS to start a local cluster"
        ) from None
    _plain_sigterm()
    try:
        yield ClusterInfo(
            nodes=_nodes(),
            address=address,
            local=False,
            dashboard_url=env.DASHBOARD_URL.get(),
            token_path=token_path,
        )
    finally:
        ray.shutdown()


def _plain_sigterm() -> None:
    """Let SIGTERM end the driver as it would any program. ray.init installs a C++ handler that dumps
    every thread's stack first, some 30 lines in the job log on each scancel; the driver holds nothing
    to save (the workers write the checkpoints, and the batch script stops the cluster)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _LocalSigterm:
    """SIGTERM to a driver that owns its local cluster unwinds it as Ctrl-C does, so ``connect`` stops the
    Ray it started and removes the private directory with the token. Dying at once, as the default action
    does, leaves Ray's dashboard and runtime-env agents running and the directory behind. Ray's C++
    handler (installed by ray.init) would first dump every thread's stack. The handler raises
    KeyboardInterrupt because that is the exception Ray turns a signal into while ``ray.get`` waits. A
    second SIGTERM ends the process at once; one that comes during the clean-up is kept until it is done.
    """

    received = False  # for the CLI's message and exit status, after the cluster is gone
    _pending = False  # a SIGTERM came during the clean-up

    def arm(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._unwind)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Around the clean-up: a first SIGTERM waits for it to finish."""
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) == self._unwind:
            signal.signal(signal.SIGTERM, self._note)
        try:
            yield
        finally:
            if main and signal.getsignal(signal.SIGTERM) == self._note:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self._pending:
            raise KeyboardInterrupt

    def _note(self, signum: int, frame: object) -> None:
        type(self).received = True
        self._pending = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _unwind(self, signum: int, frame: object) -> None:
        type(self).received = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt


@contextlib.contextmanager
def _private_tmp(path: Path) -> Iterator[None]:
    """``TMPDIR`` for the processes started meanwhile (Ray's, which keep it), not for this one afterwards."""
    path.mkdir(mode=0o700, exist_ok=True)
    before = os.environ.get(env.TMP.name)
    os.environ[env.TMP.name] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(env.TMP.name, None)
        else:
            os.environ[env.TMP.name] = before


def stopped_by_sigterm() -> bool:
    """Whether a SIGTERM stopped the local cluster (the CLI then says so and exits 143)."""
    return _LocalSigterm.received


def _dashboard_can_start() -> bool:
    """Whether Ray's dashboard packages are there. Without them Ray refuses to start at all when asked for
    the dashboard; a local run trains without it instead, and says how to have it."""
    missing = ray_internals.dashboard_unavailable()
    if missing:
        log.warning("the dashboard is off: Ray's dashboard packages are missing (%s); pip install "
                    "'ray[default]' to have it", missing)  # fmt: skip
    return not missing


def _start_local(*, dashboard: bool) -> Iterator[ClusterInfo]:
    # A short private directory: AF_UNIX socket paths under it must stay below 107 bytes, and nobody
    # else on the host may read the token, sockets or logs in it.
    root = Path(tempfile.mkdtemp(prefix=f"rt{os.getuid()}-", dir="/tmp"))
    os.chmod(root, 0o700)
    token = root / "token"
    jobdir.write_token(token)
    enable_token_auth(str(token))
    # Ray's metrics agents default to fixed ports on 0.0.0.0 that collide between users on one host.
    os.environ[env.DASHBOARD_METRIC_PORT.name] = str(_free_port())
    os.environ[env.AUTOSCALER_METRIC_PORT.name] = str(_free_port())
    cpus, gpus = local_resources()
    dashboard = dashboard and _dashboard_can_start()
    env.apply_ray_defaults(os.environ, local=True)
    # Compile caches in a directory of the user's own (torch's default name in /tmp is anyone's to create).
    os.environ.update(private_dirs.node_caches(Path(tempfile.gettempdir()), root / "cache"))
    import ray

    sigterm = _LocalSigterm()
    try:
        with _private_tmp(root / "tmp"):  # what Ray's processes write with tempfile: inside the private root
            ctx = ray.init(
                num_cpus=cpus,
                num_gpus=gpus,
                include_dashboard=dashboard,
                dashboard_host="127.0.0.1",
                dashboard_port=_free_port() if dashboard else None,
                log_to_driver=False,
                logging_level=logging.WARNING,
                _temp_dir=str(root / "ray"),
                _metrics_export_port=_free_port(),
            )
        sigterm.arm()
        dashboard_url = f"http://{ctx.dashboard_url}" if dashboard and ctx.dashboard_url else None
        yield ClusterInfo(
            nodes=_nodes(),
            address=str(ctx.address_info["gcs_address"]),
            local=True,
            dashboard_url=dashboard_url,
            token_path=str(token),
        )
    finally:
        with sigterm.held():
            # Ray's workers and the dashboard's module processes outlive ray.shutdown() (they exit when
            # they see their raylet or head gone, seconds later): they are told to stop now, and the
            # command returns when every process of its cluster has.
            started = processes.with_descendants(processes.naming(str(root), psutil.Process().children()))
            ray.shutdown()
            processes.terminate(started, grace_s=LOCAL_STOP_GRACE_S)
            shutil.rmtree(root, ignore_errors=True)
