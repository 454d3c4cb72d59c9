"""One GPU: `raytrain fit` against the plain PyTorch loop (bench/plain_loop.py), ResNet-50 in img/s.

    python bench/gpu.py [--rounds 3] [--out gpu.json]      # on a machine with one CUDA GPU

Both sides: ResNet-50 at 224x224, batch 256, bf16 autocast, channels_last, cuDNN autotuning, SGD with
Nesterov momentum, one pre-built batch (`raytrain fit --synthetic-data`, built once per run as the
peer builds it), so the figure is the training step itself and raytrain's overhead around it inside an
epoch's timer: the Ray Train worker and its threads, the per-step metrics and progress, the preemption
check. One worker has no DDP wrapper (raytrain wraps only at more than one rank), and the per-epoch
checkpoint and validation fall outside the epochs' train time that the figure is read from. Rounds
alternate plain, raytrain, plain, ...; medians and pairwise ratios. Targets: >= 4,000 img/s on an H100
and raytrain / plain >= 0.98. bench/compare.py runs this when CUDA is available.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from compare import steady  # bench/compare.py, next to this file

REPO = Path(__file__).resolve().parents[1]
MODEL, SIZE, BATCH = "resnet50", 224, 256
ROWS = 40_000  # 31,200 training rows: 122 steps of 256 per epoch
EPOCHS = 3  # steady state = epochs 2 and 3


def plain(out: Path) -> float:
    cmd = [sys.executable, str(REPO / "bench/plain_loop.py"), "--model", MODEL, "--image-size", str(SIZE),
           "--batch-size", str(BATCH), "--num-classes", "10", "--steps", "240", "--warmup", "30",
           "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return float(json.loads(out.read_text())["images_per_s"])


def raytrain(data: Path, storage: Path, name: str) -> float:
    cmd = [sys.executable, "-m", "raytrain", "fit", "--workers", "1", "--device", "gpu", "--data", str(data),
           "--storage", str(storage), "--name", name, "--fresh", "--model", MODEL, "--image-size", str(SIZE),
           "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--amp", "--synthetic-data"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RAY_ADDRESS": ""})
    if proc.returncode != 0:
        raise SystemExit(f"raytrain fit failed:\n{proc.stdout}\n{proc.stderr}")
    return steady(json.loads((storage / name / "result.json").read_text())["history"])


def measure(rounds: int, workdir: Path) -> dict[str, Any]:
    import torch

    data = workdir / f"digits-aug-{ROWS}.parquet"
    if not data.exists():
        subprocess.run([sys.executable, str(REPO / "bench/make_data.py"), str(data), "--rows", str(ROWS)], check=True)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "plain": [], "raytrain": []}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for i in range(rounds):
            res["plain"].append(plain(Path(tmp) / f"plain{i}.json"))
            res["raytrain"].append(raytrain(data, Path(tmp), f"gpu{i}"))
            print(f"gpu round {i + 1}/{rounds}: plain {res['plain'][-1]:.0f}, raytrain {res['raytrain'][-1]:.0f} img/s",
                  flush=True)  # fmt: skip
    res["ratios"] = [a / b for a, b in zip(res["raytrain"], res["plain"], strict=True)]
    return res


def markdown(res: dict[str, Any]) -> str:
    def fmt(xs: list[float], d: int = 0) -> str:  # one sample is a figure, not a range
        med = f"{statistics.median(xs):.{d}f}"
        return med if len(xs) == 1 else f"{med} ({min(xs):.{d}f}-{max(xs):.{d}f})"

    return "\n".join([
        f"GPU: {res['gpu']}; ResNet-50, 224x224, batch 256, bf16 autocast, channels_last, one pre-built batch; "
        f"{len(res['plain'])} interleaved rounds.",
        "",
        "| one GPU, img/s | raytrain fit | plain PyTorch loop | ratio |",
        "|---|---|---|---|",
        f"| ResNet-50 training | {fmt(res['raytrain'])} | {fmt(res['plain'])} | **{fmt(res['ratios'], 3)}**, "
        "target >= 0.98 (and >= 4,000 img/s on an H100) |",
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench/out/gpu.json")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: no CUDA GPU here; run it on a GPU node (bench/run.sh does when it finds one)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    res = measure(a.rounds, a.out.parent)
    a.out.write_text(json.dumps(res, indent=1))
    print(markdown(res))


if __name__ == "__main__":
    main()
