"""Encoding images to bytes for Parquet and decoding them back into fixed-size uint8 arrays."""

from __future__ import annotations

import io
from collections.abc import Iterable

import numpy as np
from PIL import Image


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def decode(data: bytes, size: int) -> np.ndarray:
    """One encoded image as an RGB uint8 array of shape (size, size, 3)."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(rgb, dtype=np.uint8)


def decode_many(blobs: Iterable[bytes], size: int) -> np.ndarray:
    arrays = [decode(b, size) for b in blobs]
    if not arrays:
        return np.empty((0, size, size, 3), dtype=np.uint8)
    return np.stack(arrays)
