"""Paths and URIs of data and storage: any filesystem pyarrow opens (local, ``file://``, ``s3://``, ...)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain.errors import UserError


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A filesystem and a path in it; plain paths become absolute local paths."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise UserError(f"cannot open {uri!r}: {first_line(exc)}; use a path or a URI pyarrow supports") from None
    return fs, path


def canonical(uri: str) -> str:
    """The form stored in run metadata: absolute for local paths, unchanged for URIs."""
    return resolve(uri)[1] if "://" not in uri else uri


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
