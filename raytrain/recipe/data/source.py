"""Checking a Parquet dataset before any Ray worker starts.

A dataset is a Parquet file, or a directory of them (``train/`` and ``val/`` subdirectories when it has a
split), on any filesystem pyarrow knows (local path, ``file://``, ``s3://``, ``gs://``, ``hdfs://``). Every row
holds an encoded image (``image``: binary) and its class (``label``: integer). Only footers and the label
column are read here, so a bad path, a non-Parquet file or a wrong column fails in seconds.
"""

from __future__ import annotations

import io
import json
import posixpath
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain import uri as uris
from raytrain.errors import UserError

IMAGE = "image"
LABEL = "label"
METADATA_KEY = b"raytrain"
HINT = "make one with `raytrain prepare IMAGE_DIR OUT`"
PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")


@dataclass(frozen=True)
class DataSource:
    """A checked dataset: its files, its size and what its metadata says."""

    uri: str
    filesystem: pafs.FileSystem
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    train_rows: int
    val_rows: int
    num_classes: int
    classes: tuple[str, ...] | None
    image_size: int | None  # from the metadata, else measured on the first images
    image_size_measured: bool = False  # image_size was read off the images, not the metadata
    unlabelled: int = 0  # rows whose label is null: training leaves them out


def _list_parquet(fs: pafs.FileSystem, path: str, shown: str) -> list[str]:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"--data {shown} does not exist: give a Parquet file or directory ({HINT})")
    if info.type == pafs.FileType.File:
        return [path]
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
        raise UserError(f"--data {shown} holds {what}: point --data at Parquet data ({HINT})")
    return parquet


def _footer(fs: pafs.FileSystem, path: str) -> pq.FileMetaData:
    try:
        with fs.open_input_file(path) as f:
            return pq.read_metadata(f)
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"{path} is not a readable Parquet file ({uris.first_line(exc)}): {HINT}") from None


def _check_schema(path: str, schema: pa.Schema) -> None:
    names = schema.names
    for column, wanted in ((IMAGE, "encoded image bytes (binary)"), (LABEL, "an integer class index")):
        if column not in names:
            raise UserError(
                f"{path} has no {column!r} column (it has: {', '.join(names) or 'none'}); "
                f"expected 'image' (encoded image bytes) and 'label' (integer class): {HINT}"
            )
        typ = schema.field(column).type
        binary = pa.types.is_binary(typ) or pa.types.is_large_binary(typ)
        if not (binary if column == IMAGE else pa.types.is_integer(typ)):
            raise UserError(f"column {column!r} in {path} is {typ}, expected {wanted}: {HINT}")


def _read_split(fs: pafs.FileSystem, files: Sequence[str]) -> tuple[int, dict[str, Any], pa.DataType]:
    """Rows, raytrain metadata and the label type of a list of files, checking that they agree."""
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        footers = list(pool.map(lambda p: _footer(fs, p), files))
    first_schema = footers[0].schema.to_arrow_schema()
    _check_schema(files[0], first_schema)
    meta: dict[str, Any] = {}
    for path, footer in zip(files, footers, strict=True):
        schema = footer.schema.to_arrow_schema()
        _check_schema(path, schema)
        for column in (IMAGE, LABEL):
            a, b = first_schema.field(column).type, schema.field(column).type
            if a != b:
                raise UserError(
                    f"column {column!r} is {a} in {files[0]} but {b} in {path}: "
                    f"rewrite the files with one schema ({HINT})"
                )
        raw = (schema.metadata or {}).get(METADATA_KEY)
        if raw and not meta:
            meta = json.loads(raw)
    return sum(f.num_rows for f in footers), meta, first_schema.field(LABEL).type


@dataclass(frozen=True)
class _Labels:
    lo: int
    hi: int
    distinct: int
    nulls: int


def _labels(fs: pafs.FileSystem, files: Sequence[str]) -> _Labels:
    """The label column's range, distinct values and nulls, over all files (one column is cheap to read)."""
    columns = []
    for path in files:
        with fs.open_input_file(path) as f:
            columns.append(pq.read_table(f, columns=[LABEL]).column(LABEL))
    labels = pa.chunked_array([c for col in columns for c in col.chunks], type=columns[0].type)
    mm = pc.min_max(labels).as_py()
    lo, hi = mm["min"], mm["max"]
    return _Labels(
        lo=lo if lo is not None else 0,
        hi=hi if hi is not None else -1,
        distinct=len(pc.unique(labels.drop_null())),
        nulls=labels.null_count,
    )


