"""Checkpoint contents, and finding the newest intact one.

A checkpoint is a directory ``epoch_0003`` (or ``epoch_0003_step_000120`` when taken mid-epoch on a
preemption signal) under the run directory, holding ``state.pt`` (model, optimizer, scheduler, progress,
config, RNG states) and ``meta.json`` (progress, metrics, and the size and CRC32 of ``state.pt``); one
taken mid-epoch also holds ``trained_rows.npy``, the ids of the rows that epoch has trained, so the
resumed epoch trains each of the others once. A sharded run's (``--strategy fsdp``, ``"sharded"`` in
``meta.json``) keeps its model and optimizer in every rank's shard of a torch distributed checkpoint
beside them (``raytrain.save_sharded``), whose sizes and CRC32s the service records; its ``state.pt``
holds the rest. Ray copies files
into storage without making the copy atomic, so a checkpoint only counts once ``meta.json`` parses and
``state.pt`` matches it; otherwise the next older one is used. The CRC is computed while ``torch.save``
streams to disk, so writing a checkpoint costs what a plain ``torch.save`` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import posixpath
import re
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import pyarrow.fs as pafs

from raytrain import fsio, uri

if TYPE_CHECKING:
    import torch

STATE = "state.pt"
META = "meta.json"
DCP_METADATA = ".metadata"  # a sharded checkpoint's: torch distributed checkpoint's, from rank 0
# <run>/best/epoch_0007: a copy of the checkpoint with the best validation accuracy so far (hard links
# where the filesystem has them: no second copy of the bytes), kept whatever --keep rotates out; its
# score is the "val_acc" in its meta.json.
BEST = "best"
SCORE = "val_acc"
# What the recipe keeps in a run directory besides checkpoints: the best one (and its replacement under
# way), and what `raytrain evaluate` and `export` write.
OWN_DIRS = (BEST, f"{BEST}.partial", f"{BEST}.old", "eval", "export")
TRAINED = "trained_rows.npy"  # a mid-epoch checkpoint: the row ids that epoch has trained (all ranks)
_NAME = re.compile(r"^epoch_(\d{4,})(?:_step_(\d+))?$")


def name(epoch: int, batches_done: int = 0) -> str:
    """The directory name for a checkpoint taken after ``epoch`` full epochs and ``batches_done`` more."""
    return f"epoch_{epoch:04d}" + (f"_step_{batches_done:06d}" if batches_done else "")


def parse_name(dirname: str) -> tuple[int, int] | None:
    m = _NAME.match(dirname)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def digest(state: dict[str, Any]) -> str:
    """A short digest of an optimizer (or any) state dict's tensors and values, order-stable."""
    import torch

    h = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            # reshape, not contiguous(): a channels_last (C, K, 1, 1) weight counts as contiguous but keeps a
            # last stride of K, which a byte view refuses; reshape(-1) gives the same bytes in logical order.
            h.update(obj.detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                feed(obj[k])
        elif isinstance(obj, list | tuple):
            for v in obj:
                feed(v)
        else:
            h.update(repr(obj).encode())

    feed(state)
    return h.hexdigest()[:16]


class _Checksummed:
    """A write-only file wrapper that keeps the running CRC32 and size of what passes through."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write(directory: Path, state: dict[str, Any], meta: dict[str, Any], trained: np.ndarray | None = None) -> None:
    """Write ``state.pt`` (and ``trained_rows.npy``), then ``meta.json``, which records their sizes and CRC32s."""
    import torch

    with open(directory / STATE, "wb") as f:
        out = _Checksummed(f)
        torch.save(state, out)  # type: ignore[arg-type]
    meta = {**meta, "state_bytes": out.size, "state_crc32": out.crc}
    if trained is not None:
        blob = _npy(trained)
        (directory / TRAINED).write_bytes(blob)
        meta |= {"trained_rows": len(trained), "trained_bytes": len(blob), "trained_crc32": zlib.crc32(blob)}
    (directory / META).write_text(json.dumps(meta, indent=1, sort_keys=True))


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def trained_rows(fs: pafs.FileSystem, found: Found) -> np.ndarray | None:
    """The row ids a mid-epoch checkpoint's epoch has trained; None when it records none (an epoch-end
    checkpoint, or one from before raytrain kept them). ValueError if the file does not match its CRC."""
    if "trained_crc32" not in found.meta:
        return None
    blob = _read(fs, posixpath.join(found.path, TRAINED))
    if zlib.crc32(blob) != found.meta["trained_crc32"]:
        raise ValueError(f"{found.path}/{TRAINED} does not match the CRC32 in its {META}")
    ids: np.ndarray = np.load(io.BytesIO(blob), allow_pickle=False)
    return ids


@dataclass(frozen=True)
class Found:
    path: str
    epoch: int
    batches_done: int
    meta: dict[str, Any]


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    """A file's bytes; a transient storage error is tried again (``raytrain.fsio``), never taken for damage."""

    def read() -> bytes:
        with fs.open_input_stream(path) as f:
            return bytes(f.read())

    return fsio.retried(read, path)


