"""A trained model out of a run, and what to do with it: ``raytrain evaluate``, ``predict`` and ``export``.

A run is given as its directory (``runs/digits-resnet18``, any pyarrow URI) or a checkpoint directory in
it; the checkpoint used is the run's best by validation accuracy (``<run>/best``), else its newest, and
is verified before use. Images are prepared as validation prepares them (shorter side resized, centre
crop, ImageNet normalisation), in this one process, on the GPU when there is one.
"""

from __future__ import annotations

import io
import json
import posixpath
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from torch import nn

from raytrain import uri
from raytrain.errors import UserError
from raytrain.recipe import checkpoint_files, models
from raytrain.recipe.config import EMBEDDED_DATA, FitConfig
from raytrain.recipe.data import images, pipeline, source
from raytrain.recipe.train_loop import MEAN, STD, Normalize

CHECKPOINTS = ("best", "last")


@dataclass(frozen=True)
class Trained:
    """A trained model in eval mode, with the config it was trained with."""

    model: nn.Module
    cfg: FitConfig
    checkpoint: str
    device: torch.device

    @property
    def run_dir(self) -> str:
        """The run the checkpoint belongs to (a best checkpoint sits one level deeper, in ``best/``)."""
        parent = posixpath.dirname(self.checkpoint)
        return posixpath.dirname(parent) if posixpath.basename(parent) == checkpoint_files.BEST else parent

    @property
    def classes(self) -> list[str]:
        k = self.cfg.data.num_classes or 0
        return list(self.cfg.data.classes) if self.cfg.data.classes else [str(i) for i in range(k)]

    @property
    def image_size(self) -> int:
        assert self.cfg.data.image_size is not None
        return self.cfg.data.image_size

    def card(self) -> dict[str, Any]:
        """What a user of the weights needs besides them: the classes, the input and its normalisation."""
        return {
            "model": self.cfg.model.name,
            "classes": self.classes,
            "image_size": self.image_size,
            "input": "RGB, shorter side resized to image_size then centre-cropped; float NCHW in [0, 1], "
            "minus mean, over std (per channel)",
            "mean": MEAN,
            "std": STD,
            "checkpoint": self.checkpoint,
        }

    @torch.no_grad()
    def logits(self, batch: np.ndarray) -> torch.Tensor:
        """Logits of uint8[N, S, S, 3] images."""
        x = Normalize(self.device)(torch.from_numpy(batch).to(self.device))
        return models.logits(self.model(x)).float()


def _checkpoint(fs: pafs.FileSystem, path: str, which: str, shown: str) -> checkpoint_files.Found:
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise UserError(f"{shown} is not a run directory: give the run's path (e.g. runs/digits-resnet18)")
    found = checkpoint_files.named_by(fs, path, best_first=which == "best")
    if found is None:
        raise UserError(f"{shown} has no checkpoint: train it first (raytrain fit), or give another run")
    return found


def load(run: str, which: str = "best", device: torch.device | None = None) -> Trained:
    """The model of a run's best (or last) checkpoint, or of the checkpoint directory ``run``."""
    fs, path = uri.resolve(run)
    found = _checkpoint(fs, path, which, run)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        state = checkpoint_files.load(fs, found, torch.device("cpu"))
    except (ValueError, RuntimeError, OSError, EOFError) as exc:
        raise UserError(f"checkpoint {found.path} is damaged ({uri.first_line(exc)}): give another one") from None
    cfg = FitConfig.from_dict(state["config"])
    assert cfg.data.num_classes is not None
    net = models.build(cfg.model.name, cfg.data.num_classes)
    try:
        weights = checkpoint_files.model_weights(fs, found, state)
    except (ValueError, RuntimeError, OSError) as exc:
        raise UserError(f"checkpoint {found.path} is damaged ({uri.first_line(exc)}): give another one") from None
    net.load_state_dict(weights)
    return Trained(model=net.to(device).eval(), cfg=cfg, checkpoint=found.path, device=device)


def predict(trained: Trained, paths: Sequence[str], top_k: int) -> list[list[tuple[str, float]]]:
    """The ``top_k`` classes of each image file, with their probabilities."""
    if top_k < 1:
        raise UserError(f"--top-k {top_k} is below 1")
    batch = np.stack([_read_image(p, trained.image_size) for p in paths])
    probs = torch.softmax(trained.logits(batch), dim=1)
    top = probs.topk(min(top_k, probs.shape[1]), dim=1)
    names = trained.classes
    return [
        [(names[i], float(p)) for p, i in zip(ps.tolist(), ix.tolist(), strict=True)]
        for ps, ix in zip(top.values, top.indices, strict=True)
    ]


