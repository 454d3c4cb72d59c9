"""``raytrain prepare``: image folders and torchvision datasets into the Parquet shards ``fit`` reads.

Output layout: ``OUT/train/part-00000.parquet`` ... and ``OUT/val/...``; every file has ``image`` (encoded
bytes) and ``label`` (int64) columns and records the class names and the image size in its metadata. Rows
are written in a seeded random order, so that row groups mix classes. Images are copied byte for byte
unless ``--image-size`` asks for a resize; the size recorded is then the median shorter side of the first
training images.
"""

from __future__ import annotations

import io
import os
import posixpath
import random
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from PIL import Image

from raytrain import uri
from raytrain.errors import UserError
from raytrain.recipe.data import images
from raytrain.recipe.data.source import parquet_metadata

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
Example = tuple[Callable[[], bytes], int]


@dataclass(frozen=True)
class Summary:
    out: str
    rows: dict[str, int]
    files: dict[str, int]
    classes: tuple[str, ...]
    skipped: int


def _resize(blob: bytes, size: int) -> bytes:
    with Image.open(io.BytesIO(blob)) as img:
        rgb = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    return images.encode(rgb, "JPEG")


def _image_folder(root: Path, val_fraction: float) -> tuple[tuple[str, ...], dict[str, list[Example]]]:
    """Class subfolders under ``root`` (or under ``root/train`` and ``root/val`` when it is split)."""
    splits = {"train": root / "train", "val": root / "val"}
    presplit = all(p.is_dir() for p in splits.values())
    class_root = splits["train"] if presplit else root
    classes = tuple(sorted(d.name for d in class_root.iterdir() if d.is_dir() and not d.name.startswith(".")))
    if not classes:
        raise UserError(f"{root} has no class subfolders: lay images out as {root}/<class>/<image>.jpg")
    index = {c: i for i, c in enumerate(classes)}
    out: dict[str, list[Example]] = {"train": [], "val": []}
    for split, base in splits.items() if presplit else [("train", root)]:
        for cls in classes:
            directory = base / cls
            if not directory.is_dir():
                continue
            for path in sorted(directory.rglob("*")):
                if path.suffix.lower() not in IMAGE_EXTENSIONS or not path.is_file():
                    continue
                # Without a val/ folder: a stable split by a hash of the path relative to the root.
                rel = str(path.relative_to(root)).encode()
                side = split if presplit else ("val" if zlib.crc32(rel) % 10_000 < val_fraction * 10_000 else "train")
                out[side].append((path.read_bytes, index[cls]))
    if not out["train"]:
        raise UserError(f"{root} has class folders but no images ({', '.join(IMAGE_EXTENSIONS)})")
    return classes, out


def _torchvision(name: str, root: str, download: bool) -> tuple[tuple[str, ...], dict[str, list[Example]]]:
    import torchvision.datasets as tvd

    cls = getattr(tvd, name, None)
    if not isinstance(cls, type):
        raise UserError(f"torchvision has no dataset {name!r}: use a name such as CIFAR10, MNIST or FashionMNIST")
    out: dict[str, list[Example]] = {}
    classes: tuple[str, ...] = ()
    for split, train in (("train", True), ("val", False)):
        try:
            try:
                ds = cls(root=root, train=train, download=download)
            except TypeError:
                ds = cls(root=root, split="train" if train else "test", download=download)
        except RuntimeError as exc:
            raise UserError(
                f"torchvision {name} is not under --root {root} ({str(exc).splitlines()[0]}): "
                "put it there, or add --download (needs internet)"
            ) from None
        classes = tuple(str(c) for c in getattr(ds, "classes", ())) or classes
        labels = getattr(ds, "targets", None)
        if labels is None:
            labels = getattr(ds, "labels", None)
        if labels is None:
            labels = [ds[i][1] for i in range(len(ds))]
        out[split] = [(_png_of(ds, i), int(labels[i])) for i in range(len(ds))]
    return classes, out


