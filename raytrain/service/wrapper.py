"""What the service runs on every worker around a training function: the worker's threads, the job's
preemption channels, progress within an epoch, and the events the driver records (where each rank
runs, why training stopped)."""

from __future__ import annotations

import inspect
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrain.contracts.result import Placement

SETUP = "raytrain"  # the key of the service's part of the train_loop_config


@dataclass(frozen=True)
class WorkerSetup:
    train_func: Callable[..., Any]
    config: object | None  # the training function's own argument (None: it takes no argument)
    events: Any  # the driver's event queue (ray.util.queue.Queue)
    preempt_flag: str | None
    cpus_per_worker: float
    run_name: str = ""  # the run and Slurm job ("local" outside one): tags of the Ray metrics
    job: str = "local"
    lock: Any = None  # the driver's run lock (runlock.Guard): checked before each checkpoint is written


def driven_by_service(train_loop_config: dict[str, Any] | None) -> bool:
    return isinstance((train_loop_config or {}).get(SETUP), WorkerSetup)


def required_args(func: Callable[..., Any]) -> int:
    """How many arguments a train_loop_per_worker requires (Ray runs those taking 0, or 1: its config)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return 1
    return len([p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])


def run_worker(loop_config: dict[str, Any]) -> None:
    """The function Ray Train runs on every worker: set up, then the training function."""
    import ray
    import ray.train
    import ray.train.torch
    import torch

    from raytrain.service import preemption, sharded, telemetry
    from raytrain.service.events import EndedEarly, WorkerStarted, post

    started_at = time.time()
    setup: WorkerSetup = loop_config[SETUP]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":  # as many threads as CPUs reserved: no oversubscription beside Ray Data
        torch.set_num_threads(max(1, int(setup.cpus_per_worker)))
    preemption.configure(setup.preempt_flag)
    telemetry.configure(setup.events, rank=rank, world=world, run=setup.run_name, job=setup.job)
    where = Placement(rank=rank, hostname=socket.gethostname(), ip=ray.util.get_node_ip_address(), device=str(device))
    post(setup.events, WorkerStarted(placement=where, started_at=started_at, world_size=world))
    if setup.config is None:
        setup.train_func()
    else:
        setup.train_func(setup.config)
    via = preemption.ending_reason()
    if rank == 0 and via:
        post(setup.events, EndedEarly(via=via, abandoned_save=sharded.abandoned(), not_whole=sharded.not_whole()))
