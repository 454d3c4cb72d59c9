"""Which Parquet files of a dataset hold which split, from their paths.

A dataset is one Parquet file (all training data), or a directory. In a directory, a file belongs to the
split its path names, in a directory (``train/part-0.parquet``, ``val/...``, as ``raytrain prepare`` writes)
or at the start of its file name (``train-00000-of-00002.parquet``, ``validation-00000-of-00001.parquet``, as
Hugging Face ``datasets`` writes them, also under ``data/`` or ``<config>/``). Validation is the
``validation``/``val``/``valid`` split, else ``test`` (many Hugging Face sets have only train and test).
A directory that names no split at all is training data throughout.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from raytrain.errors import UserError

PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")
TRAIN = "train"
_SPLIT = re.compile(r"^(train|training|validation|valid|val|dev|test|testing)(?=$|[-_.\d])", re.IGNORECASE)
_CANONICAL = {"training": TRAIN, "validation": "val", "valid": "val", "dev": "val", "testing": "test"}
# Where validation rows come from, by preference.
_VALIDATION = ("val", "test")


@dataclass(frozen=True)
class Layout:
    train: tuple[str, ...]
    val: tuple[str, ...]
    val_split: str | None  # the split validation comes from ("val", "test"), None: held out of train by hash
    named_by: str | None  # how the splits were found: "directories" or "file names"; None for no split


def split_of(relpath: str) -> tuple[str | None, str | None]:
    """The split a path inside the dataset names (train, val or test) and whether a directory or the file
    name says so; ``(None, None)`` when it names none."""
    parts = relpath.split("/")
    for i, part in enumerate(parts):
        m = _SPLIT.match(part)
        if m:
            name = m.group(1).lower()
            return _CANONICAL.get(name, name), "file names" if i == len(parts) - 1 else "directories"
    return None, None


def _files(fs: pafs.FileSystem, path: str, shown: str, hint: str) -> list[str]:
    entries = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = sorted(
        e.path
        for e in entries
        if e.type == pafs.FileType.File
        and not any(part.startswith((".", "_")) for part in posixpath.relpath(e.path, path).split("/"))
    )
    parquet = [f for f in files if f.endswith(PARQUET_SUFFIXES)]
    if not parquet:
        what = f"{len(files)} file(s), none ending in .parquet" if files else "no files"
        raise UserError(f"--data {shown} holds {what}: point --data at Parquet data ({hint})")
    return parquet


def find(fs: pafs.FileSystem, path: str, shown: str, hint: str) -> Layout:
    """The dataset's training and validation files, or a one-line UserError."""
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"--data {shown} does not exist: give a Parquet file or directory ({hint})")
    if info.type == pafs.FileType.File:
        return Layout(train=(path,), val=(), val_split=None, named_by=None)
    splits: dict[str | None, list[str]] = {}
    how: set[str] = set()
    for f in _files(fs, path, shown, hint):
        split, named_by = split_of(posixpath.relpath(f, path))
        splits.setdefault(split, []).append(f)
        if named_by:
            how.add(named_by)
    if set(splits) == {None}:
        return Layout(train=tuple(splits[None]), val=(), val_split=None, named_by=None)
    if TRAIN not in splits:
        named = ", ".join(sorted(s for s in splits if s))
        raise UserError(
            f"--data {shown} has {named} files but no training split: name the training files train-*.parquet "
            f"or put them in {shown}/train/"
        )
    if None in splits:
        stray = posixpath.relpath(splits[None][0], path)
        raise UserError(
            f"--data {shown} names its splits, but {stray} (and {len(splits[None]) - 1} more) is in none: "
            "name every file by its split (train-*, validation-*, test-*) or move it out"
        )
    val_split = next((s for s in _VALIDATION if s in splits), None)
    return Layout(
        train=tuple(splits[TRAIN]),
        val=tuple(splits[val_split]) if val_split else (),
        val_split=val_split,
        named_by=" and ".join(sorted(how)),
    )