def _read_image(path: str, size: int) -> np.ndarray:
    fs, local = uri.resolve(path)
    try:
        with fs.open_input_stream(local) as f:
            return images.decode(f.read(), size)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: give image files to predict") from None
    except images.UNREADABLE as exc:
        raise UserError(f"{path} is not an image Pillow can read ({uri.first_line(exc)})") from None


@dataclass(frozen=True)
class Evaluation:
    classes: list[str]
    confusion: np.ndarray  # [true class, predicted class] counts
    data: str
    split: str
    checkpoint: str

    @property
    def count(self) -> int:
        return int(self.confusion.sum())

    @property
    def accuracy(self) -> float:
        return float(np.trace(self.confusion) / max(self.count, 1))

    def per_class(self) -> list[float | None]:
        rows = self.confusion.sum(axis=1)
        return [float(self.confusion[i, i] / n) if n else None for i, n in enumerate(rows)]

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "data": self.data,
            "split": self.split,
            "samples": self.count,
            "accuracy": self.accuracy,
            "per_class_accuracy": dict(zip(self.classes, self.per_class(), strict=True)),
            "confusion": self.confusion.tolist(),
            "classes": self.classes,
        }


def _relabel(src: source.DataSource, trained: Trained) -> np.ndarray | None:
    """For data that names its classes: the model's class id of each of the data's ids (None: same ids)."""
    model_classes = trained.cfg.data.classes
    if src.classes is None:
        if src.columns.string_labels or src.num_classes > len(trained.classes):
            raise UserError(f"--data {src.uri} has {src.num_classes} classes; the model knows {len(trained.classes)}")
        return None
    if model_classes is None:
        raise UserError(
            f"--data {src.uri} names its classes but the model was trained on bare class ids: evaluate on data "
            "labelled as it was trained"
        )
    unknown = sorted(set(src.classes) - set(model_classes))
    if unknown:
        raise UserError(f"--data {src.uri} has classes the model was not trained on: {', '.join(unknown[:5])}")
    index = {name: i for i, name in enumerate(model_classes)}
    return np.array([index[name] for name in src.classes], dtype=np.int64)


def _tables(trained: Trained, data: str | None) -> tuple[Iterator[pa.Table], str]:
    """The evaluation rows as Arrow tables (``image`` bytes, int64 ``label`` in the model's class ids),
    and which split they are."""
    cfg = trained.cfg.data
    held_out = f"the ~{cfg.val_fraction:.0%} held out by hash"
    if (data or cfg.uri) == EMBEDDED_DATA:
        from raytrain.recipe.data import digits

        table = pipeline.hash_split(digits.table(), keep=pipeline.VAL, val_fraction=cfg.val_fraction)
        return iter([table]), held_out
    src = source.inspect(data or cfg.uri, image_column=cfg.image_column, label_column=cfg.label_column)
    relabel = _relabel(src, trained)
    files = src.val_files or src.train_files
    by_hash = not src.val_files and data is None  # the run's own unsplit data: its held-out share
    split = f"its {src.val_split} split" if src.val_files else held_out if by_hash else "all of it"

    def tables() -> Iterator[pa.Table]:
        columns = [src.columns.image, src.columns.label]
        for path in files:
            with src.filesystem.open_input_file(path) as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=256, columns=columns):
                    table = source.canonical(pa.Table.from_batches([batch]), columns=src.columns, classes=src.classes)
                    if relabel is not None:
                        ids = table.column(source.LABEL)
                        mapped = pa.array(
                            relabel[pc.fill_null(ids, 0).to_numpy()],
                            mask=pc.is_null(ids).to_numpy(zero_copy_only=False),
                        )
                        table = table.set_column(1, source.LABEL, mapped)
                    yield (
                        pipeline.hash_split(table, keep=pipeline.VAL, val_fraction=cfg.val_fraction)
                        if by_hash
                        else table
                    )

    return tables(), split


