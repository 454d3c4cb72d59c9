"""``raytrain fit``: check everything, plan placement, train with Ray Train, write ``result.json``.

Order matters: every check that can fail on user input (storage, data, model, run name, worker count)
runs before any worker starts, so mistakes cost seconds and never touch existing checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
import time
from collections.abc import Callable, Sequence
from typing import Any

from raytrain import __version__, cluster, models, placement, runs
from raytrain.config import EMBEDDED_DATA, FitConfig
from raytrain.data import digits, source

Echo = Callable[[str], None]

EXIT_OK, EXIT_FAILED = 0, 1
# The run stopped early with a checkpoint because the job is ending (EX_TEMPFAIL): requeue and resume.
EXIT_PREEMPTED = 75


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A resolved config and everything checked about it, ready to train."""

    cfg: FitConfig
    src: source.DataSource
    run: runs.RunState
    storage_fs: Any
    storage_root: str


def prepare(cfg: FitConfig) -> Prepared:
    """All driver-side checks that need no cluster: storage, data, model, run directory."""
    fs, root = source.resolve_uri(cfg.run.storage)
    runs.check_writable(fs, root, cfg.run.storage)
    if cfg.data.uri == EMBEDDED_DATA:
        src = source.inspect(digits.ensure(fs, root), filesystem=fs)
    else:
        src = source.inspect(cfg.data.uri)
    models.check(cfg.model.name)
    data = dataclasses.replace(
        cfg.data, image_size=cfg.data.image_size or src.image_size or 224, num_classes=src.num_classes
    )
    cfg = dataclasses.replace(cfg, data=data)
    run = runs.open_run(fs, root, cfg, dry_run=cfg.dry_run)
    return Prepared(cfg=cfg, src=src, run=run, storage_fs=fs, storage_root=root)


def _describe(p: Prepared, echo: Echo) -> None:
    src = p.src
    split = f"{src.val_rows} in val/" if src.val_files else f"~{p.cfg.data.val_fraction:.0%} held out by hash"
    echo(
        f"data: {src.uri}: {src.train_rows} rows ({split}), {src.num_classes} classes, "
        f"images resized to {p.cfg.data.image_size}px"
    )
    if p.run.moved_aside:
        echo(f"run: --fresh: the previous run moves to {p.run.moved_aside}")
    if p.run.resume:
        found = p.run.resume
        echo(
            f"run: {p.run.path}: resuming from {posixpath.basename(found.path)} "
            f"(epoch {found.epoch} of {p.cfg.optim.epochs} done)"
        )
    else:
        echo(f"run: {p.run.path}: new run")


