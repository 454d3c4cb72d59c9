"""End to end on data that streams: `raytrain fit --stream` against torchrun + DataLoader, same JPEGs.

    python bench/make_data.py /tmp/photos/p224-3000.parquet --photos 224 --rows 3000
    python bench/stream_e2e.py /tmp/photos/p224-3000.parquet [--pairs 3] [--epochs 4] --out e2e.json \\
        [--normal-too | --pinned-too]

Both sides train the same rows (raytrain's hash split), model, batch, optimizer, seed and training
augmentation (raytrain's own crop-flip, decoded again every epoch from the encoded JPEGs), and validate
every epoch on the held-out rows. The same cores: one training process with one thread and the rest of the
machine for the data. raytrain: `--workers 1 --cpus-per-worker 1` on its local Ray (2 CPUs here), so Ray
Data's tasks get the other CPU. The peer: bench/torchrun_ddp.py `--stream`, one rank and one DataLoader
worker process for training and one for validation (persistent, 4 batches prefetched each), `--hold-val`.

Both keep the first validation's decoded rows and replay them every later epoch (raytrain because they fit
its memory budget, the peer by `--hold-val`), and so start the next epoch's batches as an epoch's training
ends; in the first epoch, validation's batches while its last step runs and the next epoch's before the
checkpoint. The figure is images trained per second from the end of epoch 1's validation to the end of
epoch N's: training, validation and the checkpoints between (raytrain's report with its checkpoint, the
peer's `torch.save`), so what either side does during a checkpoint is on the clock. Pairs run
interleaved (raytrain, peer, raytrain, ...) and ratios are taken pair by pair.

`--normal-too` adds a third side to every round: raytrain with `--decode-priority normal` (its decoding at
Linux's default policy instead of SCHED_IDLE, which `auto` gives a rank on a CPU), the three runs of a round
in each of their 6 orders in turn, so that over 6 rounds each side runs in each place and after each other
side equally often.

`--pinned-too` asks what Ray's own processes cost the rank: it adds both sides again with the rank's
training thread (its busiest thread, once it is) alone on CPU 0 and every other thread of the run, the
rank's own helpers and Ray's daemons and actors among them, on the other CPUs (not yet the
command's own process nor this harness's main thread), set from outside by this
harness (a thread of its own, on those other CPUs, looks again every 0.25 s for 20 s, then every second).
The four sides run in a rotated order, round by round.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import med, spread

REPO = Path(__file__).resolve().parents[1]
WORK = {"model": "shufflenet_v2_x0_5", "image_size": 64, "batch_size": 64, "lr": 0.02, "seed": 0}


def per_epoch(history: list[dict[str, Any]], blocked: list[float]) -> dict[str, float]:
    """Images trained per second from the end of epoch 1's validation to the end of epoch N's: epochs
    2..N's training and validation and the N-1 checkpoints between them (``blocked``: how long each held
    training up), so that work either side starts during a checkpoint is on the clock. Also the share of
    that time spent waiting for training batches, and validation's time per epoch."""
    rest = history[1:] or history
    seconds = sum(e["epoch_time_s"] for e in rest) + sum(blocked)
    return {
        "images_per_s": sum(e["train_samples"] for e in rest) / seconds,
        "train_only_images_per_s": sum(e["train_samples"] for e in rest) / sum(e["train_time_s"] for e in rest),
        "data_wait_fraction": sum(e["data_wait_s"] for e in rest) / seconds,
        "val_s": med([e["epoch_time_s"] - e["train_time_s"] for e in rest]),
        "checkpoint_s": med(blocked),
    }


