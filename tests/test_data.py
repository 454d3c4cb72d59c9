"""Parquet checks, the hash split and the embedded dataset, on real files."""

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain.recipe.data import digits, pipeline, source
from tests.conftest import image_table, write_parquet


def test_split_layout_and_metadata(tmp_path: Path) -> None:
    meta = source.parquet_metadata(["cat", "dog", "eel"], 16)
    write_parquet(tmp_path / "d/train/part-0.parquet", image_table(12).replace_schema_metadata(meta))
    write_parquet(tmp_path / "d/val/part-0.parquet", image_table(6, seed=1).replace_schema_metadata(meta))
    src = source.inspect(str(tmp_path / "d"))
    assert (src.train_rows, src.val_rows) == (12, 6)
    assert src.classes == ("cat", "dog", "eel") and src.num_classes == 3 and src.image_size == 16


def test_classes_from_labels_without_metadata(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", image_table(10, classes=5))
    src = source.inspect(str(tmp_path / "a.parquet"))
    assert src.num_classes == 5 and src.classes is None and src.val_files == ()


def test_hash_split_partitions_rows_stably() -> None:
    table = image_table(500)
    train = pipeline._hash_split(table, keep=pipeline.TRAIN, val_fraction=0.2)
    val = pipeline._hash_split(table, keep=pipeline.VAL, val_fraction=0.2)
    assert len(train) + len(val) == 500
    assert set(train.column("image").to_pylist()).isdisjoint(val.column("image").to_pylist())
    assert 0.12 < len(val) / 500 < 0.28
    assert pipeline._hash_split(table.slice(250), keep=pipeline.VAL, val_fraction=0.2).num_rows == len(
        [b for b in table.slice(250).column("image").to_pylist() if b in set(val.column("image").to_pylist())]
    )


def test_decode_gives_fixed_size_rgb() -> None:
    out = pipeline._decode(image_table(4, size=8), size=12)
    assert out["image"].shape == (4, 12, 12, 3) and out["image"].dtype.name == "uint8"
    assert out["label"].tolist() == [0, 1, 2, 0]


def test_embedded_digits_written_once_as_parquet(tmp_path: Path) -> None:
    fs = pafs.LocalFileSystem()
    path = digits.ensure(fs, str(tmp_path))
    mtime = Path(path).stat().st_mtime_ns
    assert digits.ensure(fs, str(tmp_path)) == path and Path(path).stat().st_mtime_ns == mtime
    src = source.inspect(path)
    assert src.train_rows == 1797 and src.num_classes == 10 and src.image_size == 32
    labels = pa.parquet.read_table(path, columns=["label"]).column("label").to_pylist()
    assert sorted(set(labels)) == list(range(10))


def test_without_metadata_images_keep_their_own_size(tmp_path: Path) -> None:
    """A Parquet written by other tools (no raytrain metadata) trains at its images' size, not 224."""
    from tests.conftest import run_cli

    path = write_parquet(tmp_path / "a.parquet", image_table(10, size=32))
    src = source.inspect(str(path))
    assert src.image_size == 32 and src.image_size_measured
    out = run_cli("fit", "--dry-run", "--data", str(path), "--storage", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr
    assert "images resized to 32px (their own size)" in out.stdout and '"image_size": 32,' in out.stdout
    asked = run_cli("fit", "--dry-run", "--data", str(path), "--image-size", "16", "--storage", str(tmp_path / "runs"))
    assert "images resized to 16px\n" in asked.stdout
