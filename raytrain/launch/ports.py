"""A per-job block of ports on each node, claimed with locks so concurrent jobs never collide.

Every port Ray opens (and the range torch's rendezvous port is taken from) sits at a fixed offset in
the block. A block is claimed by holding two locks for the life of the node's Ray. One is ``flock`` on a
lock file in a node-local directory private to the user (``<tmp>/raytrain-ports-<uid>``, 0700): another
user can neither hold a lock of yours nor plant one. The other is a Unix socket bound to the block's
abstract name (``@raytrain-ports-<first port>``), which one process in the node's network namespace holds at
a time, whoever runs it: two users' jobs of the same port settings starting at once on a node, whose locks
cannot see each other and whose ports nothing binds yet, cannot take the same block. Blocks any process
binds (another user's jobs included) are skipped, probed by binding their ports; the first block tried
depends on the job id. Should someone else own the directory's name, blocks are claimed by the socket and
the probe, and the node's log says so. The blocks stay out of the kernel's ephemeral range (32768-60999 by
default): an outgoing connection's local port there cannot be listened on, and no probe can foresee which
one the next connection takes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import psutil

from raytrain import private_dirs, socket_names
from raytrain.contracts import env
from raytrain.errors import UserError

_OFFSETS = {
    "gcs": 0,
    "ray_client_server": 1,
    "dashboard": 2,
    "node_manager": 3,
    "object_manager": 4,
    "dashboard_agent_listen": 5,
    "dashboard_agent_grpc": 6,
    "runtime_env_agent": 7,
    "metrics_export": 8,
    "dashboard_metric": 9,
    "autoscaler_metric": 10,
    "prometheus": 11,  # the job's own Prometheus (RAYTRAIN_PROMETHEUS), on the head's loopback
}
TORCH_FIRST, TORCH_LAST = 12, 19
WORKERS_FIRST = 20
MIN_WORKER_PORTS = 80  # Ray's worker processes on a node (training workers, data tasks, actors) take one each
HIGHEST_PORT = 65535


def check_layout(base: int, size: int, count: int, ephemeral: tuple[int, int] | None = None) -> str | None:
    """The port settings describe blocks that exist, hold what a node's Ray needs and stay out of the
    node's ephemeral range (EPHEMERAL: first, last; read from the kernel when None), or a UserError. A
    warning instead when the site's range leaves no room for a block outside it: no setting can help."""
    least = WORKERS_FIRST + MIN_WORKER_PORTS
    if size < least:
        raise UserError(
            f"{env.PORT_BLOCK.name}={size} is too small: a block holds raytrain's {WORKERS_FIRST} named ports and "
            f"at least {MIN_WORKER_PORTS} for Ray's worker processes; give {least} or more (default "
            f"{env.PORT_BLOCK.default})"
        )
    last = base + size * count - 1
    layout = f"{env.PORT_BASE.name}={base} with {env.PORT_BLOCKS.name}={count} blocks of {env.PORT_BLOCK.name}={size}"
    if last > HIGHEST_PORT:
        raise UserError(
            f"{layout} ports reaches port {last}, past {HIGHEST_PORT}: lower the base or the number of blocks "
            f"(at most {(HIGHEST_PORT - base + 1) // size} blocks fit above {base})"
        )
    first, end = ephemeral if ephemeral is not None else ephemeral_range()
    clash = sorted(set(range(max(base, first), min(last, end) + 1)) - reserved_ports())
    if not clash:
        return None
    where = f"this node's ephemeral range {first}-{end} (net.ipv4.ip_local_port_range)"
    why = "where any outgoing connection may hold a port Ray must listen on"
    reserve = "have the site reserve the blocks' range (net.ipv4.ip_local_reserved_ports)"
    options = []  # settings that work, the least change first
    if base < first and (fit := (first - base) // size) >= 1:
        options.append(f"{env.PORT_BLOCKS.name}={fit} (at most {fit} blocks from {base})")
    if (below := min(count, (first - 1024) // size)) >= 1 and not options:
        options.append(f"{env.PORT_BASE.name}={first - below * size} {env.PORT_BLOCKS.name}={below}")
    if (above := min(count, (HIGHEST_PORT - end) // size)) >= 1:
        options.append(f"{env.PORT_BASE.name}={end + 1} {env.PORT_BLOCKS.name}={above}")
    if not options:
        return f"{where} leaves no room for a port block outside it, {why} (a job may fail at its start): {reserve}"
    settings = ", or ".join(options)
    raise UserError(f"{layout} ports reaches into {where} at {clash[0]}, {why}: set {settings}; or {reserve}")


def ephemeral_range() -> tuple[int, int]:
    """The ports Linux hands out to outgoing connections on this node (its network namespace): a port
    one of them holds cannot be listened on, whatever SO_REUSEADDR says."""
    try:
        first, end = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(first), int(end)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def reserved_ports() -> set[int]:
    """Ports the site keeps out of the ephemeral range (net.ipv4.ip_local_reserved_ports: "a-b,c")."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text().strip()
    except OSError:
        return set()
    ports: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, end = part.partition("-")
        with contextlib.suppress(ValueError):
            ports.update(range(int(first), int(end or first) + 1))
    return ports


@dataclass(frozen=True)
class PortBlock:
    index: int
    base: int
    size: int

    def port(self, name: str) -> int:
        return self.base + _OFFSETS[name]

    @property
    def torch_range(self) -> tuple[int, int]:
        return self.base + TORCH_FIRST, self.base + TORCH_LAST

    @property
    def worker_range(self) -> tuple[int, int]:
        return self.base + WORKERS_FIRST, self.base + self.size - 1

    def fixed_ports(self) -> list[int]:
        return [self.base + off for off in _OFFSETS.values()]

    def as_dict(self) -> dict[str, int]:
        return {name: self.port(name) for name in _OFFSETS} | {
            "torch_first": self.torch_range[0],
            "torch_last": self.torch_range[1],
            "min_worker": self.worker_range[0],
            "max_worker": self.worker_range[1],
        }


def in_use() -> set[int]:
    """Every port something on this node listens on (TCP) or has bound (UDP), any user's: read from the
    kernel's socket tables, which every user may read (only the owning processes are hidden)."""
    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.Error:
        return set()
    return {c.laddr.port for c in conns if c.laddr and (c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM)}


def lock_dir(tmp_root: Path) -> tuple[Path | None, str | None]:
    """This user's lock directory on the node, made private if new; (None, why) when the name is someone
    else's (then ``claim`` probes by binding alone)."""
    path = tmp_root / f"raytrain-ports-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        return path, None
    return None, (
        f"{path} is not a private directory of yours (owner {private_dirs.owner(st.st_uid)}, mode "
        f"{stat.S_IMODE(st.st_mode):o}): port blocks are claimed without lock files of yours (by socket name and "
        "probing); remove it, or set RAYTRAIN_TMPDIR"
    )


@dataclass
class Hold:
    """The locks that keep a claimed block this node's job's: held until ``release``."""

    fds: list[int]

    def release(self) -> None:
        while self.fds:
            os.close(self.fds.pop())


# A block's abstract socket name is this prefix and its first port: jobs whose blocks start at the same port
# contend for it, whoever runs them. Jobs of another layout (RAYTRAIN_PORT_BASE, RAYTRAIN_PORT_BLOCK) whose
# blocks overlap these are parted by the port probe alone.
NAME_PREFIX = "raytrain-ports-"


def _file_lock(lock_dir: Path, block: PortBlock) -> int | None:
    """This user's lock on BLOCK (an open fd), or None while another job of theirs holds it."""
    fd = os.open(lock_dir / f"block-{block.base}.lock", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _netns_lock(block: PortBlock) -> int | None:
    """BLOCK's abstract socket name, bound (an open fd), or None while any process of any user in this
    network namespace holds it. The kernel lets it go when its holder exits, however it ends. OSError when
    this node cannot bind such a name at all (a sandbox that forbids it)."""
    held = socket_names.bind(f"{NAME_PREFIX}{block.base}")
    return None if held is None else held.detach()


def claim(
    job_key: str, *, base: int, size: int, count: int, lock_dir: Path | None, skip: int = 0
) -> tuple[PortBlock, Hold]:
    """Claim a free block; returns it and its locks, which must be held while the ports are in use. A block
    is free when no job holds its locks, none of its ports is in use, whoever holds it (another user's job
    that started before the locks), and its named ports bind. SKIP moves the first block tried on (a node's
    Ray started again takes other ports than the lost one: the head's connections to those stay broken
    for a while)."""
    start = (int(hashlib.sha256(job_key.encode()).hexdigest(), 16) + skip) % count
    busy = in_use()
    names = True  # False once this node turns out not to allow them: the lock files and the probe then
    named: list[int] = []  # blocks whose names others hold, for the error
    for step in range(count):
        index = (start + step) % count
        block = PortBlock(index=index, base=base + index * size, size=size)
        hold = Hold([])
        if lock_dir is not None:
            if (mine := _file_lock(lock_dir, block)) is None:
                continue  # another job of this user's holds it
            hold.fds.append(mine)
        if names:
            try:
                anyones = _netns_lock(block)
            except OSError:
                names = False
            else:
                if anyones is None:
                    hold.release()  # another user's job starts or runs on it
                    named.append(block.base)
                    continue
                hold.fds.append(anyones)
        whole = range(block.base, block.base + block.size)
        if busy.isdisjoint(whole) and all(socket_names.port_free(p) for p in block.fixed_ports()):
            return block, hold
        hold.release()  # something else (a job from before, another program) uses its ports
    held = (
        f"; {len(named)} of them because their socket names are held (`ss -xlp | grep {NAME_PREFIX}` shows by whom)"
        if named
        else ""
    )
    raise UserError(
        f"no free port block of {size} among {count} from {base} on {socket.gethostname()}{held}: "
        "set RAYTRAIN_PORT_BASE to a free range"
    )
