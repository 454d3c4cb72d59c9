"""One node's Ray, started and stopped under supervision inside its own Slurm step.

The supervisor advertises what Slurm allocated on the node (CPUs, GPUs, an object store that fits
``/dev/shm``), binds Ray to an explicit address and a claimed port block, turns token auth on, points
NCCL and Gloo at the interface that carries that address, and keeps Ray's temp dir short, private and
node-local. On the head it also runs the job's Prometheus when asked (``raytrain.launch.prometheus``).
On SIGTERM (scancel, time limit, the batch script's teardown) it stops Ray, keeps Ray's logs in the
job's log directory, and removes the temp dir.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psutil

from raytrain import private_dirs, processes, ray_internals, slurm_env
from raytrain.contracts import env
from raytrain.contracts.jobdir import SLURM_NODE_LABEL, TOKEN, ClusterFile
from raytrain.errors import UserError
from raytrain.launch import container, netinfo, ports, prometheus

# What Ray appends under --temp-dir for its longest socket path, and ".N" for a start again (START_TRIES)
# that finds the session's sockets left by the failed one.
_SOCKET_SUFFIX = 64
_AF_UNIX_MAX = 107
_MIN_OBJECT_STORE = 80 * 1024**2
START_TRIES = 3  # starts of a worker node's Ray, when one fails before the node has joined


@dataclass(frozen=True)
class NodeArgs:
    role: str  # "head" or "worker"
    job_dir: Path  # private per-job directory on shared storage (token, cluster.json)
    log_dir: Path  # per-job, per-attempt log directory on shared storage
    head: str | None  # workers: "ip:port" of the head's GCS
    ifname: str | None
    head_ip: str | None
    tmp_root: Path
    port_base: int
    port_block: int
    port_blocks: int
    ray_cmd: tuple[str, ...]
    rejoin: int = 0  # this node's Ray started again within the job: the how-manieth start after the first


def object_store_bytes(job: slurm_env.SlurmJob | None) -> int:
    """30% of the memory Slurm granted (else of the node), capped to fit the free part of /dev/shm."""
    memory = (job.mem_per_node_mb * 1024**2) if job and job.mem_per_node_mb else psutil.virtual_memory().total
    want = int(memory * 0.3)
    try:
        shm = shutil.disk_usage("/dev/shm").free
    except OSError:
        return max(want, _MIN_OBJECT_STORE)
    return max(min(want, int(shm * 0.9)), _MIN_OBJECT_STORE)


def gpus_on_node(job: slurm_env.SlurmJob | None) -> int:
    if job and job.gpus_on_node is not None:
        return job.gpus_on_node
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) if visible and visible != "NoDevFiles" else 0


def ray_temp(temp_dir: Path) -> Path:
    """Ray's own temp dir, one level inside the job's private one: Ray makes the directory it is given
    (and everything it creates in it) 0777 on purpose, so the private parent is what keeps others out."""
    return temp_dir / "ray"


def preflight(args: NodeArgs, temp_dir: Path) -> None:
    host = socket.gethostname()
    if not args.log_dir.is_dir():
        raise UserError(f"{host} cannot see the log directory {args.log_dir}: put it on storage every node mounts")
    if not (args.job_dir / TOKEN).is_file():
        raise UserError(f"{host} cannot read the job's token under {args.job_dir}: is it on shared storage?")
    if len(str(ray_temp(temp_dir))) + _SOCKET_SUFFIX > _AF_UNIX_MAX:
        raise UserError(
            f"Ray's temp dir {ray_temp(temp_dir)} is too long for Unix socket paths ({_AF_UNIX_MAX} bytes): "
            "set RAYTRAIN_TMPDIR to a short node-local directory such as /tmp"
        )


def ray_command(args: NodeArgs, *, ip: str, block: ports.PortBlock, temp_dir: Path, nodename: str) -> list[str]:
    job = slurm_env.current()
    cpus = (job.cpus_on_node if job else None) or len(os.sched_getaffinity(0))
    cmd = [
        *args.ray_cmd,
        "start",
        "--block",
        "--disable-usage-stats",
        f"--node-ip-address={ip}",
        f"--num-cpus={cpus}",
        f"--num-gpus={gpus_on_node(job)}",
        f"--object-store-memory={object_store_bytes(job)}",
        f"--temp-dir={ray_temp(temp_dir)}",
        f"--labels={SLURM_NODE_LABEL}={nodename}",
        f"--node-manager-port={block.port('node_manager')}",
        f"--object-manager-port={block.port('object_manager')}",
        f"--min-worker-port={block.worker_range[0]}",
        f"--max-worker-port={block.worker_range[1]}",
        f"--dashboard-agent-listen-port={block.port('dashboard_agent_listen')}",
        f"--dashboard-agent-grpc-port={block.port('dashboard_agent_grpc')}",
        f"--runtime-env-agent-port={block.port('runtime_env_agent')}",
        f"--metrics-export-port={block.port('metrics_export')}",
    ]
    if args.role == "head":
        cmd += [
            "--head",
            f"--port={block.port('gcs')}",
            f"--ray-client-server-port={block.port('ray_client_server')}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={block.port('dashboard')}",
        ]
    else:
        assert args.head
        cmd.append(f"--address={args.head}")
    return cmd


def ray_env(args: NodeArgs, *, iface: str | None, block: ports.PortBlock, temp_dir: Path) -> dict[str, str]:
    """Ray's environment on this node (every Ray process and worker inherits it): auth, the job's ports,
    and every directory a worker writes (tempfile's, torch's and Triton's caches) private to the user."""
    scratch = temp_dir / "tmp"
    scratch.mkdir(mode=0o700, exist_ok=True)
    out = dict(os.environ)
    out.update(private_dirs.node_caches(args.tmp_root, temp_dir / "cache"))
    out.update(
        {
            env.TMP.name: str(scratch),
            env.RAY_AUTH_MODE.name: "token",
            env.RAY_AUTH_TOKEN_PATH.name: str(args.job_dir / TOKEN),
            env.DRAIN_TIMEOUT.name: env.DRAIN_TIMEOUT.require({}),
            env.USAGE_STATS.name: env.USAGE_STATS.require({}),
            env.DASHBOARD_METRIC_PORT.name: str(block.port("dashboard_metric")),
            env.AUTOSCALER_METRIC_PORT.name: str(block.port("autoscaler_metric")),
            env.TORCH_PORTS.name: "{}-{}".format(*block.torch_range),
        }
    )
    out.pop(env.RAY_AUTH_TOKEN.name, None)
    env.apply_ray_defaults(out)
    if iface:
        out.setdefault(env.NCCL_IFNAME.name, iface)
        out.setdefault(env.GLOO_IFNAME.name, iface)
    return out


class Supervisor:
    """Runs ``ray start --block`` in a process group of its own and stops that group, and only it.

    Signals are taken from the moment it exists, so a stop that arrives while Ray is still starting is
    not lost. Stopping is bounded (Slurm sends SIGKILL ``KillWait`` seconds after SIGTERM, 30 s by
    default): SIGTERM to the group, ``grace_s`` to exit, then SIGKILL to the group and to any process
    still using this node's temp dir (a Ray worker that left the group). Ray's state is disposable at
    this point: checkpoints are on shared storage.
    """

    def __init__(self, temp_dir: Path, grace_s: float, anchor: Callable[[], bool] | None = None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.anchor = anchor  # in a Podman container: its podman run still runs (else Slurm ended the step)
        self.leader: psutil.Process | None = None  # the group's leader, told apart from a later pid's owner
        self.temp_dir = str(temp_dir)
        self.grace_s = grace_s
        self.stopping = False
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        self._killpg(signal.SIGTERM)

    def _killpg(self, sig: int) -> None:
        if self.leader is not None and processes.group_held(self.leader):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.leader.pid, sig)

    def run(self, cmd: list[str], env: dict[str, str]) -> int | None:
        """Run Ray until it exits (its status) or a stop is requested (None); ``stop`` then ends it."""
        if self.stopping:
            return None
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.leader = psutil.Process(self.proc.pid)  # not reaped yet: the pid is still this one's
        polls = 0
        while not self.stopping:  # Ray may ignore SIGTERM while blocked in C++: never wait unbounded
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.proc.wait(timeout=0.25)
            polls += 1
            if self.anchor is not None and polls % 4 == 0 and not self.anchor():
                say("the podman run of this container is gone (Slurm ended the step): stopping Ray", err=True)
                self._on_signal(signal.SIGTERM, None)
        return None

    def stop(self) -> None:
        """SIGTERM to the group; ``grace_s`` for it and for every process of this node's Ray (a worker
        that left the group among them) to exit; SIGKILL to what is left, the group's stragglers too."""
        leader = processes.of([self.proc] if self.proc is not None else [])
        ray = processes.with_descendants(leader)
        if leader:  # Ray still runs: it gets its grace; what is left of one that ended gets none
            self._killpg(signal.SIGTERM)
        ray += [p for p in processes.naming(self.temp_dir) if p not in ray]
        processes.end(ray, grace_s=self.grace_s if leader else 0)
        self._killpg(signal.SIGKILL)  # a process of the group that is none of those
        processes.end(processes.naming(self.temp_dir), grace_s=0)  # one that started meanwhile


def keep_ray_logs(temp_dir: Path, dest: Path, max_file_bytes: int = 64 * 1024**2) -> bool:
    """Copy Ray's logs out of a job's temp dir on this node (files above MAX_FILE_BYTES left out); whether
    there were any."""
    src = ray_temp(temp_dir) / "session_latest" / "logs"
    if not src.is_dir():
        return False
    shutil.copytree(
        src,
        dest,
        dirs_exist_ok=True,
        symlinks=False,
        ignore=lambda d, names: [
            n for n in names if (Path(d) / n).is_file() and (Path(d) / n).stat().st_size > max_file_bytes
        ],
    )
    return True


def say(message: str, *, err: bool = False) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr if err else sys.stdout, flush=True)


