"""raytrain: PyTorch training across a Slurm allocation with Ray Train, as a service for any Ray Train code.

The public API (everything else is internal). In a driver::

    import raytrain

    result = raytrain.train(
        raytrain.TrainFunction(train_func, spec="mypkg.train:train_func", config={"lr": 0.1}),
        scale=raytrain.ScaleConfig(workers=4),
        run=raytrain.RunConfig(storage="/shared/runs", name="exp1"),
    )

Inside any Ray Train training function, on every rank (a collective)::

    raytrain.progress(step, samples=len(batch), steps=steps_per_epoch)  # after each step: live progress
    if raytrain.ending_soon():  # the Slurm job ends soon: save a checkpoint and return
        ...

The built-in ``raytrain fit`` recipe (``raytrain.recipe``) is a ``raytrain.Workload`` built on exactly
this API. Names are imported on first use, so ``import raytrain`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "train": "raytrain.service.trainer",
    "Workload": "raytrain.service.workload",
    "TrainFunction": "raytrain.service.workload",
    "Placed": "raytrain.service.workload",
    "ScaleConfig": "raytrain.service.config",
    "RunConfig": "raytrain.service.config",
    "RunDir": "raytrain.service.runs",
    "Storage": "raytrain.service.runs",
    "Report": "raytrain.service.progress",
    "ending_soon": "raytrain.service.preemption",
    "ending_reason": "raytrain.service.preemption",
    "progress": "raytrain.service.telemetry",
    "all_reduce": "raytrain.service.collectives",
    "broadcast": "raytrain.service.collectives",
    "RunResult": "raytrain.contracts.result",
    "UserError": "raytrain.errors",
    "Fatal": "raytrain.errors",
}
__all__ = [
    "Fatal",
    "Placed",
    "Report",
    "RunConfig",
    "RunDir",
    "RunResult",
    "ScaleConfig",
    "Storage",
    "TrainFunction",
    "UserError",
    "Workload",
    "all_reduce",
    "broadcast",
    "ending_reason",
    "ending_soon",
    "progress",
    "train",
]

if TYPE_CHECKING:
    from raytrain.contracts.result import RunResult
    from raytrain.errors import Fatal, UserError
    from raytrain.service.collectives import all_reduce, broadcast
    from raytrain.service.config import RunConfig, ScaleConfig
    from raytrain.service.preemption import ending_reason, ending_soon
    from raytrain.service.progress import Report
    from raytrain.service.runs import RunDir, Storage
    from raytrain.service.telemetry import progress
    from raytrain.service.trainer import train
    from raytrain.service.workload import Placed, TrainFunction, Workload


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raytrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: a training loop may call raytrain.ending_soon() every step
    return value
