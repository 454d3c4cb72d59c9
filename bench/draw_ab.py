"""raytrain's streamed pass with its draw rule against whole draws (the rule before), alternated pass by pass.

    python bench/make_data.py /tmp/photos/p224-15000.parquet --photos 224 --rows 15000
    python bench/draw_ab.py /tmp/photos/p224-15000.parquet --rounds 6 --out bench/results/draw-ab.json

One local Ray (raytrain's own, as ``raytrain fit`` starts it), 2 CPUs for data, two datasets over the same
file built once: one with ``pipeline.draw_size``, one with every task a whole draw (``pipeline.share_draw``).
After a pass of each to start Ray Data's workers, rounds of one cold pass each in ABBA order, read as a
training rank reads (``shards.batches``, batches of 64, 224 px crop-flip), timed as bench/ingest.py times a
pass. Reported: each rule's images/s and cores, and the ratio round by round. Where the two rules draw
alike for the file, there is nothing to compare and the script says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
from ingest import BATCH, pin_draw, streamed, timed_pass  # next to this file

from raytrain.recipe.data import pipeline, shards, source
from raytrain.recipe.data.augment import Augment

CPUS = 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    src = source.inspect(a.data)
    rule = pipeline.draw_size
    draws = {
        "rule": rule(src.train_units, CPUS, salts=pipeline._SALTS),
        "whole": pipeline.share_draw(src.train_units, CPUS)[0],
    }
    if draws["rule"] == draws["whole"]:
        raise SystemExit(f"both rules draw {draws['rule']} items a task for {a.data}: nothing to compare")
    torch.set_num_threads(1)
    from raytrain.service import cluster

    passes: dict[str, list[dict[str, Any]]] = {"rule": [], "whole": []}
    with cluster.connect(dashboard=False):
        data = {}
        for name, draw in draws.items():
            pin_draw(draw)
            data[name] = streamed(a.data, CPUS, 224, Augment(preset="crop-flip")).train()
        pipeline.draw_size = rule

        def one(name: str) -> dict[str, Any]:
            return timed_pass(shards.batches(data[name], batch_size=BATCH, device=torch.device("cpu")), by_part=False)

        one("rule"), one("whole")  # Ray Data's workers started, off the figures
        for r in range(a.rounds):
            for name in ("rule", "whole") if r % 2 == 0 else ("whole", "rule"):
                passes[name].append(one(name))
    ratios = [n["images_per_s"] / w["images_per_s"] for n, w in zip(passes["rule"], passes["whole"], strict=True)]
    out = {"draws": draws, "passes": passes, "ratio_by_round": ratios}
    for name in passes:
        rates = [p["images_per_s"] for p in passes[name]]
        cores = [p["cores"] for p in passes[name]]
        rate = f"{statistics.median(rates):.0f} images/s ({min(rates):.0f}-{max(rates):.0f})"
        print(f"{name} (draw {draws[name]}): {rate}, cores {statistics.median(cores):.2f}")
    print(f"ratio, round by round: {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
