"""Checking a Parquet dataset before any Ray worker starts.

A dataset is a Parquet file or a directory of them (its splits named by directories or file names:
``raytrain.recipe.data.layout``), on any filesystem pyarrow knows (local path, ``file://``, ``s3://``,
``gs://``, ``hdfs://``). Every row holds an encoded image and its class, in columns named ``image`` and
``label`` unless ``--image-column``/``--label-column`` say otherwise:

- the image: encoded bytes (binary), or a struct with a binary ``bytes`` field (Hugging Face's ``Image``);
- the label: an integer class id (class names from raytrain's metadata or Hugging Face's ``ClassLabel``
  when the files carry them), or a string class name (mapped to ids in sorted order).

Only footers and the label column are read here, so a bad path, a non-Parquet file or a wrong column fails
in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain import uri as uris
from raytrain.errors import Fatal, UserError
from raytrain.recipe.data import layout

# The columns the pipeline works with, whatever the files call theirs (``canonical``).
IMAGE = "image"
LABEL = "label"
METADATA_KEY = b"raytrain"
_HF_KEY = b"huggingface"
IMAGE_KINDS = "encoded image bytes (binary, or a struct with a binary 'bytes' field as Hugging Face writes)"
LABEL_KINDS = "integer class ids or string class names"
HINT = "an image folder becomes one with `raytrain prepare IMAGE_DIR OUT`"


@dataclass(frozen=True)
class Columns:
    """Where the images and labels are in the files, and how to read them."""

    image: str = IMAGE
    label: str = LABEL
    image_field: str | None = None  # the struct field holding the bytes (Hugging Face: "bytes")
    string_labels: bool = False


class Unit(NamedTuple):
    """A Parquet row group: the files' own unit of reading, and a streamed read task's."""

    path: str
    group: int
    rows: int


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
    unlabelled: int = 0  # rows whose label is null (or, with string labels, empty): training leaves them out
    columns: Columns = Columns()
    val_split: str | None = None  # which split validation comes from ("val", "test"); None: held out by hash
    classes_from: str | None = None  # where the class names come from, when not from raytrain's metadata
    augment: str | None = None  # the augmentation preset the data's metadata asks for (digits: none)
    train_units: tuple[Unit, ...] = ()  # the row groups of train_files, in file order
    val_units: tuple[Unit, ...] = ()


def _footer(fs: pafs.FileSystem, path: str) -> pq.FileMetaData:
    try:
        with fs.open_input_file(path) as f:
            return pq.read_metadata(f)
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"{path} is not a readable Parquet file ({uris.first_line(exc)}): {HINT}") from None


def _columns(path: str, schema: pa.Schema, image: str, label: str) -> Columns:
    """How to read ``image`` and ``label`` in a file of this schema, or a UserError that says what would work."""
    names = schema.names
    for column, flag, kinds in ((image, "--image-column", IMAGE_KINDS), (label, "--label-column", LABEL_KINDS)):
        if column not in names:
            raise UserError(
                f"{path} has no {column!r} column (it has: {', '.join(names) or 'none'}): name the column that "
                f"holds {kinds} with {flag}"
            )
    typ = schema.field(image).type
    field = None
    if pa.types.is_struct(typ):
        binary = [typ.field(i).name for i in range(typ.num_fields) if _is_binary(typ.field(i).type)]
        field = "bytes" if "bytes" in binary else (binary[0] if len(binary) == 1 else None)
        if field is None:
            raise UserError(f"column {image!r} in {path} is {typ}, a struct without a binary 'bytes' field: {HINT}")
    elif not _is_binary(typ):
        raise UserError(f"column {image!r} in {path} is {typ}, not {IMAGE_KINDS}: name another with --image-column")
    ltyp = schema.field(label).type
    if pa.types.is_dictionary(ltyp):
        ltyp = ltyp.value_type
    strings = pa.types.is_string(ltyp) or pa.types.is_large_string(ltyp)
    if not (strings or pa.types.is_integer(ltyp)):
        raise UserError(f"column {label!r} in {path} is {ltyp}, not {LABEL_KINDS}: name another with --label-column")
    return Columns(image=image, label=label, image_field=field, string_labels=strings)


def _is_binary(typ: pa.DataType) -> bool:
    return bool(pa.types.is_binary(typ) or pa.types.is_large_binary(typ))


def _hf_class_names(schema: pa.Schema, label: str) -> tuple[str, ...] | None:
    """Class names from Hugging Face's ``ClassLabel`` feature, when the files were written by ``datasets``."""
    raw = (schema.metadata or {}).get(_HF_KEY)
    if not raw:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][label]
    except (ValueError, KeyError, TypeError):
        return None
    names = feature.get("names") if isinstance(feature, dict) else None
    return tuple(str(n) for n in names) if isinstance(names, list) and names else None


@dataclass(frozen=True)
class _Split:
    rows: int
    meta: dict[str, Any]
    columns: Columns
    hf_classes: tuple[str, ...] | None
    units: tuple[Unit, ...]


