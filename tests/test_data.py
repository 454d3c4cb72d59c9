"""Parquet checks, the hash split and the embedded dataset, on real files."""

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

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
    train = pipeline.hash_split(table, keep=pipeline.TRAIN, val_fraction=0.2)
    val = pipeline.hash_split(table, keep=pipeline.VAL, val_fraction=0.2)
    assert len(train) + len(val) == 500
    assert set(train.column("image").to_pylist()).isdisjoint(val.column("image").to_pylist())
    assert 0.12 < len(val) / 500 < 0.28
    assert pipeline.hash_split(table.slice(250), keep=pipeline.VAL, val_fraction=0.2).num_rows == len(
        [b for b in table.slice(250).column("image").to_pylist() if b in set(val.column("image").to_pylist())]
    )


def test_decode_gives_fixed_size_rgb() -> None:
    out = pipeline.decode(image_table(4, size=8), size=12)
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
    assert "images at 32px (their own size)" in out.stdout and '"image_size": 32,' in out.stdout
    asked = run_cli("fit", "--dry-run", "--data", str(path), "--image-size", "16", "--storage", str(tmp_path / "runs"))
    assert "images at 16px;" in asked.stdout


def test_decode_marks_unreadable_images_and_null_labels() -> None:
    good = image_table(4, size=8)
    blobs = good.column("image").to_pylist()
    blobs[1] = b"\x89PNG\r\n\x1a\n not really a png"
    blobs[2] = None
    table = pa.table(
        {"image": pa.array(blobs, pa.binary()), "label": pa.array([0, 1, 2, None], pa.int64())},
    )
    out = pipeline.decode(table, size=8)
    assert out["valid"].tolist() == [True, False, False, False]
    assert out["label"].tolist() == [0, 1, 2, 0] and out["image"].shape == (4, 8, 8, 3)
    assert not out["image"][1].any() and not out["image"][2].any()
    assert pipeline.hash_split(table, keep=pipeline.TRAIN, val_fraction=0.5).num_rows <= 4  # None hashes too


def _with_labels(n: int, labels: list[int | None]) -> pa.Table:
    return image_table(n).set_column(1, "label", pa.array(labels, pa.int64()))


@pytest.mark.parametrize(
    ("layout", "args", "fragments"),
    [
        ("empty-val", [], ["has no rows in its val split", "remove it"]),
        ("sparse", [], ["3 distinct labels between 0 and 50000", "renumber the labels 0..2"]),
        ("no-labels", [], ["every 'label' is null"]),
        ("one-class", [], ["only one class"]),
        ("tiny", ["--workers", "2"], ["about 1 training rows, fewer than the 2 workers", "--workers 1"]),
    ],
)
def test_data_that_cannot_train_is_refused_before_any_worker(
    tmp_path: Path, layout: str, args: list[str], fragments: list[str]
) -> None:
    from tests.conftest import assert_user_error, run_cli

    data = tmp_path / "d"
    if layout == "empty-val":
        write_parquet(data / "train/a.parquet", image_table(6))
        write_parquet(data / "val/a.parquet", image_table(0))
    elif layout == "sparse":
        write_parquet(data / "a.parquet", _with_labels(6, [0, 7, 50000, 0, 7, 50000]))
    elif layout == "no-labels":
        write_parquet(data / "a.parquet", _with_labels(3, [None, None, None]))
    elif layout == "one-class":
        write_parquet(data / "a.parquet", _with_labels(4, [0, 0, None, 0]))
    else:
        write_parquet(data / "a.parquet", image_table(2, classes=2))
    out = run_cli("fit", "--dry-run", "--data", str(data), "--storage", str(tmp_path / "runs"), *args)
    assert_user_error(out, *fragments)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_null_labels_are_counted_and_named(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", _with_labels(6, [0, 1, None, 2, 0, None]))
    src = source.inspect(str(path))
    assert src.unlabelled == 2 and src.num_classes == 3


def test_mostly_unusable_data_stops_the_run_without_a_checkpoint() -> None:
    from raytrain.errors import Fatal
    from raytrain.recipe.train_loop import _check_data

    _check_data({"epoch": 1, "unusable_samples": 4, "train_samples": 90, "val_samples": 10})
    with pytest.raises(Fatal, match=r"^6 of 106 samples in epoch 1 have an image that does not decode"):
        _check_data({"epoch": 1, "unusable_samples": 6, "train_samples": 90, "val_samples": 10})


def test_the_embedded_data_is_kept_where_only_its_maker_writes_whatever_the_umask(tmp_path: Path) -> None:
    import os

    old = os.umask(0o002)
    try:
        first = digits.ensure(pafs.LocalFileSystem(), str(tmp_path))
        again = digits.ensure(pafs.LocalFileSystem(), str(tmp_path))
    finally:
        os.umask(old)
    assert first == again == str(tmp_path / ".datasets" / f"{digits.VERSION}.parquet")
    assert (tmp_path / ".datasets").stat().st_mode & 0o777 == 0o755
    if os.geteuid() == 0:  # a .datasets of another user's (root can make one): never read from
        other = tmp_path / "shared"
        (other / ".datasets").mkdir(parents=True)
        os.chown(other / ".datasets", 4242, 4242)
        assert digits.ensure(pafs.LocalFileSystem(), str(other)) == str(
            other / f".datasets-{os.getuid()}" / f"{digits.VERSION}.parquet"
        )