_TEMP_NAME = re.compile(r"^rt(\d+(?:_\d+)?)\.(\d+)\.[^./]+$")  # rt<job key>.<attempt>.<random>: make_temp_dir


def _temp_dirs(tmp_root: Path) -> list[tuple[str, int, Path]]:
    """The Ray temp dirs of Slurm jobs of yours on this node: (job key, attempt, path)."""
    found = []
    for path in sorted(tmp_root.glob("rt*.*.*")):
        m = _TEMP_NAME.match(path.name)
        with contextlib.suppress(OSError):
            if m and path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid():
                found.append((m.group(1), int(m.group(2)), path))
    return found


def sweep(tmp_root: Path, log_dir: Path) -> list[Path]:
    """Remove this job's Ray temp dirs on this node, keeping their Ray logs: what a node's supervisor
    leaves when it is killed with its Ray (a lost node) and cannot clean up itself."""
    job = slurm_env.current()
    if job is None:
        return []
    nodename = slurm_env.node_name()
    removed = []
    for key, _, temp_dir in _temp_dirs(tmp_root):
        if key == job.key:
            keep_ray_logs(temp_dir, log_dir / f"ray-lost-{nodename}")
            shutil.rmtree(temp_dir, ignore_errors=True)
            removed.append(temp_dir)
    return removed


