"""Turning a run's reports into terminal lines and ``result.json`` (``raytrain.contracts.result``)."""

from __future__ import annotations

import errno
import sys
from typing import Any

from raytrain.contracts import metrics as keys


def _value(v: float | int | str | bool) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def values_text(m: dict[str, Any]) -> str:
    """A report's plain values (not its epoch), as ``loss 0.1235  acc 0.91``."""
    return "  ".join(f"{k} {_value(v)}" for k, v in keys.scalars(m).items())


def report_line(m: dict[str, Any], index: int) -> str:
    """A line for any report: ``epoch 3/10`` (or ``report 3``) and the report's plain values."""
    if keys.EPOCH in m:
        head = f"epoch {m[keys.EPOCH]}" + (f"/{m[keys.EPOCHS]}" if keys.EPOCHS in m else "")
    else:
        head = f"report {index}"
    values = values_text(m)
    return f"{head}  {values}" if values else head


def summary(error: BaseException) -> str:
    """The last meaningful line of an error, for a one-line message."""
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    tail = [ln.strip() for ln in lines if not ln.startswith((" ", "Traceback"))]
    return tail[-1] if tail else type(error).__name__


def brief(error: BaseException, limit: int = 160) -> str:
    """The first sentence of an error's summary, for a line among others."""
    text = summary(error)
    sentence = text.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= limit else sentence[: limit - 3] + "..."


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def out_of_space(error: BaseException) -> bool:
    """Whether an error (or one it was raised from) is a full disk or an exceeded quota: no retry fixes
    that, so the run stops rather than restart its workers into the same wall."""
    seen: BaseException | None = error
    for _ in range(8):  # the cause chain, bounded (Ray Train's ControllerError keeps the controller's own)
        if seen is None:
            return False
        if isinstance(seen, OSError) and (seen.errno in _NO_SPACE or "No space left on device" in str(seen)):
            return True
        seen = getattr(seen, "controller_failure", None) or seen.__cause__ or seen.__context__
    return False


def no_space(error: BaseException) -> str:
    """What to say of a full disk or quota (``out_of_space``), whichever process of the run met it."""
    return (
        f"a disk is full or over quota ({brief(error)}): free space on the run's storage (or the node's temp "
        "dir), then rerun the same command; it resumes from the newest intact checkpoint"
    )


def _died(error: BaseException) -> bool:
    """Whether an error says a worker process or its node died (an OOM kill, a crash, a lost node)."""
    from ray.exceptions import ActorDiedError, NodeDiedError, RayActorError

    return isinstance(error, (RayActorError, ActorDiedError, NodeDiedError))


def peer_lost(error: BaseException) -> bool:
    """Whether an error is a collective that failed because another rank went away: a consequence of that
    rank's failure, never its cause. Gloo raises a plain ``RuntimeError`` naming its source file
    (``.../gloo/transport/tcp/pair.cc: Read error ...: Connection reset by peer``); NCCL and the c10d
    store raise ``torch.distributed.DistError``."""
    dist = sys.modules.get("torch.distributed")  # an error from torch means torch is loaded
    if dist is not None and isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and ("/gloo/" in str(error) or "NCCL" in str(error))


def cause(errors: dict[int, BaseException]) -> tuple[int, BaseException]:
    """The rank and error that explain a failed worker group: a dead worker before the collectives its
    peers then failed in, and any other error before those."""
    return min(errors.items(), key=lambda item: (not _died(item[1]), peer_lost(item[1]), item[0]))


def lost_workers(error: BaseException) -> bool:
    """Whether a run failed because its workers or their nodes died (the cluster failed under it: worth
    requeueing) rather than because the training itself raised an error. The ranks that lived on fail in
    their next collective: that is the same loss, not an error of the training."""
    from ray.train import WorkerGroupError

    if not isinstance(error, WorkerGroupError) or not error.worker_failures:
        return False
    failures = list(error.worker_failures.values())
    return any(_died(e) for e in failures) and all(_died(e) or peer_lost(e) for e in failures)


def epoch_progress(history: list[dict[str, Any]]) -> dict[str, Any]:
    """epochs_completed / epochs / epochs_this_attempt from reports that carry an epoch (else nulls)."""
    with_epoch = [m for m in history if isinstance(m.get(keys.EPOCH), int)]
    if not with_epoch:
        return {"epochs_completed": None, "epochs": None, "epochs_this_attempt": 0}
    last = with_epoch[-1]
    return {
        "epochs_completed": last[keys.EPOCH],
        "epochs": last.get(keys.EPOCHS),
        "epochs_this_attempt": len(with_epoch),
    }


def versions(raytrain_version: str) -> dict[str, str]:
    import ray
    import torch

    return {"raytrain": raytrain_version, "ray": ray.__version__, "torch": torch.__version__}
