"""The driver lock of a run directory: one driver per run, provably.

A run directory on shared storage is written by exactly one driver at a time (its workers' checkpoints,
Ray Train's index, ``result.json``). The lock is a file in it, ``driver.lock``, naming its holder: host,
pid and that process's start time, Slurm job and attempt (restart count), and a random ``nonce`` that
tells one holding from another. The rules:

- **A live holder is never taken over**, whatever job it belongs to. Two drivers of one serving job
  carry the same Slurm job id, so the job alone says nothing; a requeued attempt tells its own earlier
  attempt (which Slurm ended before it started this one) by the restart count.
- A holder is gone when: it is an earlier attempt of this very job; its process is no longer running on
  this host (pid and start time: a later process that reuses the pid is not it); its Slurm job is no
  longer listed by squeue (a listed job holds on, suspended or not); or, when Slurm cannot say (no job,
  squeue does not answer), it has not refreshed the lock for ``STALE_S`` by the file server's clock.
- **Taking over a gone holder is atomic.** Creating the lock is a ``link`` of a complete file (never a
  half-written one); taking over holder N is creating ``driver.lock.taken-N`` exclusively, so among
  drivers racing for the same gone holder exactly one wins, then replaces the lock. A claim whose own
  maker died half-way is followed and taken over the same way. Claims stay as tombstones (a slow racer
  that read an old nonce must still lose) and are pruned after a day.
- **A holder keeps checking that it still holds the lock**: every heartbeat, before Ray Train uploads a
  checkpoint (``Guard``, on every worker) and before ``result.json``; on exit it removes the lock only
  if it is still its own.

Works on local and shared POSIX filesystems (NFS, Lustre, GPFS: ``link`` and ``O_EXCL`` are atomic
there); other filesystems (object stores) get no lock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from raytrain import fsio, slurm_env
from raytrain.contracts.rundir import LOCK, LOCK_CLAIM_PREFIX
from raytrain.errors import Fatal, UserError

HEARTBEAT_S = 30.0  # a holder refreshes its lock's mtime (and checks it still holds it) this often
STALE_S = 600.0  # a holder Slurm cannot vouch for is gone after this long without a refresh
UNREADABLE_STALE_S = 30.0  # a lock file that does not parse (a crash cut it short) is gone after this long
STILL_HELD_S = 10.0  # the longest a report waits to learn whether the run is still the driver's
CLAIM_TTL_S = 86400.0  # tombstones of take-overs are pruned after this long
_START_SLACK_S = 1.0  # process start times are recorded to this precision


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds (or claims) a run."""

    nonce: str  # this holding, and no other
    host: str
    pid: int
    started: float | None  # the process's start time: tells it from a later process reusing its pid
    uid: int | None
    slurm_job: str | None  # the Slurm job key (array tasks as <array>_<task>)
    cluster: str | None  # the Slurm cluster the job runs on (job ids are per cluster)
    restart: int  # the job's restart count when it took the lock
    since: str

    @classmethod
    def me(cls) -> Holder:
        job = slurm_env.current()
        return cls(
            nonce=secrets.token_hex(8),
            host=socket.gethostname(),
            pid=os.getpid(),
            started=psutil.Process().create_time(),
            uid=os.getuid(),
            slurm_job=job.key if job else None,
            cluster=job.cluster_name if job else None,
            restart=job.restart_count if job else 0,
            since=dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ"),
        )

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Holder:
        """A lock file's holder; ValueError if it is not one. A lock from before nonces were recorded gets
        one from its content, so that it too can be claimed exactly once."""
        raw = json.loads(blob)
        if not isinstance(raw, dict) or "pid" not in raw:
            raise ValueError("not a raytrain run lock")
        return cls(
            nonce=str(raw.get("nonce") or _digest(blob)),
            host=str(raw.get("host") or "?"),
            pid=int(raw["pid"]),
            started=float(raw["started"]) if raw.get("started") is not None else None,
            uid=int(raw["uid"]) if raw.get("uid") is not None else None,
            slurm_job=str(raw["slurm_job"]) if raw.get("slurm_job") else None,
            cluster=str(raw["cluster"]) if raw.get("cluster") else None,
            restart=int(raw.get("restart") or 0),
            since=str(raw.get("since") or "?"),
        )

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} (job {self.slurm_job or '-'}, since {self.since})"


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:16]