def sweep_ended(tmp_root: Path, own: str) -> list[str]:
    """Remove the Ray temp dirs your jobs that Slurm no longer lists left on this node (killed before
    their teardown: SIGKILL, a node reboot that kept /tmp); their job keys. Nothing when squeue cannot say."""
    stale = [(key, path) for key, _, path in _temp_dirs(tmp_root) if key != own]
    live = slurm_env.live_jobs() if stale else None
    if live is None:
        return []
    removed = []
    for key, path in stale:
        if key not in live:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(key)
    return sorted(set(removed))


def make_temp_dir(tmp_root: Path, job_key: str, attempt: int) -> Path:
    """Ray's temp dir on this node: fresh, 0700, ours, and under a name nobody can guess (so nobody can
    plant it, or a link by its name, first); short, for Unix socket paths."""
    try:
        return Path(tempfile.mkdtemp(prefix=f"rt{job_key}.{attempt}.", dir=tmp_root))
    except OSError as exc:
        raise UserError(
            f"cannot make Ray's temp dir in {tmp_root} on {socket.gethostname()} ({exc.strerror or exc}): "
            "set RAYTRAIN_TMPDIR to a node-local directory you can write"
        ) from None


def run(args: NodeArgs) -> int:
    job = slurm_env.current()
    nodename = slurm_env.node_name()
    job_key = job.key if job else str(os.getpid())
    if args.rejoin and job:
        for lost in sweep(args.tmp_root, args.log_dir):
            say(f"{args.role} {nodename}: swept {lost}, left by this node's lost Ray")
    if job and (ended := sweep_ended(args.tmp_root, job.key)):
        ids = ", ".join(ended)
        say(f"{nodename}: removed the Ray temp dirs of your ended jobs {ids} (killed before their teardown)")
    temp_dir = make_temp_dir(args.tmp_root, job_key, job.restart_count if job else 0)
    sup = Supervisor(temp_dir, grace_s=env.STOP_GRACE.value(), anchor=container.anchor())
    hold: ports.Hold | None = None
    metrics: subprocess.Popen[bytes] | None = None
    try:
        preflight(args, temp_dir)
        prom = prometheus.binary() if args.role == "head" else None
        if args.role == "head":
            ip = netinfo.head_address(nodename, ifname=args.ifname, override=args.head_ip)
        else:
            assert args.head
            ip = netinfo.node_address(args.head.rsplit(":", 1)[0], ifname=args.ifname)
        iface = netinfo.iface_of(ip)
        locks, why = ports.lock_dir(args.tmp_root)
        if why:
            say(f"{args.role} {nodename}: {why}", err=True)
        block, hold = ports.claim(
            job_key,
            base=args.port_base,
            size=args.port_block,
            count=args.port_blocks,
            lock_dir=locks,
            skip=args.rejoin,
        )
        say(
            f"{args.role} {nodename}: ip {ip} ({iface or 'no interface found'}), "
            f"ports {block.base}-{block.base + block.size - 1}, temp {temp_dir}"
        )
        ray_vars = ray_env(args, iface=iface, block=block, temp_dir=temp_dir)
        prom_port: int | None = None
        if prom is not None:
            prom_port = block.port("prometheus")
            job_id = job.job_id if job else job_key
            metrics = prometheus.start(
                prom, temp_dir=ray_temp(temp_dir), log_dir=args.log_dir, port=prom_port, job_id=job_id
            )
            ray_vars[env.PROMETHEUS_HOST.name] = f"http://127.0.0.1:{prom_port}"
            say(f"{args.role} {nodename}: Prometheus on 127.0.0.1:{prom_port}, data in {args.log_dir}")
        if args.role == "head":
            publish_head(args, job, nodename, ip, block, prometheus_port=prom_port)
        cmd = ray_command(args, ip=ip, block=block, temp_dir=temp_dir, nodename=nodename)
        rc = run_ray(sup, cmd, ray_vars, args=args, temp_dir=temp_dir, nodename=nodename)
    finally:
        sup.stop()
        if metrics is not None:
            prometheus.stop(metrics)
        keep_ray_logs(temp_dir, args.log_dir / f"ray-{args.role}-{nodename}")
        shutil.rmtree(temp_dir, ignore_errors=True)
        if hold is not None:
            hold.release()
    if sup.stopping:
        say(f"{args.role} {nodename}: stopped, temp dir removed")
        return 0
    say(f"{args.role} {nodename}: ray exited on its own with status {rc}", err=True)
    return rc or 1


