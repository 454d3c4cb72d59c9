"""The run directory ``<storage>/<name>``: who owns it, what experiment it holds, where to resume.

``raytrain_run.json`` records the experiment settings when a run is created; a later run with the same
name resumes only if they match, so reusing a name by accident stops with a message instead of silently
continuing a different experiment. ``--fresh`` moves an existing run aside (never deletes it). A lock
keeps two drivers out of one run directory at once (``raytrain.service.runlock``); nothing in the run is
written before it is held. Ray Train keeps its own index of the run's checkpoints in the same directory,
which is what ``ray.train.get_checkpoint()`` resumes from; it is checked against storage before every
attempt (``raytrain.service.checkpoint_index``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import posixpath
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain import fsio, private_dirs, uri
from raytrain.contracts.rundir import RUN_META
from raytrain.errors import UserError
from raytrain.service import checkpoint_index, runlock
from raytrain.service.config import RunConfig, fingerprint


@dataclass(frozen=True)
class Storage:
    """The checkpoint root: as the user gave it, and as a filesystem and a path in it."""

    uri: str
    fs: pafs.FileSystem
    root: str

    @classmethod
    def open(cls, given: str) -> Storage:
        """Resolve and check that it is writable, or raise a UserError that says what to do."""
        fs, root = uri.resolve(given)
        check_writable(fs, root, given)
        return cls(uri=given, fs=fs, root=root)


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def aside(path: str) -> str:
    """Where ``--fresh`` moves the run (or sweep) at ``path``: named by the time and a random tag, so that
    two starts in one second never aim at one name (``config.NAME_MAX`` leaves room for it)."""
    return f"{path}.replaced-{now()}-{secrets.token_hex(2)}"


def write_json(fs: pafs.FileSystem, path: str, payload: Any) -> None:
    """Write JSON so that readers see the old file or the new one, never half of one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with fs.open_output_stream(tmp) as out:
            out.write(json.dumps(payload, indent=2, sort_keys=True, default=str).encode())
        fs.move(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            fs.delete_file(tmp)
        raise


def read_json(fs: pafs.FileSystem, path: str) -> Any:
    def read() -> bytes:
        with fs.open_input_stream(path) as f:
            return bytes(f.read())

    return json.loads(fsio.retried(read, path))


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
class RunDir:
    """A run directory as found before training starts."""

    storage: Storage
    name: str
    path: str
    existed: bool  # the run was started before: this attempt resumes it
    moved_aside: str | None  # --fresh: where the previous run went
    resume: checkpoint_index.ResumePoint = field(default_factory=lambda: checkpoint_index.ResumePoint(latest=None))
    workers: int | None = None  # how many workers the run's last attempt trained with
    intact: checkpoint_index.Intact = field(default=lambda fs, path: True, repr=False)  # the workload's own check
    checks_contents: bool = False
    group: int | None = None  # the group the run is shared with (--share-group)

    def workers_note(self, workers: int) -> str | None:
        """A resume with another worker count changes the global batch: say so."""
        if not self.existed or self.workers is None or self.workers == workers:
            return None
        return (
            f"run: it trained with {self.workers} workers and goes on with {workers}: the global batch (per-worker "
            f"batch x workers) changes {workers / self.workers:.3g}x, and a learning rate tuned for {self.workers} "
            "workers may not suit it"
        )

    @property
    def fs(self) -> pafs.FileSystem:
        return self.storage.fs

    def file(self, name: str) -> str:
        return posixpath.join(self.path, name)


def check_shared(storage: Storage, not_seeing: Callable[[str], list[str]]) -> None:
    """Refuse a local --storage that not every node of the run sees (``not_seeing(path)``: the nodes on
    which a path is missing): each rank writes checkpoints there, and every node must find them to resume."""
    if not isinstance(storage.fs, pafs.LocalFileSystem):
        return  # an object store or a remote filesystem: the same for every node
    probe = posixpath.join(storage.root, f".raytrain-shared-{socket.gethostname()}-{os.getpid()}")
    with storage.fs.open_output_stream(probe) as out:
        out.write(b"raytrain: is this storage shared?")
    try:
        missing = not_seeing(probe)
    finally:
        storage.fs.delete_file(probe)
    if missing:
        raise UserError(
            f"--storage {storage.uri} is not on storage every node sees ({', '.join(missing)} cannot see it; "
            "node-local?): pass --storage on a filesystem all nodes mount (NFS, Lustre, GPFS) or an object store URI"
        )


def check_owned(path: Path, group: int | None = None) -> None:
    """A run directory (when there is one) must be yours and writable by you alone (or by GROUP, when the
    run is shared with it): another user's, a link, or one others may write, where anyone could have
    planted checkpoints or an index, is refused before anything is read from it."""
    why = private_dirs.problem(path, group_ok=group)
    if why is not None:
        shared = " (--share-group shares a run with a group)" if group is None else ""
        raise UserError(
            f"run directory {path} {why}: pick another --name or --storage; a run is yours alone{shared}, and "
            "raytrain neither reads nor writes one others can change"
        )


def _make(path: Path, group: int | None) -> bool:
    """Create the run directory: yours alone (0700), or shared with GROUP (2770: new files take its
    group). True if it was created."""
    if path.exists():
        return False
    path.mkdir(parents=True, exist_ok=True)
    if group is None:
        os.chmod(path, 0o700)
    else:
        os.chown(path, -1, group)
        os.chmod(path, 0o2770)
    return True


def diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What changed, setting by setting; one an experiment leaves out when it has its default is named so."""

    def shown(d: dict[str, Any], k: str) -> str:
        return repr(d[k]) if k in d else "the default"

    changes = [
        f"{k}: {shown(old, k)} -> {shown(new, k)}" for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)
    ]
    return "; ".join(changes)


def open_run(
    storage: Storage,
    cfg: RunConfig,
    *,
    experiment: dict[str, Any],
    intact: checkpoint_index.Intact,
    checks_contents: bool = False,
) -> RunDir:
    """Check the run directory against the experiment (the settings a resume must repeat) and settle the
    checkpoint it resumes from (``intact``: the workload's check of one; ``checks_contents``: it needs no
    manifest to tell a whole checkpoint). Nothing is changed yet (``begin`` does that), so a start that
    fails before training leaves no trace."""
    fs, root = storage.fs, storage.root
    path = posixpath.join(root, cfg.name)
    if isinstance(fs, pafs.LocalFileSystem):
        check_owned(Path(path), cfg.group_id)
    exists = fs.get_file_info(path).type == pafs.FileType.Directory
    moved = None
    if exists and cfg.fresh:
        moved = aside(path)
        refuse_move(fs, path, f"--fresh: run {cfg.name!r}")
        if isinstance(fs, pafs.LocalFileSystem):
            runlock.check_free(Path(path), cfg.name)
        exists = False
    meta_path = posixpath.join(path, RUN_META)
    workers = None
    if exists and fs.get_file_info(meta_path).type == pafs.FileType.File:
        old = read_json(fs, meta_path)
        workers = old.get("workers", old.get("config", {}).get("scale", {}).get("workers"))
        if old.get("fingerprint") != fingerprint(experiment):
            changed = diff(old["experiment"], experiment)
            raise UserError(
                f"run {cfg.name!r} in {root} was started with other settings ({changed}): "
                "repeat its settings to resume it, pick another --name, or add --fresh to start over "
                "(the old run is moved aside, not deleted)"
            )
    elif exists and fs.get_file_info(pafs.FileSelector(path)):
        raise UserError(
            f"{path} exists but is not a raytrain run: pick another --name or --storage, or move that directory away"
        )
    if exists and isinstance(fs, pafs.LocalFileSystem):
        runlock.check_free(Path(path), cfg.name)
    resume = (
        checkpoint_index.settle(fs, path, intact, checks_contents)
        if exists
        else checkpoint_index.ResumePoint(latest=None)
    )
    return RunDir(
        storage=storage,
        name=cfg.name,
        path=path,
        existed=exists,
        moved_aside=moved,
        resume=resume,
        workers=workers,
        intact=intact,
        checks_contents=checks_contents,
        group=cfg.group_id,
    )


@contextlib.contextmanager
def claimed(
    run: RunDir, *, experiment: dict[str, Any], settings: dict[str, Any], workers: int, echo: Callable[[str], None]
) -> Iterator[tuple[RunDir, runlock.Lock | None]]:
    """As training starts: hold the run's lock (``runlock``) and, under it only, move the old run aside
    (``--fresh``), create the run directory, settle again where it resumes from (another driver may have
    written to it since ``open_run`` looked), write Ray Train's index and record a new run's experiment and
    settings (and, on every attempt, its worker count). Yields the run as settled and the lock (None on
    filesystems without one); the lock is released, if still ours, on exit."""

    def begin() -> RunDir:
        return _begin(run, experiment=experiment, settings=settings, workers=workers, echo=echo)

    recording = f"recording run {run.name!r} in {run.path}"
    if not isinstance(run.fs, pafs.LocalFileSystem):  # no lock there; the old run is moved aside all the same
        if run.moved_aside:
            move_aside(run.fs, run.path, run.moved_aside, f"--fresh: run {run.name!r}")
        yield fsio.bounded(begin, recording, writes=True), None
        return
    lock = fsio.bounded(lambda: _take(run, echo), f"taking the lock of run {run.name!r} in {run.path}", writes=True)
    lock.start()
    try:
        yield fsio.bounded(begin, recording, writes=True), lock
    finally:
        lock.release()


def settled_again(run: RunDir) -> RunDir:
    """The run, held, after an attempt of this driver ended early (it yielded its room): where it resumes from
    now, settled as at its start (``_begin``)."""
    again = checkpoint_index.settle(run.fs, run.path, run.intact, run.checks_contents)
    checkpoint_index.apply(run.fs, run.path, again)
    return dataclasses.replace(run, existed=True, resume=again)


def _take(run: RunDir, echo: Callable[[str], None]) -> runlock.Lock:
    """The run's lock: with ``--fresh``, the old run's first (it moves aside, its lock with it), then the
    new directory's, made for the user alone (or the shared group)."""
    path = Path(run.path)
    if run.moved_aside:
        old = runlock.acquire(path, run.name, echo)
        try:
            _moved(run.fs, run.path, run.moved_aside, f"--fresh: run {run.name!r}")
        except BaseException:
            old.release()  # the old run stays where it was, and the lock with it
            raise
        # Moved: the lock went with the old run, and a lock here now is another driver's.
    created = _make(path, run.group)  # checkpoints and results are yours alone unless you share them
    check_owned(path, run.group)
    try:
        return runlock.acquire(path, run.name, echo)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()  # a start that fails before training leaves no run behind
        raise


# Filesystems that cannot move a directory (object stores: a key is copied, none renamed; Arrow's S3 and
# GCS filesystems move one object only).
_NO_DIRECTORY_MOVES = (pafs.S3FileSystem, pafs.GcsFileSystem)


def refuse_move(fs: pafs.FileSystem, path: str, what: str) -> None:
    """A UserError, before anything starts, where ``--fresh`` could not move ``path`` aside."""
    if isinstance(fs, _NO_DIRECTORY_MOVES):
        raise UserError(
            f"{what} cannot be moved aside on this storage ({type(fs).__name__} renames no directories): "
            f"pick another --name, or remove {path} yourself"
        )


def move_aside(fs: pafs.FileSystem, path: str, aside: str, what: str) -> None:
    """``--fresh``: the old run (or sweep) at ``path`` moved whole to ``aside`` before anything new is written,
    bounded as any storage call (``fsio.bounded``); a UserError where the storage cannot move a directory,
    which changes nothing."""
    fsio.bounded(lambda: _moved(fs, path, aside, what), f"moving {path} aside to {aside}", writes=True)


def _moved(fs: pafs.FileSystem, path: str, aside: str, what: str) -> None:
    try:
        fs.move(path, aside)
    except pa.ArrowNotImplementedError as exc:
        raise UserError(
            f"{what} could not be moved aside to {aside} ({uri.first_line(exc)}): pick another --name, or "
            "move it away yourself"
        ) from None
    except OSError:
        gone = fs.get_file_info(path).type == pafs.FileType.NotFound
        if gone and fs.get_file_info(aside).type == pafs.FileType.Directory:
            return  # moved, its answer lost (a retried NFS rename finds the source gone)
        raise  # the storage's own error: fsio.bounded names what it was doing


def _begin(
    run: RunDir,
    *,
    experiment: dict[str, Any],
    settings: dict[str, Any],
    workers: int,
    echo: Callable[[str], None] = print,
) -> RunDir:
    run.fs.create_dir(run.path, recursive=True)
    if run.existed:
        again = checkpoint_index.settle(run.fs, run.path, run.intact, run.checks_contents)
        if again.latest != run.resume.latest:
            echo(f"run: {run.path} changed since it was checked: resuming from {again.latest or 'scratch'}")
        run = dataclasses.replace(run, resume=again)
    checkpoint_index.apply(run.fs, run.path, run.resume)
    meta_path = run.file(RUN_META)
    if run.fs.get_file_info(meta_path).type != pafs.FileType.File:
        payload = {
            "name": run.name,
            "created": now(),
            "fingerprint": fingerprint(experiment),
            "experiment": experiment,
            "config": settings,
            "workers": workers,
        }
        write_json(run.fs, meta_path, payload)
    elif run.workers != workers:
        write_json(run.fs, meta_path, {**read_json(run.fs, meta_path), "workers": workers})
    return run
