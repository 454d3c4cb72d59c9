"""The embedded default dataset: 1,797 handwritten digits (8x8, 10 classes) shipped inside the package.

On first use it is written as Parquet under the run storage (which every node sees) in the same format
``raytrain prepare`` produces, so the default run exercises exactly the path real data takes.
Source and licence: ``raytrain/recipe/data/NOTICE``.
"""

from __future__ import annotations

import gzip
import os
import posixpath
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from PIL import Image

from raytrain import private_dirs
from raytrain.errors import UserError
from raytrain.recipe.data import images
from raytrain.recipe.data.source import parquet_metadata

VERSION = "digits-v2"  # v2: asks for no augmentation
# 8x8 is too small for torchvision's stems (ResNet downsamples 32x); 32x32 trains to >98% in seconds.
IMAGE_SIZE = 32
# Flipped digits are other digits (or none), and 8x8 originals hold no detail a random crop could keep:
# crop-flip costs this set 2-4 points of accuracy at 10 epochs (94.0% against 97-98%).
AUGMENT = "none"


def _load() -> tuple[np.ndarray, np.ndarray]:
    raw = resources.files("raytrain.recipe.data").joinpath("digits.csv.gz").read_bytes()
    table = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",", dtype=np.int64)
    pixels = np.rint(table[:, :64] * (255.0 / 16.0)).astype(np.uint8).reshape(-1, 8, 8)
    return pixels, table[:, 64]


def table() -> pa.Table:
    pixels, labels = _load()
    blobs = [images.encode(Image.fromarray(p)) for p in pixels]
    schema = pa.schema(
        [("image", pa.binary()), ("label", pa.int64())],
        metadata=parquet_metadata([str(d) for d in range(10)], IMAGE_SIZE, source="uci-optdigits", augment=AUGMENT),
    )
    return pa.table({"image": blobs, "label": labels}, schema=schema)


def _datasets_dir(fs: pafs.FileSystem, storage_root: str) -> str:
    """Where the embedded data is kept under the storage root: ``.datasets``, made by this user and
    writable by no one else, unless that name is another user's (or open to others) on a shared
    filesystem: then ``.datasets-<uid>``, and failing that a fresh private directory, so that nobody ever
    trains on a file someone else could have written, and nobody can block the embedded data."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return posixpath.join(storage_root, ".datasets")
    fs.create_dir(storage_root, recursive=True)
    for name in (".datasets", f".datasets-{os.getuid()}"):
        path = Path(storage_root) / name
        try:  # readable by all (it is public data), written by its maker alone, whatever the umask
            private_dirs.ensure(path, "the embedded data's directory", "", mode=0o755)
            return str(path)
        except UserError:
            continue  # another user's name
    return tempfile.mkdtemp(prefix=f".datasets-{os.getuid()}-", dir=storage_root)


def ensure(fs: pafs.FileSystem, storage_root: str) -> str:
    """The path of the digits Parquet file under the storage root, written once, atomically."""
    directory = _datasets_dir(fs, storage_root)
    path = posixpath.join(directory, f"{VERSION}.parquet")
    if fs.get_file_info(path).type == pafs.FileType.File:
        return path
    fs.create_dir(directory, recursive=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with fs.open_output_stream(tmp) as out:
        pq.write_table(table(), out)
    fs.move(tmp, path)
    return path