_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _read_meta(fs: pafs.FileSystem, directory: str) -> dict[str, Any] | None:
    """A checkpoint's metadata if it parses and ``state.pt`` has the size it records; None otherwise."""
    try:
        meta = json.loads(_read(fs, posixpath.join(directory, META)))
        size = fsio.retried(lambda: fs.get_file_info(posixpath.join(directory, STATE)).size, directory)
    except (*_MISSING, ValueError):
        return None
    if not isinstance(meta, dict) or size != meta.get("state_bytes"):
        return None
    return meta


def found_at(fs: pafs.FileSystem, path: str) -> Found | None:
    """The checkpoint in directory ``path``, if its files are complete (size check)."""
    parsed = parse_name(posixpath.basename(path))
    meta = _read_meta(fs, path) if parsed else None
    if parsed is None or meta is None:
        return None
    return Found(path=path, epoch=parsed[0], batches_done=parsed[1], meta=meta)


def _shards_damage(fs: pafs.FileSystem, found: Found, deep: bool = False) -> str | None:
    """For a sharded checkpoint, what is wrong with its shards against the service's record of every
    rank's files: by size, and by CRC32 when ``deep`` (a run's start checks them all); None when whole,
    or not sharded."""
    import raytrain

    if not found.meta.get("sharded"):
        return None
    if fsio.retried(lambda: fs.get_file_info(posixpath.join(found.path, DCP_METADATA)), found.path).size is None:
        return f"{DCP_METADATA} is missing"
    damage: str | None = raytrain.checkpoint_damage(fs, found.path, deep=deep, recorded=True)
    return damage


def verify(fs: pafs.FileSystem, path: str) -> bool:
    """Whether the checkpoint in ``path`` is complete and its state matches the CRC32 in its metadata
    (a sharded one's shards: by size)."""
    found = found_at(fs, path)
    if found is None or _shards_damage(fs, found) is not None:
        return False

    def crc() -> int:
        with fs.open_input_stream(posixpath.join(found.path, STATE)) as f:
            value = 0
            while chunk := f.read(1 << 22):
                value = zlib.crc32(chunk, value)
            return value

    try:
        if fsio.retried(crc, posixpath.join(found.path, STATE)) != found.meta.get("state_crc32"):
            return False
        trained_rows(fs, found)
    except (*_MISSING, ValueError):
        return False
    return True


def candidates(fs: pafs.FileSystem, run_dir: str) -> list[tuple[int, int, str]]:
    """Checkpoint directories of a run, newest first, by (epoch, batches) parsed from their names."""
    try:
        entries = fsio.retried(lambda: fs.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True)), run_dir)
    except _MISSING:
        return []
    found = []
    for e in entries:
        parsed = parse_name(posixpath.basename(e.path)) if e.type == pafs.FileType.Directory else None
        if parsed:
            found.append((parsed[0], parsed[1], e.path))
    return sorted(found, reverse=True)


def latest(fs: pafs.FileSystem, run_dir: str) -> Found | None:
    """The newest checkpoint whose files are complete (size check; contents are verified on load)."""
    for epoch, batches, path in candidates(fs, run_dir):
        meta = _read_meta(fs, path)
        if meta is not None:
            return Found(path=path, epoch=epoch, batches_done=batches, meta=meta)
    return None


def load(fs: pafs.FileSystem, found: Found, device: torch.device) -> dict[str, Any]:
    """The verified state of a checkpoint; raises ValueError if its contents do not match its metadata."""
    blob = _read(fs, posixpath.join(found.path, STATE))
    if zlib.crc32(blob) != found.meta.get("state_crc32"):
        raise ValueError(f"{found.path}/{STATE} does not match the CRC32 in its {META}")
    import torch

    state: dict[str, Any] = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)
    return state


