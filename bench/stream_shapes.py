"""Where a streamed pass's time goes: Ray Data pipeline shapes side by side, same local Ray, same data.

    python bench/make_data.py /tmp/photos/p224-3000.parquet --photos 224 --rows 3000
    python bench/stream_shapes.py /tmp/photos/p224-3000.parquet [--passes 3] [--shapes current,blockorder,...]

Each shape reads the same Parquet and decodes with raytrain's own function (crop-flip to 224 by default),
and a single consumer takes batches of 64 as torch tensors (bench/ingest.py's ``timed_pass``: time to the
first batch, images/s over the pass and after its first batch, cores used):

- ``current``: raytrain's streamed pipeline as it is (row groups in a new order each pass, each task
  mixing 2,048 rows at a time and decoding them, a block of 256 rows handed on at once);
- ``global``: raytrain's pipeline before row-group windows (read, global shuffle, blocks of 256 rows, decode);
- ``blockorder``: no global shuffle: blocks of 256 rows in a random order, then decode;
- ``noshuffle``: read, then decode, nothing in between;
- ``readsplit``: read asked for 24 blocks, decode 64 rows a task, a 512-row shuffle buffer at the consumer;
- ``rowgroups``: a task per Parquet row group in a random order, reading and decoding it, the same buffer.

A shape that is as slow as ``current`` before its first batch points at what they share (the read).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import BATCH, timed_pass

from raytrain.recipe.data import augment, pipeline, source
from raytrain.recipe.data.augment import Augment


def shapes(size: int, aug: Augment) -> dict[str, tuple[Callable[[source.DataSource], Any], dict[str, Any]]]:
    """Each shape: how it builds the training dataset, and the consumer's extra iteration options."""
    import ray.data

    def read(src: source.DataSource, **kw: Any) -> Any:
        return ray.data.read_parquet(list(src.train_files), columns=["image", "label"], **kw)

    def decode(ds: Any, rows: int) -> Any:
        return ds.map_batches(pipeline.decode, fn_kwargs={"size": size, "aug": aug}, batch_format="pyarrow",
                              batch_size=rows)  # fmt: skip

    def row_groups(src: source.DataSource) -> Any:
        """A read task per Parquet row group (the files' own units), in a random order, each decoding its rows."""
        import random

        import pyarrow as pa
        import pyarrow.parquet as pq

        units = [{"file": f, "group": g} for f in src.train_files for g in range(pq.ParquetFile(f).num_row_groups)]
        random.shuffle(units)

        def load(batch: pa.Table) -> pa.Table:
            files, groups = batch.column("file").to_pylist(), batch.column("group").to_pylist()
            return pa.concat_tables(
                pq.ParquetFile(f).read_row_group(g, columns=["image", "label"])
                for f, g in zip(files, groups, strict=True)
            )

        units_ds = ray.data.from_items(units, override_num_blocks=len(units))
        return decode(units_ds.map_batches(load, batch_format="pyarrow", batch_size=1), 64)

    return {
        "global": (  # raytrain's pipeline before row-group windows: a global shuffle every pass
            lambda src: decode(read(src).random_shuffle().repartition(target_num_rows_per_block=256), 256),
            {},
        ),
        "rowgroups": (row_groups, {"local_shuffle_buffer_size": 512}),
        "current": (lambda src: pipeline.Streams(src, image_size=size, val_fraction=1e-9, aug=aug).train(), {}),
        "blockorder": (
            lambda src: decode(read(src).repartition(target_num_rows_per_block=256).randomize_block_order(), 256),
            {},
        ),
        "noshuffle": (lambda src: decode(read(src), 256), {}),
        "readsplit": (lambda src: decode(read(src, override_num_blocks=24), 64), {"local_shuffle_buffer_size": 512}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--augment", choices=augment.PRESETS, default="crop-flip")
    ap.add_argument("--shapes", default="current,global,blockorder,noshuffle,readsplit,rowgroups")
    ap.add_argument("--no-reservation", action="store_true", help="Ray Data's per-operator resource reservation off")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from raytrain.service import cluster

    with cluster.connect(dashboard=False):  # raytrain's own private local Ray, as `raytrain fit` starts it
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.op_resource_reservation_enabled = not a.no_reservation
        src = source.inspect(a.data)
        known = shapes(a.image_size, Augment(preset=a.augment))
        result: dict[str, list[dict[str, float]]] = {}
        for name in a.shapes.split(","):
            build, options = known[name]
            ds = build(src)
            result[name] = [timed_pass(ds.iter_torch_batches(batch_size=BATCH, **options)) for _ in range(a.passes)]
            print(name, [f"{r['images_per_s']:.0f} img/s (after the first batch {r['steady_images_per_s']:.0f}), "
                         f"first {r['first_batch_s']:.2f} s, {r['cores']:.2f} cores" for r in result[name]],
                  flush=True)  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
