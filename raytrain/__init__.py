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
this API. Names are imported on first use, so ``import raytrain`` stays cheap: the one list of them, and
of the module each lives in, is ``__init__.pyi``, which type checkers read and lazy_loader (SPEC 1 of
Scientific Python) reads at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lazy_loader


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raytrain")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


_export: Callable[[str], Any] | None = None  # lazy_loader's, once it has read the stub


def __getattr__(name: str) -> Any:
    # Defined before the stub is read: with lazy_loader's EAGER_IMPORT set, reading it imports every
    # module at once, and those import raytrain's submodules and __version__ while this one is being made.
    if name == "__version__":
        value = _version()
    elif _export is None:
        raise AttributeError(f"module 'raytrain' has no attribute {name!r} yet")
    else:
        value = _export(name)
    globals()[name] = value  # once: a training loop may call raytrain.ending_soon() every step
    return value


try:
    _export, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
except ValueError as exc:  # the stub is missing from the install (an image slimmer deleted *.pyi files)
    raise ImportError(f"raytrain's list of exports is missing ({exc}): reinstall raytrain") from None