def _png_of(ds: Any, i: int) -> Callable[[], bytes]:
    return lambda: images.encode(ds[i][0], "PNG")


def _batches(items: Sequence[Example], size: int) -> Iterator[Sequence[Example]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _write_split(
    fs: pafs.FileSystem,
    directory: str,
    examples: Sequence[Example],
    meta: dict[bytes, bytes],
    rows_per_file: int,
    transform: Callable[[bytes], bytes] | None,
    pool: ThreadPoolExecutor,
) -> tuple[int, int, int]:
    schema = pa.schema([("image", pa.binary()), ("label", pa.int64())], metadata=meta)
    fs.create_dir(directory, recursive=True)

    def load(example: Example) -> bytes | None:
        try:
            blob = example[0]()
            if transform is None:
                Image.open(io.BytesIO(blob)).verify()
                return blob
            return transform(blob)
        except images.UNREADABLE:
            return None

    rows = files = skipped = 0
    for chunk in _batches(examples, rows_per_file):
        blobs = list(pool.map(load, chunk))
        keep = [(b, lbl) for b, (_, lbl) in zip(blobs, chunk, strict=True) if b is not None]
        skipped += len(chunk) - len(keep)
        if not keep:
            continue
        table = pa.table({"image": [b for b, _ in keep], "label": [lbl for _, lbl in keep]}, schema=schema)
        with fs.open_output_stream(posixpath.join(directory, f"part-{files:05d}.parquet")) as out:
            pq.write_table(table, out, row_group_size=512)
        rows += len(keep)
        files += 1
    return rows, files, skipped


def prepare(
    source: str,
    out: str,
    *,
    val_fraction: float = 0.1,
    image_size: int | None = None,
    rows_per_file: int = 5000,
    root: str | None = None,
    download: bool = False,
    echo: Callable[[str], None] = print,
) -> Summary:
    """Write ``source`` as Parquet shards under ``out``, which must not exist yet (nothing is overwritten)."""
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction} is out of range: use 0 (no split) up to below 1")
    fs, out_path = uri.resolve(out)
    if fs.get_file_info(out_path).type != pafs.FileType.NotFound:
        raise UserError(f"{out} already exists: give prepare a new output directory (nothing is overwritten)")
    if source.startswith("torchvision:"):
        classes, splits = _torchvision(source.split(":", 1)[1], root or "data", download)
    else:
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise UserError(
                f"{source} is not a directory: give an image folder (one subfolder per class) "
                "or torchvision:NAME with --root"
            )
        classes, splits = _image_folder(folder, val_fraction)
    # Rows in a random order, the same for the same input: a folder's are grouped by class, and a streamed
    # epoch mixes rows only among the row groups a read draws (``pipeline``).
    splits = {split: random.Random(split).sample(examples, len(examples)) for split, examples in splits.items()}
    # Bytes kept as they are: their size is recorded, so fit need not open images to learn it.
    size = image_size or images.median_side([load() for load, _ in splits.get("train", [])[:64]])
    meta = parquet_metadata(classes or None, size, source=source)
    transform = (lambda b: _resize(b, image_size)) if image_size else None
    staging = f"{out_path}.partial-{os.getpid()}"
    rows: dict[str, int] = {}
    files: dict[str, int] = {}
    skipped = 0
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        for split, examples in splits.items():
            if not examples:
                continue
            rows[split], files[split], s = _write_split(
                fs, posixpath.join(staging, split), examples, meta, rows_per_file, transform, pool
            )
            skipped += s
            echo(f"{split}: {rows[split]} images in {files[split]} file(s)")
    if not rows.get("train"):
        fs.delete_dir(staging)
        raise UserError(f"none of the images in {source} could be read: check the files are images")
    fs.move(staging, out_path)
    if skipped:
        echo(f"skipped {skipped} unreadable image(s)")
    return Summary(out=out_path, rows=rows, files=files, classes=classes, skipped=skipped)
