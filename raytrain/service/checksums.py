"""A checkpoint's files by size and CRC32: recorded by the ranks that uploaded them, merged into the
checkpoint's manifest once Ray Train has registered it, and checked before a run resumes from it.

A sharded checkpoint (``torch.distributed.checkpoint``: a file or more from every rank, and the
coordinator's ``.metadata``) is whole only when every rank's files arrived as they were written. Sizes
alone miss a shard overwritten in place, and DCP loads such a shard without a word, so every file is
recorded with its CRC32. Each rank sums its own files just after its upload (``Part``, in parallel, while
they are still in the page cache), so no process reads a large checkpoint whole to record it; the
controller sums only what no rank recorded (a checkpoint written straight into storage, or a custom
upload function). Reads tick ``fsio.answered`` per chunk, so a long check of a large checkpoint is
bounded by storage that stops answering, not by its size.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from raytrain import fsio
from raytrain.contracts import rundir
from raytrain.contracts.rundir import FileSum, Manifest, Part

if TYPE_CHECKING:
    from raytrain.ray_internals import Upload

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # bytes read at a time (zlib.crc32 lets go of the GIL on a buffer this size)
THREADS = 4  # files summed at once
UNRECORDED_SUM_LIMIT = 256 << 20  # bytes the controller reads to sum files no rank recorded; past it, sizes only
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's record of every rank's files (rank 0 writes it)


def own(relative: str) -> bool:
    """Whether a file in a checkpoint directory is raytrain's record of it, not part of it."""
    return posixpath.basename(relative).startswith(rundir.OWN_FILE_PREFIX)


def sum_file(fs: pafs.FileSystem, path: str) -> FileSum:
    """The size and CRC32 of a file as storage holds it now (a transient error: read again from the start)."""

    def read() -> FileSum:
        crc, size = 0, 0
        with fs.open_input_stream(path) as f:
            while chunk := f.read(CHUNK):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
                fsio.answered()
        return FileSum(size=size, crc32=crc)

    return fsio.retried(read, path)


