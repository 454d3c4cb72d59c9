"""Which checkpoint a run resumes from: Ray Train's index, checked against what storage really holds.

Ray Train resumes a run from the newest checkpoint in its ``checkpoint_manager_snapshot.json``, and fails
hard when that file is damaged or names a directory that is gone (a scratch purge, a hand ``rm``); it has
no notion of a checkpoint cut short. Before a run starts again the service checks the index, newest
first, against each checkpoint's manifest (written by raytrain once Ray registered it: every file with its
size and CRC32) and the workload's own check, and settles on the newest intact checkpoint: when that is
not the index's latest, the index is rewritten to end there (a damaged index is kept aside, never
deleted, and rebuilt from the manifests). No checkpoint that verifies, where the run has some: the run
stops with what to do, and never silently starts over.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import posixpath
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from raytrain import fsio, ray_internals
from raytrain.contracts import rundir
from raytrain.contracts.rundir import MANIFEST, Manifest, Part
from raytrain.errors import UserError
from raytrain.service import checksums

Intact = Callable[[pafs.FileSystem, str], bool]  # the workload's own check of a checkpoint directory


@dataclass(frozen=True)
class ResumePoint:
    """latest: the checkpoint Ray Train will hand ``get_checkpoint()`` (None: the run starts afresh);
    skipped: newer ones that are missing or damaged (why: what is wrong with each); index: what Ray Train's
    index must say for that."""

    latest: str | None
    skipped: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)
    index: bytes | None = None  # a new checkpoint_manager_snapshot.json, when the present one must change
    index_damaged: bool = False  # the present index does not parse: keep it aside before replacing it
    # Whole checkpoints of the reports after the last Ray Train collected, in report order, up to the latest:
    # registered into the index (with their manifests) before the run starts.
    recovered: tuple[Uncollected, ...] = ()

    def notes(self) -> list[str]:
        """What a start tells its user of this: checkpoints passed over (and why), checkpoints recovered."""
        lines = []
        if self.skipped:
            names = "; ".join(f"{posixpath.basename(s)} ({self.why[s]})" for s in self.skipped)
            lines.append(f"passed over newer checkpoints that are missing or damaged (kept as they are): {names}")
        if found := self.recovered:
            names = ", ".join(posixpath.basename(f.path) for f in found)
            lines.append(
                f"{names} {'is' if len(found) == 1 else 'are'} whole, saved by every rank, but the last attempt "
                "ended before Ray Train collected it: recovered"
            )
        return lines


def manifest_of(
    fs: pafs.FileSystem, directory: str, metrics: dict[str, object], reported_at: float, recovered: bool = False
) -> Manifest:
    """The manifest of a registered checkpoint directory as it is now (``checksums.record``), naming the
    worker groups whose ranks' parts are in it."""
    files = checksums.record(fs, directory)
    groups = sorted({p.group for p in checksums.parts(fs, directory) if p.group})
    return Manifest(files=files, metrics=dict(metrics), reported_at=reported_at, recovered=recovered, groups=groups)


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    """A file's bytes, a transient storage error retried (``fsio``): FileNotFoundError when it is not there."""

    def read() -> bytes:
        with fs.open_input_stream(path) as f:
            return bytes(f.read())

    return fsio.retried(read, path)


def _info(fs: pafs.FileSystem, what: pafs.FileSelector | str | list[str]) -> Any:
    return fsio.retried(lambda: fs.get_file_info(what), str(getattr(what, "base_dir", what)))


def _read_manifest(fs: pafs.FileSystem, directory: str) -> Manifest | None:
    """A checkpoint's manifest; None when it has none, or one that does not parse."""
    try:
        return Manifest.from_bytes(_read(fs, posixpath.join(directory, MANIFEST)))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError, KeyError, TypeError):
        return None


def _stale(manifest: Manifest, found: list[Part]) -> bool:
    """Whether a later upload under the same name (a run that went back past a damaged checkpoint and saved
    it again) left parts of a worker group the manifest was not made from: then it describes files no
    longer there, and the ranks' parts speak for the directory."""
    return bool(manifest.groups) and any(p.group and p.group not in manifest.groups for p in found)


def _current_manifest(fs: pafs.FileSystem, directory: str, found: list[Part] | None = None) -> Manifest | None:
    """A checkpoint's manifest, unless it is stale (``_stale``); ``found``: its parts, read here if not given."""
    manifest = _read_manifest(fs, directory)
    if manifest is None:
        return None
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if _stale(manifest, checksums.parts(fs, directory) if found is None else found):
            return None
    return manifest


