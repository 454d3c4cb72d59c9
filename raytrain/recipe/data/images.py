"""Encoding images to bytes for Parquet and decoding them back into fixed-size uint8 arrays."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from PIL import Image

# What Pillow raises on bytes that are not a readable image: unknown format or truncated data (OSError),
# broken PNG chunks (SyntaxError), absurd dimensions (DecompressionBombError), None (TypeError).
UNREADABLE = (OSError, SyntaxError, ValueError, TypeError, Image.DecompressionBombError)


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


def decode_many(blobs: Sequence[bytes | None], size: int) -> tuple[np.ndarray, np.ndarray]:
    """The images as uint8[N, size, size, 3], and which of them decoded (bool[N]).

    An unreadable or missing image becomes a black one marked False, so a batch keeps its shape and every
    rank its step count; training leaves it out of the loss and counts it.
    """
    out = np.zeros((len(blobs), size, size, 3), dtype=np.uint8)
    ok = np.ones(len(blobs), dtype=bool)
    for i, blob in enumerate(blobs):
        if blob is None:
            ok[i] = False
            continue
        try:
            out[i] = decode(blob, size)
        except UNREADABLE:
            ok[i] = False
    return out, ok
