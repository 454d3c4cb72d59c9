"""The benchmark datasets, made locally from the embedded digits (no download).

    python bench/make_data.py OUT [--rows 6000] [--seed 0]             # 32x32 PNGs
    python bench/make_data.py OUT --photos 224 [--rows 3000] [--seed 0]  # ImageNet-shaped JPEGs

Each 32 px image is a digit upscaled to 32x32, shifted by up to 3 px, rotated by up to 12 degrees and
given pixel noise, so the set is larger than the original but still learnable (both sides of a
comparison must reach the same loss). ``--photos S`` makes JPEGs shaped like ImageNet's: a shorter side
of S to 1.5 S, an aspect ratio of 3/4 to 4/3, colour, quality 90 (about 0.3 bytes per pixel: a smoother
picture than ImageNet's 0.8, so decoding is a little cheaper), for a pipeline that resizes and crops to S.
Written as one Parquet file in the format `raytrain prepare` produces.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from raytrain.recipe.data import digits, images
from raytrain.recipe.data.source import parquet_metadata


def make(rows: int, seed: int) -> pa.Table:
    pixels, labels = digits._load()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(labels), rows)
    blobs = []
    for i in picks:
        img = Image.fromarray(pixels[i]).resize((24, 24), Image.Resampling.BILINEAR)
        img = img.rotate(float(rng.uniform(-12, 12)), resample=Image.Resampling.BILINEAR)
        canvas = Image.new("L", (32, 32))
        canvas.paste(img, (4 + int(rng.integers(-3, 4)), 4 + int(rng.integers(-3, 4))))
        noisy = np.clip(np.asarray(canvas, dtype=np.int16) + rng.integers(-20, 21, (32, 32)), 0, 255)
        blobs.append(images.encode(Image.fromarray(noisy.astype(np.uint8))))
    schema = pa.schema(
        [("image", pa.binary()), ("label", pa.int64())],
        metadata=parquet_metadata([str(d) for d in range(10)], 32, source=f"digits-augmented-{rows}-{seed}"),
    )
    return pa.table({"image": blobs, "label": labels[picks]}, schema=schema)


def make_photos(rows: int, seed: int, size: int) -> pa.Table:
    pixels, labels = digits._load()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(labels), rows)
    blobs = []
    for i in picks:
        short = int(rng.integers(size, size * 3 // 2 + 1))
        aspect = float(rng.uniform(3 / 4, 4 / 3))
        w, h = (round(short * aspect), short) if aspect >= 1 else (short, round(short / aspect))
        # A colour gradient and grain as the background, the digit in a random colour on top.
        ys, xs = np.mgrid[0:h, 0:w]
        base = rng.integers(0, 256, 3)
        tilt = rng.uniform(-0.5, 0.5, (2, 3))
        bg = base + xs[..., None] * tilt[0] + ys[..., None] * tilt[1] + rng.normal(0, 12, (h, w, 3))
        digit = Image.fromarray(pixels[i]).resize((short * 3 // 4, short * 3 // 4), Image.Resampling.BILINEAR)
        mask = np.zeros((h, w), dtype=np.float32)
        x0, y0 = int(rng.integers(0, w - digit.width + 1)), int(rng.integers(0, h - digit.height + 1))
        mask[y0 : y0 + digit.height, x0 : x0 + digit.width] = np.asarray(digit, dtype=np.float32) / 255
        ink = rng.integers(0, 256, 3)
        img = bg * (1 - mask[..., None]) + ink * mask[..., None]
        blobs.append(images.encode(Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)), "JPEG", quality=90))
    schema = pa.schema(
        [("image", pa.binary()), ("label", pa.int64())],
        metadata=parquet_metadata([str(d) for d in range(10)], size, source=f"digit-photos-{size}-{rows}-{seed}"),
    )
    return pa.table({"image": blobs, "label": labels[picks]}, schema=schema)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--photos", type=int, metavar="S", help="ImageNet-shaped JPEGs for a pipeline at S px")
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    table = make_photos(a.rows, a.seed, a.photos) if a.photos else make(a.rows, a.seed)
    pq.write_table(table, a.out, row_group_size=64 if a.photos else 512)
    print(a.out)


if __name__ == "__main__":
    main()