def _running(pid: int, started: float | None) -> bool:
    """Whether process ``pid`` runs on this host and is the one that started at ``started``."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) <= _START_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # it exists, and cannot be looked at: assume it runs


def gone(holder: Holder, me: Holder, age_s: Callable[[], float | None]) -> str | None:
    """Why ``holder`` no longer holds the run, so that ``me`` may take it over; None while it may.
    ``age_s``: seconds since the holder last refreshed the lock, by the file server's clock."""
    if holder.pid == 0:  # a lock file that does not parse: cut short by a crash, or being written right now
        age = age_s()
        if age is not None and age > UNREADABLE_STALE_S:
            return f"its lock file does not parse and has not changed for {age:.0f} s (a crash cut it short)"
        return None
    # A lock from before clusters were recorded (None) is taken to be of this cluster.
    same_cluster = holder.cluster is None or holder.cluster == me.cluster
    if holder.slurm_job and same_cluster and holder.slurm_job == me.slurm_job and holder.restart < me.restart:
        return (
            f"it is attempt {holder.restart} of this job, {me.slurm_job}, which Slurm ended before it started "
            f"attempt {me.restart}"
        )
    # Another user's process may be hidden from this one (/proc mounted hidepid): only Slurm can say.
    if holder.host == me.host and holder.uid in (None, me.uid):
        running = _running(holder.pid, holder.started)
        return None if running else f"pid {holder.pid} is no longer running on {holder.host}"
    if holder.slurm_job and same_cluster and (listed := slurm_env.job_listed(holder.slurm_job)) is not None:
        # Listed (running, pending after a requeue, suspended): it holds on, however old its last refresh.
        return None if listed else f"its Slurm job {holder.slurm_job} has ended"
    age = age_s()
    if age is not None and age > STALE_S:
        return (
            f"it has not refreshed the lock for {age / 60:.0f} min (a live driver does every {HEARTBEAT_S:.0f} s) "
            "and Slurm cannot vouch for it: its host is down or cut off"
        )
    return None


def _server_age(run_dir: Path, lock: Path) -> float | None:
    """Seconds since the lock's last refresh by the clock of the server that stores it (a fresh file's
    mtime, in the storage root beside the run: nothing is written in a run before its lock is held), not
    by this host's: the two differ on a cluster whose clocks drift."""
    probe = run_dir.parent / f".raytrain-clock-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            now = os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            probe.unlink()
        return now - lock.stat().st_mtime
    except FileNotFoundError:
        return None  # the lock went meanwhile
    except OSError:
        return time.time() - lock.stat().st_mtime  # a read-only run directory: this host's clock


