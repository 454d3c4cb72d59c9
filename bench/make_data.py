"""The benchmark dataset: the embedded digits, augmented into N learnable 32x32 images (no download).

    python bench/make_data.py OUT [--rows 6000] [--seed 0]

Each image is a digit upscaled to 32x32, shifted by up to 3 px, rotated by up to 12 degrees and given
pixel noise, so the set is larger than the original but still learnable (both sides of a comparison
must reach the same loss). Written as one Parquet file in the format `raytrain prepare` produces.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(make(a.rows, a.seed), a.out, row_group_size=512)
    print(a.out)


if __name__ == "__main__":
    main()
