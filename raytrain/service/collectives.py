"""The few collectives the training loop needs, each a no-op outside a process group (one worker)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

import torch
import torch.distributed as dist


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


@overload
def all_reduce(values: Mapping[str, float], device: torch.device, op: Any) -> dict[str, float]: ...
@overload
def all_reduce(values: Sequence[float], device: torch.device, op: Any) -> list[float]: ...
def all_reduce(
    values: Mapping[str, float] | Sequence[float], device: torch.device, op: Any
) -> dict[str, float] | list[float]:
    """``values`` reduced with ``op`` (``dist.ReduceOp.SUM``, ``MAX``, ...) over every rank, in one
    collective. By name (a dict in, a dict out: every rank gives the same names), or by position (a list)."""
    if isinstance(values, Mapping):
        names = sorted(values)
        return dict(zip(names, all_reduce([float(values[n]) for n in names], device, op), strict=True))
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if _in_group():
        dist.all_reduce(t, op=op)
    return [float(v) for v in t.tolist()]


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (any picklable object)."""
    if not _in_group():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