def damage(fs: pafs.FileSystem, directory: str, deep: bool = True, recorded: bool = False) -> str | None:
    """What makes a checkpoint not whole, in a few words; None when every file its manifest lists is there
    at its size and CRC32 (sizes only, unless ``deep``), and, where every rank writes part of it
    (``Part.every_rank``: raytrain's sharded saves), every rank of its worker group recorded its part;
    which ranks report any other checkpoint is the code's choice, not judged. With no manifest (it
    predates raytrain's manifests, or the attempt that registered it ended before writing one), the parts
    of every rank of one worker group stand for it; with neither, the workload decides, unless
    ``recorded`` (a checkpoint every rank writes part of): then it is an upload cut short. A manifest that
    a later upload under the same name made stale leaves the parts to judge, and a part missing there is
    an upload cut short."""
    if _info(fs, directory).type != pafs.FileType.Directory:
        return "it is gone"
    manifest = _read_manifest(fs, directory)
    found = checksums.parts(fs, directory)
    if manifest is not None and not _stale(manifest, found):
        if not manifest.files:
            return "it holds no files"
        own = [p for p in found if not manifest.groups or p.group in manifest.groups]
        if any(p.every_rank for p in own) and _whole_group(own, None) is None:
            return "not every rank recorded its part of it: a rank's upload did not finish"
        return checksums.damage(fs, directory, manifest, deep)
    group = _whole_group(found, None)
    if group is None:
        cut = recorded or manifest is not None  # a stale manifest: another upload under its name did not finish
        return "no manifest, and not every rank recorded its part: an upload cut short" if cut else None
    return checksums.uncollected_damage(fs, directory, group, deep)


checkpoint_damage = damage  # its public name: raytrain.checkpoint_damage


