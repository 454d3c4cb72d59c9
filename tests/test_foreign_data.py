"""Parquet as other tools write it: Hugging Face's layout and image struct, string labels, other column
names; and what the pipeline makes of it (class ids, the images' own size, training augmentation)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.recipe.data import augment, layout, pipeline, source
from tests.conftest import image_table, run_cli, write_parquet

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def hf_table(table: pa.Table, names: list[str] | None = None, *, strings: bool = False) -> pa.Table:
    """``table`` as Hugging Face ``datasets`` writes it: the image a {bytes, path} struct, and the label a
    ClassLabel (int64 with its names in the schema metadata) or, with ``strings``, the class names."""
    blobs = table.column("image").to_pylist()
    image = pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(blobs)], HF_IMAGE)
    ids = table.column("label").to_pylist()
    names = names or [f"class_{i}" for i in range(max(ids) + 1)]
    label = pa.array([names[i] for i in ids]) if strings else pa.array(ids, pa.int64())
    features = {
        "image": {"_type": "Image"},
        "label": {"_type": "Value", "dtype": "string"} if strings else {"_type": "ClassLabel", "names": names},
    }
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    return pa.table({"image": image, "label": label}).replace_schema_metadata(meta)


@pytest.mark.parametrize(
    ("relpath", "split", "named_by"),
    [
        ("train-00000-of-00002.parquet", "train", "file names"),
        ("data/validation-00000-of-00001.parquet", "val", "file names"),
        ("plain_text/test/0000.parquet", "test", "directories"),
        ("train/part-00000.parquet", "train", "directories"),
        ("val/part-00000.parquet", "val", "directories"),
        ("trainer-notes.parquet", None, None),
        ("shard-0.parquet", None, None),
    ],
)
def test_the_split_a_path_names(relpath: str, split: str | None, named_by: str | None) -> None:
    assert layout.split_of(relpath) == (split, named_by)


def test_hugging_face_layout_struct_images_and_class_label_names(tmp_path: Path) -> None:
    names = ["airplane", "bird", "cat"]
    write_parquet(tmp_path / "hf/data/train-00000-of-00002.parquet", hf_table(image_table(9, size=32), names))
    write_parquet(tmp_path / "hf/data/train-00001-of-00002.parquet", hf_table(image_table(6, size=32, seed=1), names))
    write_parquet(tmp_path / "hf/data/test-00000-of-00001.parquet", hf_table(image_table(5, size=32, seed=2), names))
    src = source.inspect(str(tmp_path / "hf"))
    assert (src.train_rows, src.val_rows, src.val_split) == (15, 5, "test")
    assert src.classes == tuple(names) and src.classes_from == "Hugging Face's ClassLabel"
    assert src.columns.image_field == "bytes" and src.image_size == 32 and src.image_size_measured
    batch = source.canonical(pq.read_table(src.train_files[0]), columns=src.columns, classes=src.classes)
    assert batch.schema == pa.schema([("image", pa.binary()), ("label", pa.int64())])
    assert batch.column("label").to_pylist() == [0, 1, 2] * 3
    decoded = pipeline.decode(batch, size=32)
    assert decoded["valid"].all() and decoded["image"].shape == (9, 32, 32, 3)

    out = run_cli("fit", "--dry-run", "--data", str(tmp_path / "hf"), "--storage", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr
    assert "15 rows (5 in its test split), 3 classes (Hugging Face's ClassLabel: airplane, bird, cat)" in out.stdout
    assert '"classes": [\n' in out.stdout and "images at 32px (their own size)" in out.stdout


def test_string_labels_become_sorted_class_ids_and_unknown_ones_no_label(tmp_path: Path) -> None:
    table = hf_table(image_table(8, classes=2), ["dog", "cat"], strings=True)
    write_parquet(tmp_path / "s/train-0.parquet", table)
    val = table.slice(0, 3).set_column(1, "label", pa.array(["cat", "", "eel"]))
    write_parquet(tmp_path / "s/validation-0.parquet", val)
    src = source.inspect(str(tmp_path / "s"))
    # "eel" appears only in validation: it is a class too (the head has an output for it).
    assert src.classes == ("cat", "dog", "eel") and src.columns.string_labels and src.unlabelled == 1
    assert src.classes_from == "string labels"
    batch = source.canonical(pq.read_table(src.val_files[0]), columns=src.columns, classes=src.classes)
    assert batch.column("label").to_pylist() == [0, None, 2]
    train = source.canonical(pq.read_table(src.train_files[0]), columns=src.columns, classes=src.classes)
    assert train.column("label").to_pylist() == [1, 0] * 4  # dog, cat, ...


def test_other_column_names_and_dictionary_labels(tmp_path: Path) -> None:
    table = image_table(6, classes=2)
    labels = pa.array(["no", "yes"] * 3).dictionary_encode()  # as pandas writes a categorical
    renamed = pa.table({"jpeg": table.column("image"), "answer": labels, "extra": pa.array(range(6))})
    path = write_parquet(tmp_path / "r.parquet", renamed)
    src = source.inspect(str(path), image_column="jpeg", label_column="answer")
    assert src.classes == ("no", "yes") and src.num_classes == 2
    batch = source.canonical(pq.read_table(path), columns=src.columns, classes=src.classes)
    assert batch.column_names == ["image", "label"] and batch.column("label").to_pylist() == [0, 1] * 3


def test_a_directory_that_names_splits_must_name_every_file(tmp_path: Path) -> None:
    from raytrain.errors import UserError

    write_parquet(tmp_path / "d/train-0.parquet", image_table(4))
    write_parquet(tmp_path / "d/extra.parquet", image_table(4))
    with pytest.raises(UserError, match=r"but extra.parquet \(and 0 more\) is in none: name every file by its split"):
        source.inspect(str(tmp_path / "d"))


def test_validation_keeps_the_whole_square_and_crops_the_centre_of_others() -> None:
    from PIL import Image

    from raytrain.recipe.data import images

    wide = np.zeros((10, 30, 3), dtype=np.uint8)
    wide[:, 10:20] = 255  # a white centre third
    out = images.decode(images.encode(Image.fromarray(wide)), 10)
    assert out.shape == (10, 10, 3) and out.min() == 255  # the centre square, not the squashed whole


def test_training_augmentation_crops_flips_and_keeps_the_shape() -> None:
    table = image_table(32, size=24)
    plain = pipeline.decode(table, size=16)
    flipped = pipeline.decode(table, size=16, aug=augment.Augment(preset="flip"))
    same = [(flipped["image"][i] == plain["image"][i]).all() for i in range(32)]
    mirrored = [(flipped["image"][i] == plain["image"][i][:, ::-1]).all() for i in range(32)]
    assert all(a or b for a, b in zip(same, mirrored, strict=True)) and 4 < sum(mirrored) < 28
    policy = augment.Augment(auto="ta_wide", erase=0.5)
    cropped, twice = (pipeline.decode(table, size=16, aug=policy) for _ in range(2))
    assert cropped["image"].shape == (32, 16, 16, 3) and cropped["valid"].all()
    # Fresh entropy: a full-size crop, no flip, an identity policy and no erasing leave an image as it was
    # (about one draw in 3000), so every image must change in one of two draws, not in each.
    unchanged = [(d["image"] == plain["image"]).all(axis=(1, 2, 3)) for d in (cropped, twice)]
    assert not (unchanged[0] & unchanged[1]).any()
    # Data held in memory: the decoded images are augmented by the rank, from its generator.
    kept = augment.arrays(plain["image"], augment.Augment(), 16, rng=np.random.default_rng(1))
    assert kept.shape == plain["image"].shape
    assert not (kept == plain["image"]).all(axis=(1, 2, 3)).all()
    again = augment.arrays(plain["image"], augment.Augment(), 16, rng=np.random.default_rng(1))
    assert (again == kept).all()  # the same generator state, the same crops and flips


def test_random_resized_crops_are_drawn_as_torchvisions() -> None:
    """The presets run on Pillow alone (no torchvision import in the data tasks), with crop boxes drawn as
    torchvision's RandomResizedCrop draws them: compare the share of the area and the aspect over many
    draws, on a square and on a panorama (where the centre fallback is taken more often)."""
    import torch
    from torchvision.transforms import v2

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    for width, height in ((64, 64), (300, 60)):
        ours = [augment.crop_box(width, height, rng) for _ in range(4000)]
        image = torch.empty(3, height, width)
        theirs = [v2.RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(4000)]
        assert all(0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height for x0, y0, x1, y1 in ours)
        share = np.array([(x1 - x0) * (y1 - y0) for x0, y0, x1, y1 in ours]) / (width * height)
        share_tv = np.array([h * w for _, _, h, w in theirs]) / (width * height)
        aspect = np.array([(x1 - x0) / (y1 - y0) for x0, y0, x1, y1 in ours])
        aspect_tv = np.array([w / h for _, _, h, w in theirs])
        assert abs(share.mean() - share_tv.mean()) < 0.02, (share.mean(), share_tv.mean())
        assert abs(np.median(aspect) - np.median(aspect_tv)) < 0.03, (np.median(aspect), np.median(aspect_tv))


def test_prepare_records_the_size_of_the_bytes_it_keeps(tmp_path: Path) -> None:
    from tests.conftest import png

    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(4):
            (tmp_path / "imgs" / cls / f"{i}.png").write_bytes(png(np.full((20, 28, 3), i, dtype=np.uint8)))
    out = run_cli("prepare", str(tmp_path / "imgs"), str(tmp_path / "out"), "--val-fraction", "0")
    assert out.returncode == 0, out.stderr
    src = source.inspect(str(tmp_path / "out"))
    assert src.image_size == 20 and not src.image_size_measured
