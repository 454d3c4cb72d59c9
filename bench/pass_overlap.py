"""Whether starting each streamed pass during the one before it pays: two Ray Data passes in flight at once,
against one after another, on the same local Ray and the same data.

    python bench/make_data.py /tmp/photos/p224-3000.parquet --photos 224 --rows 3000
    python bench/pass_overlap.py /tmp/photos/p224-3000.parquet [--rounds 3] [--passes 3] --out overlap.json

Both modes run raytrain's streamed pipeline with bench/ingest.py's consumer (batches of 64 as torch
tensors, crop-flip to 224, 2 CPUs for Ray Data):

- ``sequential``: each pass starts once the one before it has been read to its end (raytrain's way);
- ``ahead``: each pass starts as soon as the one before it yields its first batch (a thread takes the next
  pass's first batch, so the next pass's tasks run beside the current pass's and its first batch waits
  ready when the current pass ends).

The modes alternate, in ABBA order. Reported: images/s over each round's passes (the first pass's start
included), then the first pass alone (in ``ahead`` it runs beside the next) and the later passes (their
time to the first batch is ~0 in ``ahead`` by construction: it was taken off their clock), the cores the
whole process tree used, and what Ray Data's AutoscalingCoordinator gave each execution holding a request
while each mode ran, read from Ray Data's log (Ray Data 2.60 shares a node's CPUs out among the executions
in flight). A pass's only /proc walks are the two of its cores figure (psutil, the same in both modes);
the per-part split, with its longer walks, is left out: a pass started ahead would decode on during it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import BATCH, timed_pass

from raytrain.recipe.data import augment, pipeline, shards, source

MODES = ("sequential", "ahead")
CPUS = 2


def _then(batches: Iterable[Any], at_first: Callable[[], None]) -> Iterator[Any]:
    """``batches``, calling ``at_first`` once the first has arrived."""
    it = iter(batches)
    for first in itertools.islice(it, 1):
        at_first()
        yield first
        yield from it


def one_round(train: Any, passes: int, ahead: bool) -> dict[str, Any]:
    def new_pass() -> Any:
        return train.iter_torch_batches(batch_size=BATCH)

    t0 = time.perf_counter()
    timed: list[dict[str, float]] = []
    nxt: shards._Started | None = None  # the next pass, started on a thread of its own
    for i in range(passes):
        batches = nxt.take() if nxt is not None else new_pass()
        nxt = None
        if ahead and i + 1 < passes:

            def start() -> None:
                nonlocal nxt
                nxt = shards._Started(iter(new_pass()))

            batches = _then(batches, start)
        timed.append(timed_pass(batches, by_part=False))
    seconds = time.perf_counter() - t0
    return {"passes": timed, "images_per_s": sum(p["images"] for p in timed) / seconds}


_BLOCK = re.compile(
    r"^(\S+ \S+)\s+DEBUG default_autoscaling_coordinator.*Reserved resources:\n((?:Requester .*\n)*)", re.M
)
_CPU = re.compile(r"CPU: ([0-9.]+)")


def reservations(log: str, windows: list[tuple[str, float, float]]) -> dict[str, dict[str, int]]:
    """From Ray Data's log, by the mode whose round was running (``windows``: mode, start, end, in epoch
    seconds): how often each reservation was seen, as "<executions holding a request>: <CPUs each holds>"
    (the CPUs summed over nodes, after ``has``: what the coordinator gave, not what was asked)."""
    seen: dict[str, collections.Counter[str]] = {}
    for stamp, block in _BLOCK.findall(log):
        at = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        mode = next((m for m, start, end in windows if start <= at <= end), "between rounds")
        holders = block.strip().splitlines()
        held = [sum(float(c) for c in _CPU.findall(h.partition(" has ")[2])) for h in holders]
        key = f"{len(holders)}: {', '.join(f'{c:g}' for c in held)}" if holders else "0"
        seen.setdefault(mode, collections.Counter())[key] += 1
    return {mode: dict(counts.most_common()) for mode, counts in seen.items()}


def _spread(values: list[float], fmt: str) -> str:
    """ " (min-max)" of several values; nothing for one (a single sample is not a range)."""
    return f" ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from ray.data._internal.logging import get_log_directory

    from raytrain.service import cluster

    aug = augment.Augment(preset="crop-flip")
    with cluster.connect(dashboard=False):
        train = pipeline.Streams(
            source.inspect(a.data), image_size=224, val_fraction=1e-9, aug=aug, data_cpus=CPUS
        ).train()
        timed_pass(train.iter_torch_batches(batch_size=BATCH))  # Ray Data's worker processes start here
        rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        windows: list[tuple[str, float, float]] = []
        for r in range(a.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:  # ABBA: neither always goes first
                start = time.time()
                rounds[mode].append(one_round(train, a.passes, ahead=mode == "ahead"))
                windows.append((mode, start, time.time()))
        log = Path(get_log_directory() or ".") / "ray-data.log"
        held = reservations(log.read_text() if log.exists() else "", windows)
    result = {"rounds": rounds, "reservations_seen": held}
    Path(a.out).write_text(json.dumps(result, indent=1))
    for mode, runs in rounds.items():
        rates = [r["images_per_s"] for r in runs]
        first = [r["passes"][0]["images_per_s"] for r in runs]
        later = [p for r in runs for p in r["passes"][1:]]
        print(
            f"{mode}: {statistics.median(rates):.0f} img/s over {a.passes} passes{_spread(rates, '.0f')};"
            f" the first pass {statistics.median(first):.0f} img/s; later passes"
            f" {statistics.median(p['images_per_s'] for p in later):.0f} img/s, first batch"
            f" {statistics.median(p['first_batch_s'] for p in later):.2f} s, cores of the whole tree"
            f" {statistics.median(p['cores'] for p in later):.2f}"
        )
    ratio = [b["images_per_s"] / s["images_per_s"] for s, b in zip(rounds["sequential"], rounds["ahead"], strict=True)]
    print(f"ahead / sequential, round by round: median {statistics.median(ratio):.2f}{_spread(ratio, '.2f')}")
    print("reservations seen (executions holding a request: the CPUs each holds), by mode:", held)


if __name__ == "__main__":
    main()