def ratios(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[float]:
    """Images/s of one side over another's, round by round."""
    return [r["images_per_s"] / p["images_per_s"] for r, p in zip(ours, theirs, strict=True)]


def is_rank(proc: psutil.Process) -> bool:
    """raytrain's training worker, or the torchrun rank (the launcher's child, not a DataLoader worker)."""
    cmd = " ".join(proc.cmdline())
    if cmd.startswith("ray::RayTrainWorker"):
        return True
    parent = proc.parent() if "torchrun_ddp.py" in cmd else None
    return parent is not None and "torch.distributed.run" in " ".join(parent.cmdline())


def pin(root: int, done: threading.Event) -> None:
    """Until ``done``: the rank's busiest thread on CPU 0, every other thread under ``root`` on the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    alone, rest = {cpus[0]}, set(cpus[1:])
    os.sched_setaffinity(0, rest)  # this thread only
    set_to: dict[int, set[int]] = {}
    started = time.monotonic()
    while not done.is_set():
        try:
            procs = psutil.Process(root).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                threads = proc.threads()
                top = max(threads, key=lambda t: t.user_time + t.system_time).id if is_rank(proc) else None
                for t in threads:
                    want = alone if t.id == top else rest
                    if set_to.get(t.id) != want:
                        os.sched_setaffinity(t.id, want)
                        set_to[t.id] = want
            except (psutil.Error, OSError):  # gone since it was listed
                continue
        done.wait(0.25 if time.monotonic() - started < 20 else 1.0)


def run(cmd: list[str], env: dict[str, str], what: str, pinned: bool = False) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    done = threading.Event()
    if pinned:
        threading.Thread(target=pin, args=(proc.pid, done), daemon=True).start()
    out, err = proc.communicate()
    done.set()
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out[-3000:]}\n{err[-3000:]}")


def raytrain_side(data: Path, work: Path, epochs: int, priority: str = "auto", pinned: bool = False) -> dict[str, Any]:
    storage = work / "runs"
    cmd = [sys.executable, "-m", "raytrain", "fit", "--stream", "--workers", "1", "--cpus-per-worker", "1",
           "--device", "cpu", "--data", str(data), "--storage", str(storage), "--name", "e2e", "--fresh",
           "--epochs", str(epochs), "--augment", "crop-flip", "--model", WORK["model"],
           "--image-size", str(WORK["image_size"]), "--batch-size", str(WORK["batch_size"]),
           "--lr", str(WORK["lr"]), "--seed", str(WORK["seed"]), "--decode-priority", priority]  # fmt: skip
    run(cmd, {"RAY_ADDRESS": ""}, "raytrain fit --stream", pinned)
    hist = json.loads((storage / "e2e" / "result.json").read_text())["history"]
    # An epoch's checkpoint_blocked_s is the report before it: epochs 2..N carry the saves after 1..N-1.
    return {**per_epoch(hist, [e["checkpoint_blocked_s"] for e in hist[1:]]), "final_loss": hist[-1]["train_loss"]}


def peer_side(data: Path, work: Path, epochs: int, pinned: bool = False) -> dict[str, Any]:
    out = work / "peer.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(REPO / "bench/torchrun_ddp.py"), "--data", str(data), "--epochs", str(epochs), "--stream",
           "--loader-workers", "1", "--augment", "crop-flip", "--model", WORK["model"],
           "--image-size", str(WORK["image_size"]), "--batch-size", str(WORK["batch_size"]),
           "--lr", str(WORK["lr"]), "--seed", str(WORK["seed"]), "--save", "torch", "--save-dir", str(work),
           "--hold-val", "--out", str(out)]  # fmt: skip
    run(cmd, {"OMP_NUM_THREADS": "1"}, "torchrun peer", pinned)
    hist = json.loads(out.read_text())["epochs"]
    return {**per_epoch(hist, [e["checkpoint_blocked_s"] for e in hist[:-1]]), "final_loss": hist[-1]["train_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    both = ap.add_mutually_exclusive_group()
    both.add_argument("--normal-too", action="store_true", help="also raytrain with --decode-priority normal")
    both.add_argument("--pinned-too", action="store_true", help="also both sides with the rank alone on CPU 0")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.normal_too and a.pairs % 6:
        ap.error("--normal-too runs the 6 orders of its three sides in turn: give --pairs as a multiple of 6")
    sides: dict[str, Any] = {
        "raytrain": lambda work: raytrain_side(a.data, work, a.epochs),
        "peer": lambda work: peer_side(a.data, work, a.epochs),
    }
    if a.normal_too:
        sides["raytrain_normal"] = lambda work: raytrain_side(a.data, work, a.epochs, "normal")
    if a.pinned_too:
        sides["raytrain_pinned"] = lambda work: raytrain_side(a.data, work, a.epochs, pinned=True)
        sides["peer_pinned"] = lambda work: peer_side(a.data, work, a.epochs, pinned=True)
    result: dict[str, Any] = {name: [] for name in sides} | {"work": WORK, "epochs": a.epochs, "date": time.ctime()}
    names = tuple(sides)
    if a.normal_too:
        orders = list(itertools.permutations(names))
    else:  # rotated: each side runs first in turn
        orders = [names[i:] + names[:i] for i in range(len(names) if a.pinned_too else 1)]
    for i in range(a.pairs):
        for name in orders[i % len(orders)]:
            with tempfile.TemporaryDirectory(prefix="e2e-") as tmp:
                result[name].append(sides[name](Path(tmp)))
        print(f"round {i + 1}: " + ", ".join(f"{n} {result[n][-1]}" for n in sides), flush=True)
    result["ratio"] = ratios(result["raytrain"], result["peer"])
    if a.normal_too:
        result["ratio_normal"] = ratios(result["raytrain_normal"], result["peer"])
        result["idle_over_normal"] = ratios(result["raytrain"], result["raytrain_normal"])
    if a.pinned_too:
        result["ratio_pinned"] = ratios(result["raytrain_pinned"], result["peer_pinned"])
    a.out.write_text(json.dumps(result, indent=1))
    for key in ("images_per_s", "train_only_images_per_s", "data_wait_fraction", "val_s", "checkpoint_s"):
        digits = 0 if "images" in key else 2
        print(f"{key}: " + ", ".join(f"{n} {spread([r[key] for r in result[n]], digits)}" for n in sides))
    print(f"ratio (raytrain / peer, pair by pair): {spread(result['ratio'], 2)}")
    if a.normal_too:
        print(f"ratio with --decode-priority normal: {spread(result['ratio_normal'], 2)}")
        print(f"idle / normal, round by round: {spread(result['idle_over_normal'], 2)}")
    if a.pinned_too:
        print(f"ratio, both sides pinned: {spread(result['ratio_pinned'], 2)}")


if __name__ == "__main__":
    main()
