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

if TYPE_CHECKING:  # the public API for type checkers (at run time: _EXPORTS below)
    from raytrain.contracts.result import RunResult as RunResult
    from raytrain.errors import Fatal as Fatal
    from raytrain.errors import UserError as UserError
    from raytrain.service.collectives import all_reduce as all_reduce
    from raytrain.service.collectives import broadcast as broadcast
    from raytrain.service.config import RunConfig as RunConfig
    from raytrain.service.config import ScaleConfig as ScaleConfig
    from raytrain.service.events import Report as Report
    from raytrain.service.preemption import ending_reason as ending_reason
    from raytrain.service.preemption import ending_soon as ending_soon
    from raytrain.service.runs import RunDir as RunDir
    from raytrain.service.runs import Storage as Storage
    from raytrain.service.telemetry import progress as progress
    from raytrain.service.trainer import train as train
    from raytrain.service.workload import Placed as Placed
    from raytrain.service.workload import TrainFunction as TrainFunction
    from raytrain.service.workload import Workload as Workload

    __version__: str


# Each public name and the module it lives in: what ``__getattr__`` imports on first use. The block above says
# the same for type checkers; a test holds the two equal (a single list read from this file's source would
# break an install without sources, such as a bytecode-only image).
_EXPORTS = {
    "RunResult": "raytrain.contracts.result",
    "Fatal": "raytrain.errors",
    "UserError": "raytrain.errors",
    "all_reduce": "raytrain.service.collectives",
    "broadcast": "raytrain.service.collectives",
    "RunConfig": "raytrain.service.config",
    "ScaleConfig": "raytrain.service.config",
    "ending_reason": "raytrain.service.preemption",
    "ending_soon": "raytrain.service.preemption",
    "Report": "raytrain.service.events",
    "RunDir": "raytrain.service.runs",
    "Storage": "raytrain.service.runs",
    "progress": "raytrain.service.telemetry",
    "train": "raytrain.service.trainer",
    "Placed": "raytrain.service.workload",
    "TrainFunction": "raytrain.service.workload",
    "Workload": "raytrain.service.workload",
}
__all__ = sorted(_EXPORTS)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raytrain")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'raytrain' has no attribute {name!r}")
    globals()[name] = value  # once: a training loop may call raytrain.ending_soon() every step
    return value
