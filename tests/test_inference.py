"""`raytrain evaluate`, `predict` and `export` on a run made by hand (a real resnet18 checkpoint), and
their bad input: one line, exit 2, the checkpoint untouched. tests/test_recipe.py runs them on a trained
run."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torchvision

from raytrain.recipe import checkpoint_files
from raytrain.recipe.config import DataConfig, FitConfig
from tests.conftest import assert_user_error, image_table, png, run_cli, write_parquet

CLASSES = ("cat", "dog", "eel")


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run directory with one checkpoint of a 3-class resnet18 at 16 px, as the recipe writes one."""
    data = write_parquet(tmp_path / "data.parquet", image_table(12, size=16))
    cfg = FitConfig(data=DataConfig(uri=str(data), image_size=16, num_classes=3, classes=CLASSES, augment="none"))
    ckpt = tmp_path / "runs/r" / checkpoint_files.name(1)
    ckpt.mkdir(parents=True)
    state = {"model": torchvision.models.resnet18(num_classes=3).state_dict(), "config": cfg.to_dict(), "epoch": 1}
    checkpoint_files.write(ckpt, state, {"epoch": 1, checkpoint_files.SCORE: 0.5, "classes": list(CLASSES)})
    (tmp_path / "cat.png").write_bytes(png(np.full((20, 24, 3), 200, dtype=np.uint8)))
    (tmp_path / "notes.png").write_text("not an image")
    return tmp_path / "runs/r"


def digest(run: Path) -> str:
    return hashlib.sha256((run / checkpoint_files.name(1) / checkpoint_files.STATE).read_bytes()).hexdigest()


def test_predict_names_the_run_s_classes_and_export_keeps_them(run: Path, tmp_path: Path) -> None:
    out = run_cli("predict", str(run), str(tmp_path / "cat.png"), "--top-k", "3", "--checkpoint", "last")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"{tmp_path / 'cat.png'}: ")
    shown = [part.split() for part in line.split(": ", 1)[1].split(", ")]
    assert sorted(name for name, _ in shown) == sorted(CLASSES)
    assert sum(float(p) for _, p in shown) == pytest.approx(1.0, abs=0.01)

    out = run_cli("export", "--storage", str(run.parent), "r", "--format", "safetensors", "--out", str(tmp_path / "x"))
    assert out.returncode == 0, out.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "x/model.safetensors"), "pt") as f:
        assert '"classes": [\n  "cat",' in f.metadata()["raytrain"] and "fc.weight" in f.keys()  # noqa: SIM118


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (("predict", "{run}", "{tmp}/nope.png"), "nope.png does not exist: give image files to predict"),
        (("predict", "{run}", "{tmp}/notes.png"), "notes.png is not an image Pillow can read"),
        (("predict", "{run}", "{tmp}/cat.png", "--top-k", "0"), "--top-k 0 is below 1"),
        (("evaluate", "{tmp}/runs/missing"), "is not a run directory: give the run's path"),
        (("evaluate", "{run}", "--data", "{tmp}/other.parquet"), "has classes the model was not trained on: fox"),
        (("export", "{run}", "--format", "onnx"), "'onnx' is not one of 'torchscript', 'safetensors'"),
        (("evaluate", "{tmp}/runs"), "has no checkpoint: train it first"),
    ],
)
def test_bad_input(run: Path, tmp_path: Path, command: tuple[str, ...], message: str) -> None:
    table = image_table(4, size=16)
    write_parquet(tmp_path / "other.parquet", table.set_column(1, "label", pa.array(["cat", "dog", "fox", "cat"])))
    before = digest(run)
    args = [c.format(run=run, tmp=tmp_path) for c in command]
    assert_user_error(run_cli(*args), message)
    assert digest(run) == before
