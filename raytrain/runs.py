"""The run directory ``<storage>/<name>``: who owns it, what experiment it holds, where to resume.

``raytrain_run.json`` records the experiment settings when a run is created; a later ``fit`` with the same
name resumes only if they match, so reusing a name by accident stops with a message instead of silently
continuing a different experiment. ``--fresh`` moves an existing run aside (never deletes it).
A lock file keeps two drivers out of one run directory at once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import posixpath
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from raytrain import checkpoint, slurm_env
from raytrain.config import FitConfig
from raytrain.errors import UserError

RUN_META = "raytrain_run.json"
RESULT = "result.json"
LOCK = "driver.lock"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def write_json(fs: pafs.FileSystem, path: str, payload: Any) -> None:
    """Write JSON so that readers see the old file or the new one, never half of one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with fs.open_output_stream(tmp) as out:
        out.write(json.dumps(payload, indent=2, sort_keys=True, default=str).encode())
    fs.move(tmp, path)


def read_json(fs: pafs.FileSystem, path: str) -> Any:
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


def check_writable(fs: pafs.FileSystem, root: str, shown: str) -> None:
    probe = posixpath.join(root, f".raytrain-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(probe) as out:
            out.write(b"ok")
        fs.delete_file(probe)
    except OSError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"--storage {shown} is not writable ({reason}): pass --storage on a filesystem you can write "
            "to and that every node sees"
        ) from None


@dataclass(frozen=True)
class RunState:
    """What the run directory says before training starts."""

    path: str
    resume: checkpoint.Found | None
    moved_aside: str | None

    @property
    def completed_epochs(self) -> int:
        return self.resume.epoch if self.resume else 0


def _diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    changes = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(new) if old.get(k) != new.get(k)]
    return "; ".join(changes)


def open_run(fs: pafs.FileSystem, root: str, cfg: FitConfig, *, dry_run: bool) -> RunState:
    """Check the run directory against the config; move it aside for ``--fresh``; find the resume point."""
    path = posixpath.join(root, cfg.run.name)
    exists = fs.get_file_info(path).type == pafs.FileType.Directory
    moved = None
    if exists and cfg.run.fresh:
        moved = f"{path}.replaced-{_now()}"
        if not dry_run:
            _check_unlocked(path, cfg.run.name)
            fs.move(path, moved)
        exists = False
    meta_path = posixpath.join(path, RUN_META)
    if exists and fs.get_file_info(meta_path).type == pafs.FileType.File:
        old = read_json(fs, meta_path)
        if old.get("fingerprint") != cfg.fingerprint():
            changed = _diff(old["experiment"], cfg.experiment())
            raise UserError(
                f"run {cfg.run.name!r} in {root} was started with other settings ({changed}): "
                "repeat its settings to resume it, pick another --name, or add --fresh to start over "
                "(the old run is moved aside, not deleted)"
            )
    elif exists and fs.get_file_info(pafs.FileSelector(path)):
        raise UserError(
            f"{path} exists but is not a raytrain run: pick another --name or --storage, or move that directory away"
        )
    resume = checkpoint.latest(fs, path) if exists else None
    if exists and isinstance(fs, pafs.LocalFileSystem):
        _check_unlocked(path, cfg.run.name)
    if not dry_run:
        fs.create_dir(path, recursive=True)
        if not exists:
            write_json(
                fs,
                meta_path,
                {
                    "name": cfg.run.name,
                    "created": _now(),
                    "fingerprint": cfg.fingerprint(),
                    "experiment": cfg.experiment(),
                    "config": cfg.to_dict(),
                },
            )
    return RunState(path=path, resume=resume, moved_aside=moved)


def _lock_owner() -> dict[str, Any]:
    job = slurm_env.current()
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": job.key if job else None, "since": _now()}


def _stale(owner: dict[str, Any]) -> bool:
    """A lock is stale when its process is gone from this host, or it belongs to this (requeued) job."""
    job = slurm_env.current()
    if job and owner.get("slurm_job") == job.key:
        return True
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError):
        return False
    return False


def _check_unlocked(path: str, name: str) -> None:
    lock = os.path.join(path, LOCK)
    try:
        with open(lock) as f:
            owner = json.load(f)
    except (FileNotFoundError, ValueError):
        return
    if not _stale(owner):
        raise UserError(
            f"run {name!r} is in use by pid {owner.get('pid')} on {owner.get('host')} "
            f"(job {owner.get('slurm_job') or '-'}, since {owner.get('since')}): wait for it or pick another "
            f"--name; if that process is gone, delete {lock}"
        )


@contextlib.contextmanager
def locked(fs: pafs.FileSystem, path: str, name: str) -> Iterator[None]:
    """Hold the run's driver lock (local and shared POSIX filesystems; best effort elsewhere)."""
    if not isinstance(fs, pafs.LocalFileSystem):
        yield
        return
    lock = os.path.join(path, LOCK)
    _check_unlocked(path, name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock)  # stale, as just checked
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise UserError(f"run {name!r} was just taken by another driver: pick another --name") from None
    with os.fdopen(fd, "w") as f:
        json.dump(_lock_owner(), f)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