# A label range this much wider than the labels used (and this wide) is ids, not class indices.
_SPARSE_FACTOR, _SPARSE_MIN_RANGE = 4, 1024


def inspect(uri: str, *, filesystem: pafs.FileSystem | None = None) -> DataSource:
    """Check a dataset and describe it, or raise a one-line UserError that says how to fix it.

    ``uri`` is a path or URI; with ``filesystem`` it is a path inside that filesystem.
    """
    fs, path = (filesystem, uri) if filesystem is not None else uris.resolve(uri)
    info = fs.get_file_info(path)
    train_dir, val_dir = posixpath.join(path, "train"), posixpath.join(path, "val")
    if info.type == pafs.FileType.Directory and fs.get_file_info(train_dir).type == pafs.FileType.Directory:
        train_files = _list_parquet(fs, train_dir, f"{uri}/train")
        has_val = fs.get_file_info(val_dir).type == pafs.FileType.Directory
        val_files = _list_parquet(fs, val_dir, f"{uri}/val") if has_val else []
    else:
        train_files, val_files = _list_parquet(fs, path, uri), []
    train_rows, meta, label_type = _read_split(fs, train_files)
    val_rows = 0
    if val_files:
        val_rows, _, val_label_type = _read_split(fs, val_files)
        if val_label_type != label_type:
            raise UserError(f"'label' is {label_type} in train/ but {val_label_type} in val/ of {uri}: {HINT}")
    if train_rows == 0:
        raise UserError(f"--data {uri} has no rows: point --data at a non-empty dataset ({HINT})")
    if val_files and val_rows == 0:
        raise UserError(
            f"--data {uri}/val has no rows: put validation rows there, or remove val/ to hold out "
            "--val-fraction of train/ instead"
        )
    classes = tuple(str(c) for c in meta["classes"]) if "classes" in meta else None
    labels = _labels(fs, [*train_files, *val_files])
    if labels.nulls == train_rows + val_rows:
        raise UserError(f"--data {uri} has no labels (every 'label' is null): {HINT}")
    if labels.lo < 0:
        raise UserError(f"--data {uri} has negative labels (min {labels.lo}): labels must be class indices 0..K-1")
    num_classes = len(classes) if classes else labels.hi + 1
    if classes and labels.hi >= len(classes):
        raise UserError(
            f"--data {uri} has label {labels.hi} but its metadata lists {len(classes)} classes: re-run prepare"
        )
    if labels.distinct < 2:
        raise UserError(f"--data {uri} has only one class: a classifier needs at least two")
    if not classes and num_classes > max(_SPARSE_FACTOR * labels.distinct, _SPARSE_MIN_RANGE):
        raise UserError(
            f"--data {uri} uses {labels.distinct} distinct labels between 0 and {labels.hi}: the model would get "
            f"{num_classes} outputs; renumber the labels 0..{labels.distinct - 1} ({HINT} does)"
        )
    size = meta.get("image_size")
    measured = size is None
    if measured:
        size = _measured_image_size(fs, train_files[0])
    return DataSource(
        uri=uri,
        filesystem=fs,
        train_files=tuple(train_files),
        val_files=tuple(val_files),
        train_rows=train_rows,
        val_rows=val_rows,
        num_classes=num_classes,
        classes=classes,
        image_size=int(size) if size else None,
        image_size_measured=measured and size is not None,
        unlabelled=labels.nulls,
    )


def _measured_image_size(fs: pafs.FileSystem, path: str, sample: int = 64) -> int | None:
    """The images' own size, when no metadata records it: the median shorter side of the first images of
    the first file (read from their headers only; undecodable ones are skipped here)."""
    from PIL import Image

    from raytrain.recipe.data.images import UNREADABLE

    with fs.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        if parquet.metadata.num_row_groups == 0:
            return None
        blobs = parquet.read_row_group(0, columns=[IMAGE]).column(IMAGE).to_pylist()[:sample]
    sides = []
    for blob in blobs:
        try:
            with Image.open(io.BytesIO(blob)) as img:
                sides.append(min(img.size))
        except UNREADABLE:
            continue
    return sorted(sides)[len(sides) // 2] if sides else None


def parquet_metadata(classes: Sequence[str] | None, image_size: int | None, **extra: Any) -> dict[bytes, bytes]:
    """The file-level metadata ``raytrain prepare`` and the embedded dataset write."""
    meta: dict[str, Any] = dict(extra)
    if classes is not None:
        meta["classes"] = list(classes)
    if image_size is not None:
        meta["image_size"] = image_size
    return {METADATA_KEY: json.dumps(meta).encode()}