def _read_split(fs: pafs.FileSystem, files: Sequence[str], image: str, label: str) -> _Split:
    """Rows, raytrain metadata and the columns of a list of files, checking that they agree."""
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        footers = list(pool.map(lambda p: _footer(fs, p), files))
    first_schema = footers[0].schema.to_arrow_schema()
    columns = _columns(files[0], first_schema, image, label)
    meta: dict[str, Any] = {}
    for path, footer in zip(files, footers, strict=True):
        schema = footer.schema.to_arrow_schema()
        _columns(path, schema, image, label)
        for column in (image, label):
            a, b = first_schema.field(column).type, schema.field(column).type
            if a != b:
                raise UserError(
                    f"column {column!r} is {a} in {files[0]} but {b} in {path}: rewrite the files with one schema"
                )
        raw = (schema.metadata or {}).get(METADATA_KEY)
        if raw and not meta:
            meta = json.loads(raw)
    units = tuple(
        Unit(path, i, footer.row_group(i).num_rows)
        for path, footer in zip(files, footers, strict=True)
        for i in range(footer.num_row_groups)
        if footer.row_group(i).num_rows
    )
    return _Split(sum(f.num_rows for f in footers), meta, columns, _hf_class_names(first_schema, label), units)


def unreadable(path: str, exc: BaseException) -> str:
    """What to say of a data file whose pages cannot be read (its footer, checked first, was fine)."""
    what = f"data file {path}"
    if isinstance(exc, FileNotFoundError):
        return f"{what} was removed after the data was checked: put it back, or leave it out of --data"
    return (
        f"{what} cannot be read ({uris.first_line(exc)}): a page of it is damaged, or it changed after the data "
        "was checked; replace it, or leave it out of --data"
    )


def _label_column(fs: pafs.FileSystem, files: Sequence[str], label: str) -> pa.ChunkedArray:
    """The label column over all files (one column is cheap to read)."""
    chunks = []
    for path in files:
        try:
            with fs.open_input_file(path) as f:
                column = pq.read_table(f, columns=[label]).column(label)
        except (pa.ArrowException, OSError) as exc:
            raise UserError(unreadable(path, exc)) from None
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        chunks.extend(column.chunks)
    return pa.chunked_array(chunks)


@dataclass(frozen=True)
class _Labels:
    num_classes: int
    classes: tuple[str, ...] | None
    nulls: int


# A label range this much wider than the labels used (and this wide) is ids, not class indices.
_SPARSE_FACTOR, _SPARSE_MIN_RANGE = 4, 1024


def _integer_labels(labels: pa.ChunkedArray, classes: tuple[str, ...] | None, shown: str, named_by: str) -> _Labels:
    mm = pc.min_max(labels).as_py()
    lo = mm["min"] if mm["min"] is not None else 0
    hi = mm["max"] if mm["max"] is not None else -1
    distinct = len(pc.unique(labels.drop_null()))
    if lo < 0:
        raise UserError(f"--data {shown} has negative labels (min {lo}): labels must be class indices 0..K-1")
    if classes and hi >= len(classes):
        raise UserError(
            f"--data {shown} has label {hi} but its {named_by} lists {len(classes)} classes: fix the labels"
        )
    num_classes = len(classes) if classes else hi + 1
    if distinct < 2:
        raise UserError(f"--data {shown} has only one class: a classifier needs at least two")
    if not classes and num_classes > max(_SPARSE_FACTOR * distinct, _SPARSE_MIN_RANGE):
        raise UserError(
            f"--data {shown} uses {distinct} distinct labels between 0 and {hi}: the model would get "
            f"{num_classes} outputs; renumber the labels 0..{distinct - 1}, or store class names as strings"
        )
    return _Labels(num_classes=num_classes, classes=classes, nulls=labels.null_count)


def _string_labels(labels: pa.ChunkedArray, classes: tuple[str, ...] | None, shown: str) -> _Labels:
    """String labels: class names, sorted (or in the order raytrain's metadata lists them). An empty
    string is no label."""
    labels = pc.if_else(pc.equal(labels, ""), pa.scalar(None, labels.type), labels)
    names = tuple(sorted(str(v) for v in pc.unique(labels.drop_null()).to_pylist()))
    if classes:
        unknown = sorted(set(names) - set(classes))
        if unknown:
            raise UserError(f"--data {shown} has labels {unknown[:3]} that its metadata's classes do not list")
        names = classes
    if len(names) < 2:
        raise UserError(f"--data {shown} has only one class: a classifier needs at least two")
    return _Labels(num_classes=len(names), classes=names, nulls=labels.null_count)


