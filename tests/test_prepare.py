"""`raytrain prepare` on real image folders and a real torchvision dataset read from disk."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from raytrain.recipe.data import source
from tests.conftest import assert_user_error, run_cli


def make_folder(root: Path, per_class: int = 6) -> None:
    rng = np.random.default_rng(0)
    for cls, fmt in (("cat", "PNG"), ("dog", "JPEG")):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (10, 14, 3), dtype=np.uint8)).save(
                root / cls / f"{i}.{fmt.lower()}", fmt
            )
    (root / "dog" / "broken.jpeg").write_bytes(b"not an image")
    (root / "dog" / "notes.txt").write_text("ignored")


def test_image_folder_to_parquet(tmp_path: Path) -> None:
    make_folder(tmp_path / "imgs")
    result = run_cli("prepare", str(tmp_path / "imgs"), str(tmp_path / "out"), "--val-fraction", "0.3")
    assert result.returncode == 0, result.stderr
    assert "skipped 1 unreadable image(s)" in result.stdout
    src = source.inspect(str(tmp_path / "out"))
    assert src.classes == ("cat", "dog") and src.train_rows + src.val_rows == 12 and src.val_rows > 0
    table = pq.read_table(src.train_files[0])
    first = table.column("image")[0].as_py()
    assert first.startswith(b"\x89PNG") or first.startswith(b"\xff\xd8")  # original bytes kept


def test_resize_stores_jpeg_of_that_size(tmp_path: Path) -> None:
    make_folder(tmp_path / "imgs")
    result = run_cli(
        "prepare", str(tmp_path / "imgs"), str(tmp_path / "out"), "--image-size", "16", "--val-fraction", "0"
    )
    assert result.returncode == 0, result.stderr
    src = source.inspect(str(tmp_path / "out"))
    assert src.image_size == 16 and src.val_files == ()
    blob = pq.read_table(src.train_files[0]).column("image")[0].as_py()
    import io

    assert Image.open(io.BytesIO(blob)).size == (16, 16)


def write_mnist(raw: Path, n_train: int, n_test: int) -> None:
    """MNIST's own idx file format, as torchvision.datasets.MNIST expects it under <root>/MNIST/raw."""
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())
        with gzip.open(raw / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(struct.pack(">II", 2049, n) + labels.tobytes())


def test_torchvision_dataset_on_disk(tmp_path: Path) -> None:
    write_mnist(tmp_path / "data/MNIST/raw", 30, 10)
    result = run_cli("prepare", "torchvision:MNIST", str(tmp_path / "mnist"), "--root", str(tmp_path / "data"))
    assert result.returncode == 0, result.stderr
    src = source.inspect(str(tmp_path / "mnist"))
    assert (src.train_rows, src.val_rows, src.num_classes) == (30, 10, 10)
    assert src.classes is not None and src.classes[3].startswith("3")


def test_errors(tmp_path: Path) -> None:
    assert_user_error(
        run_cli("prepare", "torchvision:MNIST", str(tmp_path / "o"), "--root", str(tmp_path)),
        "torchvision MNIST is not under --root",
        "--download",
    )
    assert_user_error(run_cli("prepare", "torchvision:NoSuch", str(tmp_path / "o")), "no dataset 'NoSuch'")
    assert_user_error(run_cli("prepare", str(tmp_path / "missing"), str(tmp_path / "o")), "is not a directory")
    (tmp_path / "exists").mkdir()
    make_folder(tmp_path / "imgs")
    assert_user_error(run_cli("prepare", str(tmp_path / "imgs"), str(tmp_path / "exists")), "already exists")