def _from_manifests(fs: pafs.FileSystem, run_dir: str) -> list[ray_internals.Registered]:
    """The run's checkpoints as their manifests describe them, oldest first (for a damaged index)."""
    found = []
    for info in _info(fs, pafs.FileSelector(run_dir, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and (m := _read_manifest(fs, info.path)) is not None:
            found.append((m.reported_at, posixpath.basename(info.path), m.metrics))
    return [ray_internals.Registered(name, metrics, i) for i, (_, name, metrics) in enumerate(sorted(found))]


def _subdirectories(fs: pafs.FileSystem, run_dir: str) -> list[pafs.FileInfo]:
    """The run's directories (its checkpoints, and uploads cut short), hidden ones left out."""
    entries = _info(fs, pafs.FileSelector(run_dir, allow_not_found=True))
    return [e for e in entries if e.type == pafs.FileType.Directory and not posixpath.basename(e.path).startswith(".")]


# An index that is there but cannot be read as one (a transient storage error is retried, never this).
_UNREADABLE = (ValueError, KeyError, TypeError, IsADirectoryError, NotADirectoryError)


def _read_index(fs: pafs.FileSystem, run_dir: str) -> tuple[list[ray_internals.Registered], int]:
    """Ray Train's index of the run: its checkpoints, oldest first, and how many reports it has seen.
    FileNotFoundError when there is none; one of ``_UNREADABLE`` when it is damaged."""
    return ray_internals.read_checkpoint_snapshot(_read(fs, posixpath.join(run_dir, ray_internals.CHECKPOINT_SNAPSHOT)))


def _reports_by_parts(fs: pafs.FileSystem, run_dir: str, kept: list[ray_internals.Registered]) -> int:
    """Which report (Ray Train's count, from 1) the newest of ``kept`` came with, by its ranks' parts; 0
    when none says (checkpoints from before parts, or with none)."""
    for k in reversed(kept):
        try:
            found = [p.report_index for p in checksums.parts(fs, posixpath.join(run_dir, k.dir_name))]
        except (FileNotFoundError, NotADirectoryError):
            continue
        if found:
            return max(found)
    return 0


def settle(fs: pafs.FileSystem, run_dir: str, intact: Intact, checks_contents: bool = False) -> ResumePoint:
    """Where the run resumes from, and the index Ray Train needs for that; a UserError if nothing verifies.
    A damaged index is rebuilt from the checkpoints' manifests; with none, a workload that checks contents
    itself (``checks_contents``) resumes from the newest checkpoint it finds whole (as with no index)."""
    path = posixpath.join(run_dir, ray_internals.CHECKPOINT_SNAPSHOT)
    damaged = counted = False  # counted: Ray's index says how many reports it collected
    try:
        kept, reports = _read_index(fs, run_dir)
        counted = True
    except FileNotFoundError:
        kept, reports = _from_manifests(fs, run_dir), 0
    except ray_internals.OutsideRun as exc:
        raise UserError(
            f"Ray Train's checkpoint index {path} is not the run's own: {exc}; someone who could write the run "
            "directory planted it: inspect the run, then restore the index or start over with --fresh"
        ) from None
    except _UNREADABLE:
        kept, reports, damaged = _from_manifests(fs, run_dir), 0, True
        if not kept and not checks_contents and _subdirectories(fs, run_dir):
            raise UserError(
                f"Ray Train's checkpoint index {path} is damaged and no checkpoint of the run carries a manifest "
                "to rebuild it from: restore that file, or start over with --fresh (the run is moved aside)"
            ) from None
    reports = max([reports, *(k.report_index + 1 for k in kept)])
    if not counted and (by_parts := _reports_by_parts(fs, run_dir, kept)):
        # Ray's index is gone or damaged: the ranks' parts of the newest checkpoint kept say which report it
        # came with, so the reports after it (uploaded, never collected) are still looked for.
        reports, counted = max(reports, by_parts), True
    skipped, why = [], {}
    # The last attempt ended before Ray Train collected every report (its saved count leaves out reports
    # made without a checkpoint: the walk passes over those).
    since = max((registered_at(fs, posixpath.join(run_dir, k.dir_name)) for k in kept), default=float("-inf"))
    lost = uncollected(fs, run_dir, reports + 1, since=since, registered={k.dir_name for k in kept}) if counted else []
    whole = [u for u in lost if u.damage is None]
    for found in whole:
        kept.append(ray_internals.Registered(posixpath.basename(found.path), found.metrics, found.report_index - 1))
        reports = found.report_index
    if len(whole) < len(lost) and kept:  # passed over, named; alone, it does not keep a run from starting
        skipped.append(lost[-1].path)
        why[lost[-1].path] = lost[-1].damage or ""
    while kept:
        newest = posixpath.join(run_dir, kept[-1].dir_name)
        wrong = damage(fs, newest) or (None if intact(fs, newest) else "its own check refuses it")
        if wrong is None:
            break
        skipped.append(newest)
        why[newest] = wrong
        kept.pop()
    if skipped and not kept:
        raise UserError(
            f"no checkpoint of run {run_dir} verifies (missing or damaged: "
            f"{'; '.join(f'{posixpath.basename(s)}: {why[s]}' for s in skipped)}): restore one, or start over "
            "with --fresh (the run is moved aside, not deleted)"
        )
    latest = posixpath.join(run_dir, kept[-1].dir_name) if kept else None
    names = {k.dir_name for k in kept}
    recovered = tuple(u for u in whole if posixpath.basename(u.path) in names)
    changed = bool(skipped) or damaged or recovered or (kept and _info(fs, path).type == pafs.FileType.NotFound)
    index = ray_internals.write_checkpoint_snapshot(kept, reports) if changed else None
    return ResumePoint(latest=latest, skipped=skipped, why=why, index=index, index_damaged=damaged, recovered=recovered)


@dataclass(frozen=True)
class Uncollected:
    """A checkpoint every rank entered the report for, that Ray Train's controller never collected (a rank
    died before it polled their reports: ray-project/ray#41700). damage: None when it is whole by its
    ranks' parts (it can be resumed from), else what is wrong."""

    path: str
    metrics: dict[str, Any]  # rank 0's metrics of the report
    at: float  # when rank 0's upload was done
    world_size: int  # of the worker group that made it
    damage: str | None
    report_index: int  # the run's how-many-th report it came with (Ray Train's count, from 1)


def uncollected(
    fs: pafs.FileSystem,
    run_dir: str,
    report_index: int,
    since: float = float("-inf"),
    registered: Collection[str] = (),
) -> list[Uncollected]:
    """The checkpoints of the run's reports from ``report_index`` on (the one after the last Ray Train
    collected: with asynchronous saves, several can be uploaded and not yet collected) that every rank of
    one worker group uploaded and recorded, and Ray Train never registered, in report order. Each was
    written after the one before it, the first after ``since`` (when the newest checkpoint Ray Train
    registered was uploaded, ``registered_at``): an earlier attempt's, left behind when the run went back
    past them, are not this one's sequel. Where several directories hold one report's, the newest by rank
    0's upload. A report no rank recorded a checkpoint for (one made without) is passed over; the list
    ends at a report that some rank recorded one for but not every rank of one worker group (an upload cut
    short: nothing tells whether the others meant to, so it stays unregistered, as Ray leaves it), or
    with the first that is not whole (its damage named). ``registered``: the directories in Ray Train's
    index, whose parts are not read."""
    listed = [
        (info.path, checksums.parts(fs, info.path))
        for info in _subdirectories(fs, run_dir)
        if posixpath.basename(info.path) not in registered  # in Ray's index: collected, not this walk's
    ]
    candidates = [(path, parts) for path, parts in listed if _current_manifest(fs, path, parts) is None]
    found: list[Uncollected] = []
    after = since

    def recorded(index: int) -> bool:
        return any(p.report_index == index and p.written_at > after for _, parts in candidates for p in parts)

    # The reports some rank recorded a checkpoint for since: any other is one made without a checkpoint.
    indices = sorted({p.report_index for _, parts in candidates for p in parts if p.written_at > after})
    for index in (i for i in indices if i >= report_index):
        groups = [
            (g, path)
            for path, parts in candidates
            if (g := _whole_group(parts, index)) is not None and g[0].written_at > after
        ]
        if not groups:
            if recorded(index):
                break
            continue
        parts, path = max(groups, key=lambda g: g[0][0].written_at)
        rank0 = parts[0]
        damage = checksums.uncollected_damage(fs, path, parts)
        found.append(Uncollected(path, rank0.metrics, rank0.written_at, rank0.world_size, damage, index))
        if damage is not None:
            break
        after = rank0.written_at
    return found


def registered_at(fs: pafs.FileSystem, directory: str) -> float:
    """When a registered checkpoint was uploaded, by its ranks' parts: rank 0's (the clock its successors'
    parts are stamped by), else the earliest of the others'. With none (it predates parts, or their write
    failed), -inf: when Ray registered it says nothing of when its successors were written, and a later
    registration would hide them."""
    try:
        stamped = [p for p in checksums.parts(fs, directory) if p.written_at]
    except (FileNotFoundError, NotADirectoryError):
        return float("-inf")  # gone: settle passes it over
    rank0 = [p.written_at for p in stamped if p.rank == 0]
    return (rank0 or [min((p.written_at for p in stamped), default=float("-inf"))])[0]


def _whole_group(parts: list[Part], report_index: int | None) -> list[Part] | None:
    """The parts (``checksums.parts`` of one directory) every rank of one worker group recorded for one
    report (``report_index``, or whichever rank 0's is), rank 0's first; None when a rank's is missing or
    from another group."""
    by_rank = {p.rank: p for p in parts if report_index in (None, p.report_index)}
    rank0 = by_rank.get(0)
    if rank0 is None or rank0.world_size < 1:
        return None
    group = [by_rank.get(r) for r in range(rank0.world_size)]
    whole = [p for p in group if p is not None and p.group == rank0.group and p.report_index == rank0.report_index]
    return whole if len(whole) == rank0.world_size else None


def cut_short(
    fs: pafs.FileSystem,
    run_dir: str,
    since: float,
    own: Sequence[str] = (),
    intact: Callable[[pafs.FileSystem, str], bool] | None = None,
) -> list[str]:
    """Directories of the run written since ``since`` that Ray Train never registered as checkpoints (not
    in its index, no manifest; ``own``: names the workload keeps there itself, besides the service's own
    ``rundir.SERVICE_DIRS``) and that the workload's own check (``intact``) does not find whole: uploads cut
    short by a failure, such as a full disk. Never resumed from; left in place for the user to delete. (A
    whole checkpoint that Ray failed to register, its index write cut short, is resumed from, and so is one
    that every rank of a worker group uploaded and recorded before Ray Train collected it.)"""
    own = (*own, *rundir.SERVICE_DIRS)
    try:
        registered = {k.dir_name for k in _read_index(fs, run_dir)[0]}
    except (FileNotFoundError, *_UNREADABLE):
        registered = set()
    return sorted(
        info.path
        for info in _subdirectories(fs, run_dir)
        if posixpath.basename(info.path) not in registered
        and posixpath.basename(info.path) not in own
        and info.mtime is not None
        and info.mtime.timestamp() >= since
        and _read_manifest(fs, info.path) is None
        and not (intact is not None and intact(fs, info.path))
        and _whole_group(checksums.parts(fs, info.path), None) is None
    )


def write_manifest(
    fs: pafs.FileSystem, directory: str, metrics: dict[str, Any], reported_at: float, recovered: bool = False
) -> None:
    """Record a registered checkpoint as it is now: its manifest, written through a temporary name."""
    manifest = manifest_of(fs, directory, metrics, reported_at, recovered)
    path = posixpath.join(directory, MANIFEST)
    with fs.open_output_stream(f"{path}.tmp") as out:
        out.write(manifest.to_bytes())
    fs.move(f"{path}.tmp", path)


def apply(fs: pafs.FileSystem, run_dir: str, point: ResumePoint) -> None:
    """Write the index ``settle`` decided on (a damaged one is moved aside first, never deleted), then the
    manifests of the checkpoints it recovered: the order Ray Train and raytrain's callback register one in
    (a start cut short in between leaves a checkpoint in the index whose parts vouch for it, ``damage``)."""
    if point.index is None:
        return
    path = posixpath.join(run_dir, ray_internals.CHECKPOINT_SNAPSHOT)
    if point.index_damaged:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        with contextlib.suppress(FileNotFoundError):
            fs.move(path, f"{path}.damaged-{stamp}")
    tmp = f"{path}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(point.index)
    fs.move(tmp, path)
    for found in point.recovered:
        write_manifest(fs, found.path, found.metrics, found.at, recovered=True)
