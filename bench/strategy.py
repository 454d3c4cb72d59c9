"""Step time of ``--strategy fsdp`` against ``ddp``, side by side in one Ray Train run, and the same two on
paper for 1-8 B parameter models on 8 GPUs.

    PYTHONPATH=. .venv/bin/python bench/strategy.py --rounds 5 --out bench/results/strategy.json
    PYTHONPATH=. .venv/bin/python bench/strategy.py --paper

Measured: two workers (gloo, this machine's 2 cores), the recipe's model (torchvision ResNet-18, 10
classes) built twice from one seed: once under DDP as the recipe wraps it, once sharded per residual
block as ``--strategy fsdp`` does (``raytrain.shard`` over ``raytrain.recipe.strategy.blocks``), each
with the recipe's optimizer (SGD, Nesterov momentum). Every round times ``--steps`` steps of each, in
alternating order, on the same batches (``--batch-size`` 32 x 32 px images per rank, as the embedded
digits train); figures are rank 0's medians, the ratio round by round.

On paper: bytes per rank (``raytrain.recipe.strategy.Estimate``: what ``--dry-run`` prints) and bytes
each rank sends per optimizer step for a decoder transformer of 1, 3 and 8 B parameters (Llama 3.2 1B and
3B, Llama 3.1 8B: their parameter and layer counts), bf16 compute, AdamW, on 8 GPUs of 80 GB (an H100
node). Ring collectives: an all-reduce sends 2(W-1)/W of its bytes, an all-gather or a reduce-scatter
(W-1)/W. DDP all-reduces float32 gradients once a step; FSDP2 all-gathers each block's bf16 parameters
in the forward pass and again in the backward pass (resharded in between) and reduce-scatters its float32
gradients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def train_func(config: dict[str, Any]) -> None:
    import copy

    import ray.train
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import raytrain
    from raytrain.recipe import models, strategy

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    whole = models.build("resnet18", 10)
    sharded = copy.deepcopy(whole)
    sides = {"ddp": DistributedDataParallel(whole), "fsdp": raytrain.shard(sharded, strategy.blocks(sharded))}
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4)
        for name, m in sides.items()
    }
    g = torch.Generator().manual_seed(rank)
    batch = int(config["batch_size"])
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def steps(name: str, n: int) -> float:
        model, optimizer = sides[name], optimizers[name]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - start) / n

    for name in sides:
        steps(name, 3)  # warm-up: the optimizer's state exists from here
    rows = []
    for r in range(int(config["rounds"])):
        row = {}
        for name in ("ddp", "fsdp") if r % 2 == 0 else ("fsdp", "ddp"):
            row[f"{name}_step_s"] = steps(name, int(config["steps"]))
        rows.append(row)
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"rows": rows}, f)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from bench import two_workers

    config = {"rounds": args.rounds, "steps": args.steps, "batch_size": args.batch_size}
    rows = two_workers.run(train_func, config)["rows"]
    ratios = [r["fsdp_step_s"] / r["ddp_step_s"] for r in rows]
    return {
        "model": "resnet18",
        "batch_per_rank": args.batch_size,
        "rounds": len(rows),
        "steps_per_round": args.steps,
        "median_ddp_step_s": round(statistics.median(r["ddp_step_s"] for r in rows), 4),
        "median_fsdp_step_s": round(statistics.median(r["fsdp_step_s"] for r in rows), 4),
        "step_ratio_fsdp_over_ddp_median": round(statistics.median(ratios), 3),
        "step_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "rows": rows,
    }


# name: (parameters, decoder layers, hidden size, input and output embeddings tied)
PAPER_MODELS = {
    "Llama 3.2 1B": (1_235_814_400, 16, 2048, True),
    "Llama 3.2 3B": (3_212_749_824, 28, 3072, True),
    "Llama 3.1 8B": (8_030_261_248, 32, 4096, False),
}
VOCABULARY = 128_256  # Llama 3's
GPUS, GPU_GB = 8, 80
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb


def paper() -> list[dict[str, Any]]:
    """Bytes per rank and bytes sent per rank per step, per model and strategy, on 8 GPUs. FSDP2's units:
    each decoder layer, and each embedding matrix on its own (the largest unit of the smaller models)."""
    import math

    from raytrain.recipe import strategy

    rows = []
    for name, (params, layers, hidden, tied) in PAPER_MODELS.items():
        embedding, matrices = VOCABULARY * hidden, 1 if tied else 2
        per_layer = (params - matrices * embedding) // layers
        units = layers + matrices
        est = strategy.Estimate(name, params, max(per_layer, embedding), optimizer_slots=2, compute_bytes=2)
        ring = (GPUS - 1) / GPUS
        sent = {"ddp": 2 * ring * 4 * params, "fsdp": ring * (2 * 2 * params + 4 * params)}
        collectives = {
            "ddp": f"{math.ceil(4 * params / DDP_BUCKET_BYTES)} all-reduces (25 MB buckets)",
            "fsdp": f"{2 * units} all-gathers, {units} reduce-scatters",
        }
        for chosen in strategy.STRATEGIES:
            total = est.total(chosen, GPUS)
            rows.append(
                {
                    "model": name,
                    "strategy": chosen,
                    "state_gb_per_rank": round(total / 1e9, 1),
                    "fits_80gb_before_activations": total < GPU_GB * 1e9,
                    "sent_gb_per_rank_per_step": round(sent[chosen] / 1e9, 1),
                    "collectives_per_step": collectives[chosen],
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="steps timed per side and round")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--paper", action="store_true", help="print the 1-8 B model on paper and stop")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.paper:
        for row in paper():
            print(json.dumps(row))
        return
    summary = {**measure(args), "paper_8_gpus": paper()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("rows", "paper_8_gpus")}))


if __name__ == "__main__":
    main()
