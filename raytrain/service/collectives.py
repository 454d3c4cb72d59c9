"""The few collectives the training loop needs, each a no-op outside a process group (one worker)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce(values: list[float], device: torch.device, op: Any) -> list[float]:
    """``values`` reduced with ``op`` (``dist.ReduceOp.SUM``, ``MAX``, ...) over every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
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