@contextlib.contextmanager
def local_directory(fs: pafs.FileSystem, path: str) -> Iterator[str]:
    """A checkpoint directory as a local path: itself on a local (or NFS, Lustre) file system, else a
    temporary copy, removed afterwards (torch's distributed checkpoint reads local files)."""
    if isinstance(fs, pafs.LocalFileSystem):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="rt-ckpt-") as copy:
        pafs.copy_files(path, copy, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield copy


def model_weights(fs: pafs.FileSystem, found: Found, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole model of a checkpoint, on the CPU: ``state.pt``'s (``state``, when already loaded), or
    a sharded checkpoint's, gathered from every rank's shard. ValueError if it is damaged."""
    if not found.meta.get("sharded"):
        import torch

        model: dict[str, Any] = (state or load(fs, found, torch.device("cpu")))["model"]
        return model
    from torch.distributed.checkpoint.api import CheckpointException

    import raytrain

    if (wrong := _shards_damage(fs, found, deep=True)) is not None:  # read whole anyway: every byte checked
        raise ValueError(f"{found.path}: {wrong}")
    with local_directory(fs, found.path) as directory:
        try:
            weights: dict[str, Any] = raytrain.full_weights(directory)
        except CheckpointException as exc:  # torch's reader wraps every rank's error in one (a BaseException)
            raise ValueError(f"{found.path} does not read as a sharded checkpoint ({uri.first_line(exc)})") from None
        return weights


def load_newest_intact(
    fs: pafs.FileSystem, run_dir: str, device: torch.device, *, not_after: tuple[int, int] | None = None
) -> tuple[Found, dict[str, Any], list[str]] | None:
    """Load the newest checkpoint that verifies, skipping damaged ones; also returns what was skipped."""
    skipped = []
    for epoch, batches, path in candidates(fs, run_dir):
        if not_after is not None and (epoch, batches) > not_after:
            continue
        meta = _read_meta(fs, path)
        if meta is None:
            skipped.append(path)
            continue
        found = Found(path=path, epoch=epoch, batches_done=batches, meta=meta)
        if _shards_damage(fs, found) is not None:
            skipped.append(path)
            continue
        try:
            return found, load(fs, found, device), skipped
        except (ValueError, RuntimeError, EOFError, *_MISSING):  # damaged; a failing storage raises StorageError
            skipped.append(path)
    return None


def _is_dir(fs: pafs.FileSystem, path: str) -> bool:
    return bool(fs.get_file_info(path).type == pafs.FileType.Directory)


def best(fs: pafs.FileSystem, run_dir: str) -> Found | None:
    """The run's best checkpoint so far (complete, by size), if it keeps one."""
    for directory in (BEST, f"{BEST}.old"):  # .old: a replacement was cut short between its two moves
        for _, _, path in candidates(fs, posixpath.join(run_dir, directory)):
            found = found_at(fs, path)
            if found is not None:
                return found
    return None


def _link_or_copy(fs: pafs.FileSystem, source: str, target: str) -> None:
    """``target``: a directory of hard links to the files of ``source`` on a local (or NFS, Lustre) file
    system, so a best checkpoint costs no space while --keep still holds it; else a copy."""
    import os

    fs.create_dir(target, recursive=True)
    if isinstance(fs, pafs.LocalFileSystem):
        try:
            for entry in os.scandir(source):
                os.link(entry.path, os.path.join(target, entry.name))
            return
        except OSError:  # a file system without hard links (or across devices): copy instead
            fs.delete_dir_contents(target)
    pafs.copy_files(source, target, source_filesystem=fs, destination_filesystem=fs)


def keep_best(fs: pafs.FileSystem, run_dir: str, path: str) -> Found | None:
    """Copy the checkpoint in ``path`` to ``<run>/best`` when it scores higher than the one kept there;
    the copy is verified before it replaces the old one. Returns the new best, or None."""
    new = found_at(fs, path)
    if new is None or new.meta.get(SCORE) is None:
        return None
    target, partial, previous = (posixpath.join(run_dir, d) for d in (BEST, f"{BEST}.partial", f"{BEST}.old"))
    if not _is_dir(fs, target) and _is_dir(fs, previous):
        fs.move(previous, target)  # finish a replacement that was cut short
    old = best(fs, run_dir)
    if old is not None and old.meta.get(SCORE) is not None and old.meta[SCORE] >= new.meta[SCORE]:
        return None
    for leftover in (partial, previous):
        if _is_dir(fs, leftover):
            fs.delete_dir(leftover)
    copy = posixpath.join(partial, posixpath.basename(path))
    try:
        _link_or_copy(fs, path, copy)
        intact = verify(fs, copy)
    except OSError:
        fs.delete_dir(partial)  # a full disk, say: nothing half-written stays behind
        raise
    if not intact:
        fs.delete_dir(partial)
        return None
    if _is_dir(fs, target):
        fs.move(target, previous)
    fs.move(partial, target)
    if _is_dir(fs, previous):
        fs.delete_dir(previous)
    return found_at(fs, posixpath.join(target, posixpath.basename(path)))


def named_by(fs: pafs.FileSystem, path: str, *, best_first: bool = True) -> Found | None:
    """The checkpoint ``path`` names: itself when it is one, else the run's best (with ``best_first``) or
    its newest complete one."""
    return found_at(fs, path) or (best(fs, path) if best_first else None) or latest(fs, path)