def run_ray(
    sup: Supervisor, cmd: list[str], ray_vars: dict[str, str], *, args: NodeArgs, temp_dir: Path, nodename: str
) -> int | None:
    """Run this node's Ray until it exits (its status) or a stop (None). A worker node's Ray that exits
    before its node has joined is started again, up to START_TRIES: on a busy node Ray's raylet aborts when
    its dashboard agent takes more than 15 s to start, and `ray start` gives the raylet 30 s to register
    (both fixed in Ray). The head's is not: its GCS is the cluster, and a new one would strand the workers
    that joined the first. Nor is a lost node's start again (a rejoin): the batch script's watcher tries
    that again itself, backing off."""
    started = ray_temp(temp_dir) / ray_internals.STARTED_FILE
    tries = 1 if args.role == "head" or args.rejoin else START_TRIES
    rc: int | None = None
    for attempt in range(1, tries + 1):
        rc = sup.run(cmd, ray_vars)
        if rc is None or sup.stopping or started.exists() or attempt == tries:
            break  # a stop that came as Ray exited is a stop, not a failed start
        sup.stop()
        failed = args.log_dir / f"ray-{args.role}-{nodename}-failed-start-{attempt}"
        try:
            kept = f"; its Ray logs are in {failed}" if keep_ray_logs(temp_dir, failed) else ""
        except (OSError, shutil.Error) as exc:  # the next start matters more than these logs
            kept = f"; its Ray logs could not be kept ({exc})"
        say(
            f"{args.role} {nodename}: Ray exited with status {rc} before this node joined; starting it again "
            f"({attempt + 1} of {tries}){kept}",
            err=True,
        )
    return rc


def publish_head(
    args: NodeArgs,
    job: slurm_env.SlurmJob | None,
    nodename: str,
    ip: str,
    block: ports.PortBlock,
    *,
    prometheus_port: int | None = None,
) -> None:
    """Write cluster.json (0600, in the 0700 job dir): how the driver, the workers and users reach the head."""
    ClusterFile(
        head_node=nodename,
        head_ip=ip,
        gcs_address=f"{ip}:{block.port('gcs')}",
        dashboard_port=block.port("dashboard"),
        ports=block.as_dict(),
        token_path=str(args.job_dir / TOKEN),
        log_dir=str(args.log_dir),
        job_id=job.job_id if job else None,
        submit_host=job.submit_host if job else None,
        started=time.time(),
        prometheus_port=prometheus_port,
    ).write(args.job_dir)