def _create(path: Path, holder: Holder) -> bool:
    """Create ``path`` holding ``holder``, whole, if it does not exist: a ``link`` of a complete file (atomic
    on NFS too, where ``link`` may report an error it did not have: the link count says)."""
    tmp = path.with_name(f".{path.name}.{holder.nonce}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(holder.to_bytes())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        if os.stat(tmp).st_nlink == 2:
            return True
        raise
    finally:
        tmp.unlink()


def _replace(path: Path, holder: Holder) -> None:
    tmp = path.with_name(f".{path.name}.{holder.nonce}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(holder.to_bytes())
    os.replace(tmp, path)


def read(path: Path) -> Holder:
    """The holder a lock (or claim) file names (a transient storage error tried again: ``fsio``).
    FileNotFoundError when there is none; ValueError when it is not a lock."""
    return Holder.from_bytes(fsio.retried(path.read_bytes, str(path)))


def _claim(run_dir: Path, nonce: str) -> Path:
    return run_dir / f"{LOCK_CLAIM_PREFIX}{nonce}"


def _chain(run_dir: Path) -> tuple[Holder, Holder] | None:
    """The lock's holder, and whoever has claimed the run from them (and so on: the last claimer), or the
    holder itself; None when the run is not locked. ValueError when the lock file does not parse."""
    try:
        head = read(run_dir / LOCK)
    except FileNotFoundError:
        return None
    holder, seen = head, {head.nonce}
    while True:
        try:
            claimer = read(_claim(run_dir, holder.nonce))
        except FileNotFoundError:
            return head, holder
        if claimer.nonce in seen:  # cannot happen with claims made here; never loop on a hand-made one
            return head, claimer
        seen.add(claimer.nonce)
        holder = claimer


def current(run_dir: Path) -> Holder | None:
    """Who holds the run now: the lock's holder, or whoever has claimed it from them (and so on); None when
    the run is not locked."""
    chain = _chain(run_dir)
    return chain[1] if chain else None


def _in_use(name: str, run_dir: Path, holder: Holder) -> UserError:
    return UserError(
        f"run {name!r} is in use by {holder.describe()}: wait for it or pick another --name; if that process "
        f"is gone, delete {run_dir / LOCK}"
    )


def _holders(run_dir: Path) -> tuple[Holder, Holder] | None:
    """``_chain``, with an unreadable lock as a holder of pid 0."""
    try:
        return _chain(run_dir)
    except ValueError:
        unreadable = _unreadable(run_dir / LOCK)
        return unreadable, unreadable


def check_free(run_dir: Path, name: str) -> tuple[Holder, str] | None:
    """Raise if a live driver holds the run; else the gone holder a take-over will replace and why (None:
    not locked). Writes nothing in the run."""
    me = Holder.me()
    chain = _holders(run_dir)
    if chain is None:
        return None
    holder = chain[1]
    why = gone(holder, me, lambda: _server_age(run_dir, run_dir / LOCK))
    if why is None:
        raise _in_use(name, run_dir, holder)
    return holder, why


@dataclass(frozen=True)
class Guard:
    """What a worker needs to check, before it writes a checkpoint, that its driver still holds the run:
    the lock's path and the holding's nonce (picklable; no threads)."""

    lock: str
    nonce: str
    name: str

    def check(self) -> None:
        """Raise ``LockLost`` unless the run is still held by this holding."""
        chain = _holders(Path(self.lock).parent)
        holder = chain[1] if chain else None
        if holder is None or holder.nonce != self.nonce:
            raise LockLost.of(self.name, holder)


class LockLost(Fatal, UserError):
    """The run's lock is no longer this driver's: it must not write another checkpoint or result.json.
    A ``Fatal`` on a worker (no retry can help), a ``UserError`` (one line) in the driver."""

    @classmethod
    def of(cls, name: str, holder: Holder | None) -> LockLost:
        if holder is None:
            return cls(
                f"run {name!r} lost its lock while this driver trained (the lock file was removed): stopped "
                "without writing another checkpoint or result.json; check that no other driver trains it, then "
                "start it again"
            )
        return cls(
            f"run {name!r} was taken over by {holder.describe()} while this driver trained: stopped without "
            "writing another checkpoint or result.json; the run is the other driver's now (check what holds it "
            "before starting it again)"
        )


class Lock:
    """A held run lock: refreshed and checked by a heartbeat thread; released only if still ours."""

    def __init__(self, run_dir: Path, name: str, holder: Holder) -> None:
        self.run_dir = run_dir
        self.name = name
        self.holder = holder
        self.lost: LockLost | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK

    def guard(self) -> Guard:
        return Guard(lock=str(self.path), nonce=self.holder.nonce, name=self.name)

    def check(self) -> None:
        """Raise ``LockLost`` (and remember it) if the run is no longer held by this lock."""
        if self.lost is None:
            try:
                self.guard().check()
            except LockLost as exc:
                self.lost = exc
        if self.lost is not None:
            raise self.lost

    def still_held(self) -> bool:
        """Whether the run is still this lock's, asked within ``STILL_HELD_S`` (a storage that cannot say,
        for now, counts as yes: the checks before each checkpoint and before result.json decide)."""
        try:
            fsio.bounded(self.check, f"checking the lock of run {self.name!r}", STILL_HELD_S)
        except LockLost:
            return False
        except fsio.StorageError:
            pass
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.check()
            except LockLost:
                return  # never refresh a lock that is another's
            except (OSError, fsio.StorageError):
                continue  # the storage has a bad moment: look again at the next beat
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="raytrain-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Remove the lock if it is still this holding's: renamed aside first (atomic: a take-over that
        slipped in meanwhile is put back, not deleted). Bounded: a stalled storage is left as it is."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S)
        with contextlib.suppress(fsio.StorageError):
            fsio.bounded(self._remove, f"releasing the lock of run {self.name!r}", writes=True)

    def _remove(self) -> None:
        aside = self.run_dir / f".{LOCK}.released-{self.holder.nonce}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if read(aside).nonce != self.holder.nonce:  # another's, taken over a moment ago: back it goes
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
        except (OSError, ValueError):
            pass
        aside.unlink(missing_ok=True)


def acquire(run_dir: Path, name: str, echo: Callable[[str], None]) -> Lock:
    """Take the run's lock (``run_dir`` must exist), taking over a holder that is gone, with a line; a
    UserError while a live driver holds it, or when another driver won the race for it."""
    me = Holder.me()
    lock = run_dir / LOCK
    _prune_claims(run_dir)
    for _ in range(5):  # a lock released between two looks: look again
        if _create(lock, me):
            return Lock(run_dir, name, me)
        chain = _holders(run_dir)
        if chain is None:
            continue
        head, holder = chain
        why = gone(holder, me, lambda: _server_age(run_dir, lock))
        if why is None:
            raise _in_use(name, run_dir, holder)
        if not _create(_claim(run_dir, holder.nonce), me):
            raise _taken(name, run_dir, holder)
        # The claim proves that nobody else takes over this holding; replace the lock only if it is still the
        # one read (it may have gone with a --fresh move, and a new one been made, in between).
        still = _holders(run_dir)
        if still is None or still[0].nonce != head.nonce:
            raise _taken(name, run_dir, holder)
        _replace(lock, me)
        echo(f"run: taking over the lock of {holder.describe()}: {why}")
        return Lock(run_dir, name, me)
    raise UserError(f"run {name!r}: its lock {lock} keeps changing hands: try again, or pick another --name")


def _taken(name: str, run_dir: Path, holder: Holder) -> UserError:
    return UserError(
        f"run {name!r} was just taken over by another driver ({_claimed_by(run_dir, holder)}): wait for it or "
        "pick another --name"
    )


def _unreadable(lock: Path) -> Holder:
    """A lock file that does not parse (cut short by a crash between create and write, in an older
    raytrain): a holder that is gone, named by its content."""
    blob = lock.read_bytes()
    return Holder(
        nonce=_digest(blob), host="?", pid=0, started=None, uid=None, slurm_job=None, cluster=None, restart=0, since="?"
    )


def _claimed_by(run_dir: Path, holder: Holder) -> str:
    try:
        return read(_claim(run_dir, holder.nonce)).describe()
    except (OSError, ValueError):
        return "?"


def _prune_claims(run_dir: Path) -> None:
    now = time.time()
    for claim in run_dir.glob(f"{LOCK_CLAIM_PREFIX}*"):
        with contextlib.suppress(OSError):
            if now - claim.stat().st_mtime > CLAIM_TTL_S:
                claim.unlink()


@contextlib.contextmanager
def held(run_dir: Path, name: str, echo: Callable[[str], None]) -> Iterator[Lock]:
    """The run's lock for the duration, refreshed by a heartbeat; released (if still ours) on exit."""
    lock = acquire(run_dir, name, echo)
    lock.start()
    try:
        yield lock
    finally:
        lock.release()