def evaluate(trained: Trained, data: str | None = None) -> Evaluation:
    """Accuracy, per class, and the confusion matrix of the model on a dataset's validation split (the
    run's own data by default; data given here is evaluated whole unless it has a validation split)."""
    k = len(trained.classes)
    confusion = np.zeros((k, k), dtype=np.int64)
    batches, split = _tables(trained, data)
    for table in batches:
        decoded = pipeline.decode(table, size=trained.image_size)
        keep = decoded[pipeline.VALID]
        if not keep.any():
            continue
        predicted = trained.logits(decoded[source.IMAGE][keep]).argmax(1).cpu().numpy()
        np.add.at(confusion, (decoded[source.LABEL][keep], predicted), 1)
    if confusion.sum() == 0:
        raise UserError(f"--data {data or trained.cfg.data.uri} has no labelled image that decodes to evaluate on")
    return Evaluation(
        classes=trained.classes,
        confusion=confusion,
        data=data or trained.cfg.data.uri,
        split=split,
        checkpoint=trained.checkpoint,
    )


def report(ev: Evaluation) -> list[str]:
    """The evaluation as text: accuracy, per-class accuracy, and the confusion matrix."""
    width = max(5, *(len(c) for c in ev.classes))
    lines = [
        f"checkpoint: {ev.checkpoint}",
        f"data: {ev.data} ({ev.split}): {ev.count} images",
        f"accuracy: {100 * ev.accuracy:.2f}%",
        "",
        f"{'class':<{width}}  {'images':>6}  accuracy",
    ]
    for name, n, acc in zip(ev.classes, ev.confusion.sum(axis=1), ev.per_class(), strict=True):
        lines.append(f"{name:<{width}}  {n:>6}  " + (f"{100 * acc:6.2f}%" if acc is not None else "     -"))
    cell = max(4, len(str(ev.confusion.max())) + 1)
    lines += ["", "confusion (rows: true class, columns: predicted, in the order above):"]
    lines += [
        f"{name:<{width}} " + "".join(f"{v:>{cell}}" for v in row)
        for name, row in zip(ev.classes, ev.confusion, strict=True)
    ]
    return lines


def confusion_png(ev: Evaluation, path: str) -> None:
    """The confusion matrix as a PNG heat map, rows normalised per true class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(ev.classes)
    rates = ev.confusion / np.maximum(ev.confusion.sum(axis=1, keepdims=True), 1)
    side = min(20.0, 3.0 + 0.45 * k)
    fig, ax = plt.subplots(figsize=(side, side))
    ax.imshow(rates, cmap="Blues", vmin=0.0, vmax=1.0)
    ticks = list(range(k))
    ax.set_xticks(ticks, ev.classes, rotation=90 if k > 10 else 0)
    ax.set_yticks(ticks, ev.classes)
    if k <= 30:
        for i in range(k):
            for j in range(k):
                if ev.confusion[i, j]:
                    color = "white" if rates[i, j] > 0.5 else "black"
                    ax.text(j, i, str(ev.confusion[i, j]), ha="center", va="center", color=color, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"accuracy {100 * ev.accuracy:.2f}% on {ev.count} images")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write(path, buf.getvalue())


def write(path: str, blob: bytes) -> None:
    fs, local = uri.resolve(path)
    fs.create_dir(posixpath.dirname(local), recursive=True)
    with fs.open_output_stream(local) as f:
        f.write(blob)


FORMATS = ("torchscript", "safetensors")


def export(trained: Trained, fmt: str, out: str) -> list[str]:
    """Write the model in ``fmt`` under ``out``, with ``model.json`` (classes, image size, normalisation)
    beside it; returns the files written."""
    card = json.dumps(trained.card(), indent=1)
    model = trained.model.to("cpu").eval()
    buf = io.BytesIO()
    if fmt == "torchscript":
        example = torch.zeros(1, 3, trained.image_size, trained.image_size)
        # TorchScript is deprecated in favour of torch.export, but it is what C++ and older serving stacks load.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
            scripted = torch.jit.trace(_Logits(model), example)
            torch.jit.save(scripted, buf, _extra_files={"model.json": card})
        name = "model.torchscript.pt"
    elif fmt == "safetensors":
        from safetensors.torch import save

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        buf.write(save(state, metadata={"raytrain": card}))
        name = "model.safetensors"
    else:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    written = [posixpath.join(out, name), posixpath.join(out, "model.json")]
    write(written[0], buf.getvalue())
    write(written[1], card.encode())
    return written


class _Logits(nn.Module):
    """The model with its logits unwrapped (for models whose forward returns a tuple or a dict)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return models.logits(self.model(x))
