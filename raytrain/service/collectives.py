"""The few collectives the training loop needs, each a no-op outside a process group (one worker)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce(values: Mapping[str, float], device: torch.device, op: Any) -> dict[str, float]:
    """``values`` reduced by name with ``op`` (``dist.ReduceOp.SUM``, ``MAX``, ...) over every rank, in one
    collective: every rank gives the same names."""
    names = sorted(values)
    t = torch.tensor([float(values[n]) for n in names], dtype=torch.float64, device=device)
    if _in_group():
        dist.all_reduce(t, op=op)
    return dict(zip(names, t.tolist(), strict=True))


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (any picklable object)."""
    if not _in_group():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
