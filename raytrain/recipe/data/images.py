"""Encoding images to bytes for Parquet and decoding them back into fixed-size uint8 arrays."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

# What Pillow raises on bytes that are not a readable image: unknown format or truncated data (OSError),
# broken PNG chunks (SyntaxError), absurd dimensions (DecompressionBombError), None (TypeError).
UNREADABLE = (OSError, SyntaxError, ValueError, TypeError, Image.DecompressionBombError)


def encode(image: Image.Image, fmt: str = "PNG", quality: int = 95) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def fit(img: Image.Image, size: int) -> Image.Image:
    """Resize the shorter side to ``size`` and crop the centre square (validation, and ``--augment none``)."""
    w, h = img.size
    if (w, h) == (size, size):
        return img
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return img.crop((left, top, left + size, top + size))


def open_rgb(data: bytes) -> Image.Image:
    """One encoded image, decoded to RGB; raises one of ``UNREADABLE``."""
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def decode(data: bytes, size: int) -> np.ndarray:
    """One encoded image as an RGB uint8 array of shape (size, size, 3): shorter side resized, centre cropped."""
    return np.asarray(fit(open_rgb(data), size), dtype=np.uint8)


def decode_many(
    blobs: Sequence[bytes | None], size: int, shape: Callable[[Image.Image], np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The images as uint8[N, size, size, 3], and which of them decoded (bool[N]). ``shape`` turns each
    decoded original into its array (training augmentation); by default it is ``fit``.

    An unreadable or missing image becomes a black one marked False, so a batch keeps its shape and every
    rank its step count; training leaves it out of the loss and counts it.
    """
    out = np.zeros((len(blobs), size, size, 3), dtype=np.uint8)
    ok = np.ones(len(blobs), dtype=bool)
    for i, blob in enumerate(blobs):
        try:
            img = open_rgb(blob)  # type: ignore[arg-type]
        except UNREADABLE:
            ok[i] = False
            continue
        out[i] = shape(img) if shape is not None else np.asarray(fit(img, size), dtype=np.uint8)
    return out, ok


def median_side(blobs: Sequence[bytes | None]) -> int | None:
    """The median shorter side of the images that open (read from their headers only)."""
    sides = []
    for blob in blobs:
        try:
            with Image.open(io.BytesIO(blob)) as img:  # type: ignore[arg-type]
                sides.append(min(img.size))
        except UNREADABLE:
            continue
    return sorted(sides)[len(sides) // 2] if sides else None