def inspect(
    uri: str, *, image_column: str = IMAGE, label_column: str = LABEL, filesystem: pafs.FileSystem | None = None
) -> DataSource:
    """Check a dataset and describe it, or raise a one-line UserError that says how to fix it.

    ``uri`` is a path or URI; with ``filesystem`` it is a path inside that filesystem.
    """
    fs, path = (filesystem, uri) if filesystem is not None else uris.resolve(uri)
    files = layout.find(fs, path, uri, HINT)
    train = _read_split(fs, files.train, image_column, label_column)
    val_rows = 0
    val_units: tuple[Unit, ...] = ()
    if files.val:
        val = _read_split(fs, files.val, image_column, label_column)
        val_units = val.units
        if val.columns != train.columns:
            raise UserError(
                f"columns {image_column!r}/{label_column!r} are typed differently in the training and "
                f"{files.val_split} files of {uri}: rewrite them with one schema"
            )
        val_rows = val.rows
    if train.rows == 0:
        raise UserError(f"--data {uri} has no rows: point --data at a non-empty dataset ({HINT})")
    if files.val and val_rows == 0:
        raise UserError(
            f"--data {uri} has no rows in its {files.val_split} split: put validation rows there, or remove it "
            "to hold out --val-fraction of the training rows instead"
        )
    meta_classes = tuple(str(c) for c in train.meta["classes"]) if "classes" in train.meta else None
    classes_from = None if meta_classes else ("Hugging Face's ClassLabel" if train.hf_classes else None)
    labels = _label_column(fs, [*files.train, *files.val], label_column)
    if labels.null_count == len(labels):
        raise UserError(f"--data {uri} has no labels (every {label_column!r} is null)")
    if train.columns.string_labels:
        found = _string_labels(labels, meta_classes, uri)
        classes_from = classes_from or (None if meta_classes else "string labels")
    else:
        named_by = "metadata" if meta_classes else "ClassLabel"
        found = _integer_labels(labels, meta_classes or train.hf_classes, uri, named_by)
    size = train.meta.get("image_size")
    measured = size is None
    if measured:
        size = _measured_image_size(fs, files.train[0], train.columns)
    return DataSource(
        uri=uri,
        filesystem=fs,
        train_files=files.train,
        val_files=files.val,
        train_rows=train.rows,
        val_rows=val_rows,
        num_classes=found.num_classes,
        classes=found.classes,
        image_size=int(size) if size else None,
        image_size_measured=measured and size is not None,
        unlabelled=found.nulls,
        columns=train.columns,
        val_split=files.val_split,
        classes_from=classes_from,
        augment=train.meta.get("augment"),
        train_units=train.units,
        val_units=val_units,
    )


def image_bytes(column: pa.ChunkedArray | pa.Array, columns: Columns) -> list[bytes | None]:
    """The encoded images of an image column, as the files hold it."""
    if columns.image_field is not None:
        column = pc.struct_field(column, columns.image_field)
    return column.to_pylist()  # type: ignore[no-any-return]


def read_unit(
    fs: pafs.FileSystem, unit: Unit, columns: Columns, classes: tuple[str, ...] | None, rows: int | None = None
) -> Iterator[pa.Table]:
    """One row group as canonical ``image``/``label`` columns, in slices of at most ``rows`` rows (None: the
    whole group at once), so that a group of any size is held a slice at a time. A file whose pages cannot
    be read (damaged, or changed or removed since the check) fails the run at once, naming it: no retry of
    the workers could read it either (``raytrain.Fatal``)."""
    try:
        with fs.open_input_file(unit.path) as f:
            parquet = pq.ParquetFile(f)
            wanted = [columns.image, columns.label]
            if rows is None:
                yield canonical(parquet.read_row_group(unit.group, columns=wanted), columns=columns, classes=classes)
                return
            for batch in parquet.iter_batches(batch_size=rows, row_groups=[unit.group], columns=wanted):
                yield canonical(pa.Table.from_batches([batch]), columns=columns, classes=classes)
    except (pa.ArrowException, OSError) as exc:
        raise Fatal(unreadable(unit.path, exc)) from None


def canonical(batch: pa.Table, *, columns: Columns, classes: tuple[str, ...] | None) -> pa.Table:
    """A batch as the pipeline reads it: ``image`` bytes and an int64 ``label`` (null for no label)."""
    image = batch.column(columns.image)
    if columns.image_field is not None:
        image = pc.struct_field(image, columns.image_field)
    label = batch.column(columns.label)
    if pa.types.is_dictionary(label.type):
        label = label.cast(label.type.value_type)
    if columns.string_labels:
        assert classes is not None
        label = pc.index_in(label, value_set=pa.array(classes, type=label.type))
    return pa.table({IMAGE: image.cast(pa.binary()), LABEL: label.cast(pa.int64())})


def _measured_image_size(fs: pafs.FileSystem, path: str, columns: Columns, sample: int = 64) -> int | None:
    """The images' own size, when no metadata records it: the median shorter side of the first images of
    the first file (read from their headers only; undecodable ones are skipped here)."""
    from raytrain.recipe.data.images import median_side

    with fs.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        if parquet.metadata.num_row_groups == 0:
            return None
        blobs = image_bytes(parquet.read_row_group(0, columns=[columns.image]).column(columns.image), columns)[:sample]
    return median_side(blobs)


def parquet_metadata(classes: Sequence[str] | None, image_size: int | None, **extra: Any) -> dict[bytes, bytes]:
    """The file-level metadata ``raytrain prepare`` and the embedded dataset write."""
    meta: dict[str, Any] = dict(extra)
    if classes is not None:
        meta["classes"] = list(classes)
    if image_size is not None:
        meta["image_size"] = image_size
    return {METADATA_KEY: json.dumps(meta).encode()}