def sum_files(fs: pafs.FileSystem, directory: str, names: Iterable[str]) -> dict[str, FileSum]:
    """``sum_file`` of each of ``names`` (relative to ``directory``), a few at a time, in daemon threads:
    a read stalled on a hung mount must not keep the process from exiting once ``fsio.bounded`` has
    given up on it (an executor's threads are joined at exit)."""
    names = list(names)
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for name in names:
        todo.put(name)
    sums: dict[str, FileSum] = {}
    errors: list[BaseException] = []

    def work() -> None:
        while not errors:
            try:
                name = todo.get_nowait()
            except queue.Empty:
                return
            try:
                sums[name] = sum_file(fs, posixpath.join(directory, name))
            except BaseException as exc:  # handed to the caller
                errors.append(exc)

    threads = [threading.Thread(target=work, name="raytrain-crc", daemon=True) for _ in range(min(THREADS, len(names)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {name: sums[name] for name in names}


def listing(fs: pafs.FileSystem, directory: str) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> size), raytrain's own records left out."""
    infos = fsio.retried(lambda: fs.get_file_info(pafs.FileSelector(directory, recursive=True)), directory)
    return {
        rel: int(i.size)
        for i in infos
        if i.type == pafs.FileType.File and not own(rel := posixpath.relpath(i.path, directory))
    }


def write_part(fs: pafs.FileSystem, directory: str, part: Part) -> None:
    """Put a rank's part into the checkpoint directory (through a temporary name: a part is whole or absent)."""
    path = posixpath.join(directory, rundir.part_name(part.rank))
    tmp = f"{path}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(part.to_bytes())
    fs.move(tmp, path)


_guard = threading.local()  # the check of the run's lock, for the upload under way in this thread


@contextlib.contextmanager
def guarded(check: Callable[[], None] | None) -> Iterator[None]:
    """Around a checkpoint upload: ``record_upload`` in it first calls ``check`` (it raises once the run is
    another driver's), however the upload is made (Ray Train's copy, or an upload function of its own)."""
    before = getattr(_guard, "check", None)
    _guard.check = check
    try:
        yield
    finally:
        _guard.check = before


def record_upload(upload: Upload, every_rank: bool = False) -> None:
    """Write what a rank uploaded into the checkpoint, summed from its own copy (just written, so read
    from the page cache). Without it the controller sums those files itself: training goes on. Within
    ``guarded``, none is written once the run is another driver's: a whole set of parts makes a
    checkpoint recoverable by whoever holds the run. ``every_rank``: every rank of the group writes part
    of this checkpoint (``Part.every_rank``)."""
    if (check := getattr(_guard, "check", None)) is not None:
        check()
    try:
        names = listing(upload.source_fs, upload.source)
        part = Part(
            rank=upload.rank,
            files=sum_files(upload.source_fs, upload.source, names),
            world_size=upload.world_size,
            report_index=upload.report_index,
            metrics=upload.metrics,
            written_at=time.time(),
            group=upload.group,
            every_rank=every_rank,
        )
        write_part(upload.fs, upload.destination, part)
    except Exception:
        log.warning("raytrain: rank %d could not record its part of %s", upload.rank, upload.destination, exc_info=True)


def parts(fs: pafs.FileSystem, directory: str) -> list[Part]:
    """The ranks' parts in a checkpoint directory (one that does not parse counts as none)."""
    found = []
    infos = fsio.retried(lambda: fs.get_file_info(pafs.FileSelector(directory)), directory)
    for info in infos:
        name = posixpath.basename(info.path)
        if info.type != pafs.FileType.File or not name.startswith(rundir.PART_PREFIX) or not name.endswith(".json"):
            continue
        try:
            with fs.open_input_stream(info.path) as f:
                found.append(Part.from_bytes(f.read()))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue
    return found


def record(fs: pafs.FileSystem, directory: str) -> dict[str, FileSum]:
    """Every file of a registered checkpoint with its size and CRC32: as the ranks' parts have it where they
    agree with each other and with the size storage holds, otherwise summed here. A file a part names that
    is not there is kept as recorded, so the checkpoint is not whole."""
    present = listing(fs, directory)
    recorded: dict[str, set[FileSum]] = {}
    for part in parts(fs, directory):
        for name, s in part.files.items():
            recorded.setdefault(name, set()).add(s)
    files: dict[str, FileSum] = {}
    unsummed = []
    for name in sorted(present.keys() | recorded.keys()):
        sums = recorded.get(name, set())
        if len(sums) == 1 and (only := next(iter(sums))).size == present.get(name, only.size):
            files[name] = only
        elif name in present:
            unsummed.append(name)  # no rank recorded it, ranks disagree, or another upload replaced it
        else:
            files[name] = max(sums, key=lambda s: s.size)
    if sum(present[n] for n in unsummed) > UNRECORDED_SUM_LIMIT:  # the controller does not read a large
        return files | {n: FileSum(size=present[n], crc32=None) for n in unsummed}  # checkpoint: sizes only
    return files | sum_files(fs, directory, unsummed)


def damage(fs: pafs.FileSystem, directory: str, manifest: Manifest, deep: bool = True) -> str | None:
    """What makes a checkpoint not whole against its manifest, in a few words (None: whole). Sizes are
    checked first; ``deep`` also reads every file with a recorded CRC32."""
    names = list(manifest.files)
    paths = [posixpath.join(directory, n) for n in names]
    infos = fsio.retried(lambda: fs.get_file_info(paths), directory)
    for name, info in zip(names, infos, strict=True):
        want = manifest.files[name].size
        if info.type != pafs.FileType.File:
            return f"{name} is missing"
        if info.size != want:
            return f"{name} holds {info.size} bytes of {want}"
    if not deep:
        return None
    summed = [n for n in names if manifest.files[n].crc32 is not None]
    for name, found in sum_files(fs, directory, summed).items():
        if found.crc32 != manifest.files[name].crc32:
            recorded = manifest.files[name].crc32
            return f"{name} is not as it was written: CRC32 {found.crc32:08x}, recorded {recorded:08x}"
    # A distributed checkpoint is whole only with every file its metadata names. The metadata is a pickle:
    # read only once it is known to be the file a rank of the run recorded (its CRC32 checked just above).
    if manifest.files.get(DCP_METADATA, FileSum(size=0, crc32=None)).crc32 is None:
        return None
    try:
        written = _dcp_files(fs, directory)
    except OSError:
        raise  # the storage's error, not the checkpoint's
    except Exception as exc:  # torch's own reader: whatever else it raises, the metadata is not usable
        return f"{DCP_METADATA} does not read as torch's checkpoint metadata ({type(exc).__name__})"
    if written is not None and (lacking := sorted(written - manifest.files.keys())):
        return f"{lacking[0]} is missing (torch's checkpoint metadata names it; its rank's copy failed)"
    return None


def _dcp_files(fs: pafs.FileSystem, directory: str) -> set[str] | None:
    """The files a ``torch.distributed.checkpoint`` checkpoint's ``.metadata`` says its ranks wrote; None
    when the directory is not one (no metadata), or not on a filesystem torch reads."""
    metadata = fs.get_file_info(posixpath.join(directory, DCP_METADATA))
    if not isinstance(fs, pafs.LocalFileSystem) or metadata.type != pafs.FileType.File:
        return None
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    storage = FileSystemReader(directory).read_metadata().storage_data or {}
    return {str(info.relative_path) for info in storage.values()}


def uncollected_damage(fs: pafs.FileSystem, directory: str, found: list[Part], deep: bool = True) -> str | None:
    """Whether a checkpoint directory Ray Train never collected, one part from each rank of one worker
    group (``found``), is whole by those parts (None) or what is wrong: every file a part names is there
    at its size and CRC32, ranks that uploaded one name agree on it, and in a
    ``torch.distributed.checkpoint`` every file its metadata names came with a part."""
    files: dict[str, FileSum] = {}
    for part in found:
        for name, s in part.files.items():
            if files.setdefault(name, s) != s:
                return f"ranks uploaded {name} with different contents"
    try:
        written = _dcp_files(fs, directory)
    except Exception as exc:  # torch's own reader: whatever it raises, the metadata is not usable
        return f"{DCP_METADATA} does not read as torch's checkpoint metadata ({type(exc).__name__})"
    if written is not None and (unrecorded := sorted(written - files.keys())):
        return f"{unrecorded[0]} came with no rank's part (its upload did not finish)"
    return damage(fs, directory, Manifest(files=files, metrics={}, reported_at=0.0), deep)
