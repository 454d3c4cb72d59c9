"""What the recipe's training loop reports each epoch, and how the driver shows it."""

from __future__ import annotations

from typing import Any, TypedDict

from raytrain.contracts.jobdir import CANCEL, YIELD

# The keys result.json keeps in "final" and in each "history" entry.
RESULT_KEYS = (
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "ema_val_acc",
    "samples_per_s",
    "epoch_time_s",
    "data_wait_s",
    "train_time_s",
    "train_samples",
    "unusable_samples",
    "dropped_samples",
    "checkpoint_blocked_s",
)
HISTORY_KEYS = ("epoch", "batches_done", *RESULT_KEYS)


class EpochMetrics(TypedDict, total=False):
    """One epoch (or, with ``preempted``, the part of one trained before the job ended), over all ranks."""

    epoch: int  # epochs completed; the epoch in progress when preempted
    epochs: int
    batches_done: int  # batches of the epoch in progress already trained (a mid-epoch checkpoint)
    train_loss: float
    train_acc: float
    train_samples: int
    val_loss: float | None
    val_acc: float | None
    ema_val_acc: float | None  # --ema-decay: the averaged weights' validation accuracy
    val_samples: int
    unusable_samples: int  # left out, train and val: the image does not decode or the label is null
    dropped_samples: int  # left out of training: a batch of one sample (BatchNorm needs two)
    samples_per_s: float
    train_time_s: float
    epoch_time_s: float
    data_wait_s: float
    lr: float
    global_step: int
    world_size: int
    checkpoint_blocked_s: float | None  # how long the previous epoch's checkpoint held training up
    preempted: str  # why training stopped here: raytrain.ending_reason()
    startup: Any  # raytrain.contracts.metrics.Startup, first report only
    resumed: Any  # what the attempt resumed from, first report only


def epoch_line(m: EpochMetrics) -> str:
    width = len(str(m["epochs"]))
    if "preempted" in m:
        whys: dict[str, str] = {
            YIELD: "it yields its room to a run of higher priority",
            CANCEL: "cancelled (raytrain cancel)",
        }
        why = whys.get(m["preempted"], f"the job is ending ({m['preempted']})")
        return (
            f"epoch {m['epoch']:>{width}}/{m['epochs']}  stopped after {m['batches_done']} batches: {why}; "
            "checkpoint saved, it resumes from there"
        )
    val_loss, val_acc = m.get("val_loss"), m.get("val_acc")
    val = (
        f"val_loss {val_loss:.4f}  val_acc {100 * val_acc:5.1f}%"
        if val_loss is not None and val_acc is not None
        else "no validation samples"
    )
    ema_acc = m.get("ema_val_acc")
    if ema_acc is not None:
        val += f"  ema_val_acc {100 * ema_acc:5.1f}%"
    skipped = [
        f"{n} {what}"
        for n, what in (
            (m.get("unusable_samples", 0), "unusable (undecodable image or no label)"),
            (m.get("dropped_samples", 0), "in a one-sample batch"),
        )
        if n
    ]
    return (
        f"epoch {m['epoch']:>{width}}/{m['epochs']}  loss {m['train_loss']:.4f}  acc {100 * m['train_acc']:5.1f}%  "
        f"{val}  {m['samples_per_s']:,.0f} samples/s  {m['epoch_time_s']:.1f} s"
        + (f"  (skipped: {', '.join(skipped)})" if skipped else "")
    )
