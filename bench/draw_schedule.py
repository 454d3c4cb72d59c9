"""A streamed pass's schedule on paper: how long its tasks take on the CPUs Ray Data has, with raytrain's rule for
a task's draw (``pipeline.draw_size``) against the rule before it (``pipeline.share_draw``: whole draws of
``_MIX_ROWS`` rows, however many tasks the pass's last round then holds).

    python bench/draw_schedule.py --out bench/results/draw-schedule.json [--data PHOTOS.parquet]

Shapes: row groups of R rows (64-1,000), G groups (10-20,000, densely below 3,000), C CPUs for data (2-128);
``--data`` adds the file's own groups at each C. A training pass is the groups and the salt keys in a
random order, cut into tasks of the draw's size in that order; the tasks run as Ray Data runs them, each
started as a CPU frees up, in order. A row takes 1/700 s (one core's decode at 224 px on this project's VM,
BENCHMARKS.md) times a factor drawn per group from 0.85-1.15, and a task 0.03 s more to start. Both rules
run over the same orders and factors (20 draws a shape); the figure is the median over the draws of the
pass's time with the new rule over its time with the old (below 1: the new rule's pass ends sooner).

Left out: Ray Data's back-pressure and the consumer (a pass here is decode-bound and read as fast as it is
made); tasks started out of order; each task's first block (a task hands on its blocks as it decodes them,
which a round start costs once); CPUs shared with anything else; the validation pass (no salt keys, its
draw computed without them); groups of unequal rows (the rule sees their mean); and the mixing window, which
a smaller draw narrows (fewer rows a task mixes).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics

from raytrain.recipe.data import pipeline, source

RATE = 700.0  # rows a second a core decodes, 224 px crop-flip (BENCHMARKS.md, cores per GPU)
START_S = 0.03
DRAWS = 20
CPUS = (2, 4, 8, 16, 32, 64, 128)
COMMAND = "python bench/draw_schedule.py --out bench/results/draw-schedule.json --data /tmp/photos/p224-15000.parquet"


def pass_time(items: list[float], draw: int, cpus: int) -> float:
    """``items``: each item's decode seconds, in the pass's order."""
    free = [0.0] * cpus
    for i in range(0, len(items), draw):
        heapq.heappush(free, heapq.heappop(free) + sum(items[i : i + draw]) + START_S)
    return max(free)


def compare(units: tuple[source.Unit, ...], cpus: int, seed: int) -> dict[str, float] | None:
    before = pipeline.share_draw(units, cpus)[0]
    now = pipeline.draw_size(units, cpus, salts=pipeline._SALTS)
    if before == now:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(DRAWS):
        items = [u.rows / RATE * rng.uniform(0.85, 1.15) for u in units] + [0.0] * pipeline._SALTS
        rng.shuffle(items)
        ratios.append(pass_time(items, now, cpus) / pass_time(items, before, cpus))
    return {"draw_before": before, "draw_now": now, "now_over_before": round(statistics.median(ratios), 4)}


def line(r: dict[str, object]) -> str:
    return f"{r['shape']}, {r['cpus']} CPUs: draw {r['draw_before']} -> {r['draw_now']}, {r['now_over_before']:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", help="a Parquet file whose row groups to add as a shape")
    a = ap.parse_args()
    shapes: list[tuple[str, tuple[source.Unit, ...]]] = []
    groups = [*range(10, 400, 5), *range(400, 3000, 50), 5000, 20000]
    for rows in (64, 100, 128, 200, 256, 400, 512, 1000):
        shapes += [(f"{g} x {rows} rows", tuple(source.Unit("f", i, rows) for i in range(g))) for g in groups]
    if a.data:
        units = source.inspect(a.data).train_units
        shapes.append((f"{a.data}: {len(units)} groups, {sum(u.rows for u in units)} rows", units))
    rows_out = []
    for n, (name, units) in enumerate(shapes):
        for cpus in CPUS:
            got = compare(units, cpus, seed=n * 1000 + cpus)
            if got is not None:
                rows_out.append({"shape": name, "cpus": cpus, **got})
    ratios = [r["now_over_before"] for r in rows_out]
    summary = {
        "shapes": len(shapes) * len(CPUS),
        "differing": len(rows_out),
        "sooner_by_over_1pct": sum(r < 0.99 for r in ratios),
        "later_by_over_1pct": sum(r > 1.01 for r in ratios),
        "median_now_over_before": statistics.median(ratios) if ratios else None,
    }
    ranked = sorted(rows_out, key=lambda r: r["now_over_before"])
    print(json.dumps(summary))
    for label, part in (("most sooner", ranked[:6]), ("most later", ranked[-6:][::-1])):
        print(label)
        for r in part:
            print(f"  {line(r)}")
    for r in rows_out:
        if a.data and r["shape"].startswith(a.data):
            print(line(r))
    with open(a.out, "w") as f:
        json.dump({"command": COMMAND, "summary": summary, "differing": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
