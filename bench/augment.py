"""What training augmentation costs: `raytrain fit` on the embedded digits with no augmentation, with
crop-flip, and with crop-flip plus TrivialAugment, interleaved; steady-state samples/s (epoch 2 on) and
final validation accuracy, medians over the rounds.

    PYTHONPATH=. .venv/bin/python bench/augment.py --rounds 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile

PRESETS: dict[str, tuple[str, ...]] = {
    "none": ("--augment", "none"),
    "crop-flip": ("--augment", "crop-flip"),
    "crop-flip + ta_wide": ("--augment", "crop-flip", "--auto-augment", "ta_wide"),
}
EPOCH = re.compile(r"^epoch +(\d+)/\d+ .* val_acc +([\d.]+)% +([\d,]+) samples/s", re.M)


def run(args: tuple[str, ...], epochs: int, storage: str) -> tuple[float, float]:
    """Median samples/s from the second epoch on, and the last epoch's val_acc."""
    cmd = [sys.executable, "-m", "raytrain", "fit", "--workers", "2", "--epochs", str(epochs), *args]
    out = subprocess.run([*cmd, "--storage", storage, "--fresh"], capture_output=True, text=True, check=True).stdout
    epochs_seen = [(int(e), float(acc), float(rate.replace(",", ""))) for e, acc, rate in EPOCH.findall(out)]
    assert len(epochs_seen) == epochs, out
    return statistics.median(r for e, _, r in epochs_seen if e > 1), epochs_seen[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    rates: dict[str, list[float]] = {p: [] for p in PRESETS}
    accs: dict[str, list[float]] = {p: [] for p in PRESETS}
    with tempfile.TemporaryDirectory() as storage:
        for i in range(args.rounds):
            for preset, flags in PRESETS.items():
                rate, acc = run(flags, args.epochs, storage)
                rates[preset].append(rate)
                accs[preset].append(acc)
                print(f"round {i + 1} {preset}: {rate:.0f} samples/s, val_acc {acc:.1f}%", flush=True)
    base = statistics.median(rates["none"])
    for preset in PRESETS:
        rate = statistics.median(rates[preset])
        acc = statistics.median(accs[preset])
        print(
            f"{preset}: median {rate:.0f} samples/s ({rate / base:.2f} of none), "
            f"val_acc {acc:.1f}% after {args.epochs} epochs"
        )


if __name__ == "__main__":
    main()