def run(cfg: FitConfig, echo: Echo) -> int:
    started = time.time()
    p = prepare(cfg)
    _describe(p, echo)
    if p.run.resume and p.run.completed_epochs >= p.cfg.optim.epochs and not p.run.resume.batches_done:
        echo(
            f"nothing to do: run {p.cfg.run.name!r} already completed {p.run.completed_epochs} epochs; "
            "raise --epochs to train further"
        )
        return EXIT_OK
    local = cluster.expected_local_node()
    if local is not None:  # plan before booting Ray, so a bad request fails in a second
        p, plan = _planned(p, [local])
        if p.cfg.dry_run:
            return _print_plan(p, plan, echo)
    with cluster.connect(dashboard=True) as info:
        p, plan = _planned(p, info.nodes)
        if p.cfg.dry_run:
            return _print_plan(p, plan, echo)
        echo(plan.render())
        if info.dashboard_url:
            echo(f"dashboard: {info.dashboard_url} (token: {info.token_path})")
        with runs.locked(p.storage_fs, p.run.path, p.cfg.run.name):
            return _train(p, plan, echo, started, memory_budget=info.object_store_bytes // 4)


def _planned(p: Prepared, nodes: Sequence[cluster.NodeInfo]) -> tuple[Prepared, placement.Plan]:
    plan = placement.make_plan(nodes, p.cfg.scale)
    scale = dataclasses.replace(p.cfg.scale, workers=plan.workers, cpus_per_worker=plan.cpus_per_worker)
    return dataclasses.replace(p, cfg=dataclasses.replace(p.cfg, scale=scale)), plan


def _print_plan(p: Prepared, plan: placement.Plan, echo: Echo) -> int:
    echo("config: " + json.dumps(p.cfg.to_dict(), indent=2, sort_keys=True))
    echo(plan.render())
    return EXIT_OK


def _train(p: Prepared, plan: placement.Plan, echo: Echo, started: float, *, memory_budget: int) -> int:
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain.data import pipeline
    from raytrain.progress import Reports, epoch_line
    from raytrain.torch_backend import PinnedPortTorchConfig
    from raytrain.train_loop import train_worker

    cfg = p.cfg
    assert cfg.data.image_size is not None
    data = pipeline.build(
        p.src, image_size=cfg.data.image_size, val_fraction=cfg.data.val_fraction,
        batch_size=cfg.optim.batch_size, memory_budget=memory_budget,
    )  # fmt: skip
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            "config": cfg,
            "run_fs": p.storage_fs,
            "run_dir": p.run.path,
            "resume": p.run.resume.path if p.run.resume else None,
            "preempt_flag": cluster.preempt_flag_path(),
            "shuffle_buffer": data.shuffle_buffer,
            "synthetic_steps": _synthetic_steps(p, plan) if cfg.data.synthetic else None,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=plan.workers,
            use_gpu=plan.use_gpu,
            resources_per_worker=plan.resources_per_worker(),
            label_selector=plan.label_selectors(),
        ),
        torch_config=PinnedPortTorchConfig(backend=plan.backend, timeout_s=cfg.scale.pg_timeout_s),
        datasets={pipeline.VAL: data.val} if cfg.data.synthetic else data.for_trainer(),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=p.storage_root,
            storage_filesystem=p.storage_fs,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep),
            # A deterministic error would fail again: fail fast and let the user (or requeue) resume. A
            # preemption ends the run with a checkpoint: the job requeues, rather than Ray rescheduling
            # onto nodes that are going away.
            failure_config=ray.train.FailureConfig(max_failures=0, max_preemption_failures=0),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )
    job_start = cluster.job_start_time()
    since, what = (job_start, "job") if job_start else (started, "command")

    def on_epoch(record: dict[str, Any]) -> None:
        startup = record["workers"][0].get("startup")
        if startup and startup["first_step_at"]:
            echo(
                f"first training step {startup['first_step_at'] - since:.1f} s after the {what} started "
                f"(workers running at {startup['worker_at'] - since:.1f} s, "
                f"first batch at {startup['first_batch_at'] - since:.1f} s)"
            )
        echo(epoch_line(record["workers"][0]))

    reports = Reports(on_epoch)
    trainer.run_config.callbacks.append(reports.callback())
    error: BaseException | None = None
    with reports:
        try:
            trainer.fit()
        except ray.train.TrainingFailedError as exc:
            error = exc
        except SystemExit as exc:
            # Ray Train's own Ctrl-C handler aborts the run, then ends it with SystemExit(1): make that the
            # interruption it is, so the local cluster is stopped and the CLI says so (exit 130).
            raise KeyboardInterrupt from exc
    result = _result(p, plan, reports.epochs, started, error)
    runs.write_json(p.storage_fs, posixpath.join(p.run.path, runs.RESULT), result)
    if result["status"] == "preempted":
        echo(
            f"preempted: checkpoint {posixpath.basename(result['last_checkpoint'])} saved; "
            "rerun the same command (or let the job requeue) to resume"
        )
        return EXIT_PREEMPTED
    if error is not None:
        echo(f"training failed after {result['epochs_completed']} epochs: {_summary(error)}")
        echo(f"result: {posixpath.join(p.run.path, runs.RESULT)}")
        return EXIT_FAILED
    final = result["final"]
    echo(
        f"done: {result['epochs_completed']} epochs, val_acc {100 * final.get('val_acc', 0):.1f}%, "
        f"{plan.workers} workers on {len(plan.nodes)} node(s), {result['wall_time_s']:.0f} s; "
        f"result: {posixpath.join(p.run.path, runs.RESULT)}"
    )
    return EXIT_OK


def _synthetic_steps(p: Prepared, plan: placement.Plan) -> int:
    """Steps per epoch per rank that the real training split would give."""
    from raytrain.data import pipeline

    rows = pipeline.train_rows(p.src, p.cfg.data.val_fraction)
    return max(1, math.ceil((rows // plan.workers) / p.cfg.optim.batch_size))


def _summary(error: BaseException) -> str:
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    tail = [ln.strip() for ln in lines if not ln.startswith((" ", "Traceback"))]
    return tail[-1] if tail else type(error).__name__


def _result(
    p: Prepared, plan: placement.Plan, epochs: list[dict[str, Any]], started: float, error: BaseException | None
) -> dict[str, Any]:
    import ray
    import torch

    from raytrain import checkpoint

    last = epochs[-1]["workers"] if epochs else None
    first = epochs[0]["workers"][0] if epochs else {}
    latest = checkpoint.latest(p.storage_fs, p.run.path)
    keys = ("train_loss", "train_acc", "val_loss", "val_acc", "samples_per_s", "epoch_time_s", "data_wait_s",
            "train_time_s", "train_samples", "checkpoint_blocked_s")  # fmt: skip
    preempted = bool(last and last[0].get("preempted"))
    return {
        "name": p.cfg.run.name,
        "status": "failed" if error else "preempted" if preempted else "completed",
        "preempted_via": last[0].get("preempted") if last else None,
        "error": _summary(error) if error else None,
        "epochs_completed": latest.epoch if latest else 0,
        "epochs": p.cfg.optim.epochs,
        "epochs_this_attempt": len(epochs),
        "world_size": plan.workers,
        "backend": plan.backend,
        "final": {k: last[0].get(k) for k in keys} if last else {},
        "history": [{k: r["workers"][0].get(k) for k in ("epoch", "batches_done", *keys)} for r in epochs],
        "placement": sorted((w["worker"] for w in last), key=lambda w: w["rank"]) if last else plan.to_json(),
        "last_checkpoint": latest.path if latest else None,
        "resumed_from": first.get("resumed"),
        "wall_time_s": time.time() - started,
        "startup_s": {
            k.removesuffix("_at"): v - (cluster.job_start_time() or started) for k, v in first["startup"].items() if v
        }
        if first.get("startup")
        else None,
        "config": p.cfg.to_dict(),
        "versions": {"raytrain": __version__, "ray": ray.__version__, "torch": torch.__version__},
    }
