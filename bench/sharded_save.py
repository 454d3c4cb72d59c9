"""Training blocked by a sharded checkpoint: ``raytrain.save_sharded`` against the save an expert writes
by hand, side by side in one Ray Train run.

    PYTHONPATH=. .venv/bin/python bench/sharded_save.py --params-mb 300 --rounds 5 --out bench/results/sharded_save.json

Two workers (gloo, this machine's 2 cores), an FSDP2 model (``raytrain.shard``) of ``--params-mb`` MB of
float32 parameters in 2048x2048 blocks, with AdamW's state: three times that in all, half on each rank.
Each round saves once with each side, in rotating order, the run's storage on disk:
- peer: what Ray's docs and an expert write: ``torch.distributed.checkpoint.save`` into a local temp
  directory, then ``ray.train.report`` with Ray Train's own asynchronous upload
  (``checkpoint_upload_mode=ASYNC``): training waits for the whole write, not for the copy;
- async: what an expert writes for speed: ``torch.distributed.checkpoint.async_save`` straight into the
  run's storage from every rank, in a gloo group of its own, training waiting only while the state is
  staged into host memory; once the write is done (checked after the timed steps), ``ray.train.report``
  of that directory with ``checkpoint_upload_mode=NO_UPLOAD`` (that wait and that report count as
  blocked time, as the other sides' reports do). One write, no local copy; no record of what was
  written, and no bound on the save that the job's end asks for;
- raytrain: ``raytrain.save_sharded``: training waits while the state is copied into host memory; the
  write and the copy go on in the background (and each rank records its files' CRC32s).
After each save, ``--steps`` training steps are timed (the background work shares the 2 cores), then a
metrics-only report waits until the checkpoint is in storage, so no round's work spills into the next.
Figures are rank 0's: per side, the median blocked seconds and the median step time after the save, with
the ratio round by round; a step time with no save going on is measured in each round too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

WIDTH = 2048
SIDES = ("raytrain", "peer", "async")


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    import torch
    import torch.distributed as dist
    from ray.train import CheckpointUploadMode
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    import raytrain
    from raytrain.service.sharded import dcp_state

    torch.manual_seed(0)
    blocks = max(1, round(config["params_mb"] * 2**20 / 4 / (WIDTH * WIDTH)))
    net = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(blocks)))
    model = raytrain.shard(net, blocks=list(net))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(8, WIDTH)

    def steps(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - start) / n

    def peer(name: str) -> None:
        staging = tempfile.mkdtemp(prefix="peer-")
        save(dcp_state(model, optimizer), storage_writer=FileSystemWriter(staging, single_file_per_rank=True))
        ray.train.report(
            {"side": "peer"},
            checkpoint=ray.train.Checkpoint.from_directory(staging),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=True,
        )

    group = dist.new_group(backend="gloo")  # DCP's advice for async_save: a group apart from training's
    writing: dict[str, Any] = {}

    def expert_async(name: str) -> None:
        path = f"{ray.train.get_context().get_storage().experiment_fs_path}/{name}"
        writing[name] = (async_save(dcp_state(model, optimizer), checkpoint_id=path, process_group=group), path)

    def report_async(name: str) -> None:
        future, path = writing.pop(name)
        future.result()
        ray.train.report(
            {"side": "async"},
            checkpoint=ray.train.Checkpoint(path),
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )

    steps(3)  # warm-up: the optimizer's state exists from here
    n = int(config["steps"])
    rows: list[dict[str, float]] = []
    for r in range(int(config["rounds"]) + 1):  # round 0 warms both sides up
        row = {"idle_step_s": steps(n)}
        order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
        if r % 2:  # reversed every other round: no side always follows the same one (and its dirty pages)
            order = order[::-1]
        for side in order:
            dist.barrier()
            start = time.perf_counter()
            if side == "raytrain":
                raytrain.save_sharded(model, optimizer, metrics={"side": side}, name=f"raytrain-{r}")
            elif side == "async":
                expert_async(f"async-{r}")
            else:
                peer(f"peer-{r}")
            row[f"{side}_blocked_s"] = time.perf_counter() - start
            row[f"{side}_step_s"] = steps(n)
            if side == "async":  # its wait for the write and its report stop training too: counted
                start = time.perf_counter()
                report_async(f"async-{r}")
                row["async_blocked_s"] += time.perf_counter() - start
            ray.train.report({"side": "drain"})  # Ray Train keeps reports in order: back once the copy is done
            raytrain.wait_sharded()
            dist.barrier()
        if r:
            rows.append(row)
    if ray.train.get_context().get_world_rank() == 0:
        state = dcp_state(model, optimizer)
        mb = sum(_local_bytes(t) for t in _tensors(state)) / 2**20
        with open(config["out"], "w") as f:
            json.dump({"rows": rows, "state_mb_rank0": mb, "blocks": blocks}, f)


def _tensors(state: Any) -> list[Any]:
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return [state] if hasattr(state, "element_size") else []


def _local_bytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def summarize(rows: list[dict[str, float]], params_mb: int, state_mb: float, steps: int) -> dict[str, Any]:
    """Medians per side, and ratios round by round. ``lost_s``: what a save cost training in all, the
    seconds it blocked plus what the next ``steps`` steps took beyond a step with no save going on."""
    for r in rows:
        for side in SIDES:
            r[f"{side}_lost_s"] = r[f"{side}_blocked_s"] + steps * (r[f"{side}_step_s"] - r["idle_step_s"])
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}

    def ratios(key: str, peer: str = "peer") -> list[float]:
        return [r[f"raytrain_{key}"] / r[f"{peer}_{key}"] for r in rows]

    return {
        "params_mb": params_mb,
        "state_mb_per_rank": round(state_mb, 1),
        "rounds": len(rows),
        "steps_after_each_save": steps,
        **{f"median_{k}": round(v, 4) for k, v in med.items()},
        **{
            f"{key}_ratio_median": round(statistics.median(ratios(key)), 3) for key in ("blocked_s", "step_s", "lost_s")
        },
        "blocked_ratio_range": [round(min(ratios("blocked_s")), 3), round(max(ratios("blocked_s")), 3)],
        "lost_ratio_range": [round(min(ratios("lost_s")), 3), round(max(ratios("lost_s")), 3)],
        **{
            f"{key}_ratio_to_async_median": round(statistics.median(ratios(key, "async")), 3)
            for key in ("blocked_s", "step_s", "lost_s")
        },
        "blocked_ratio_to_async_range": [
            round(min(ratios("blocked_s", "async")), 3),
            round(max(ratios("blocked_s", "async")), 3),
        ],
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-mb", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="training steps timed after each save")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from bench import two_workers

    config = {"params_mb": args.params_mb, "rounds": args.rounds, "steps": args.steps}
    found = two_workers.run(train_func, config)
    summary = summarize(found["rows"], args.params_mb, found["state_mb_rank0"], args.steps)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
