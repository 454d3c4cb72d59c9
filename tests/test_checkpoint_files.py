import shutil
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from raytrain.recipe import checkpoint_files


def make(run: Path, epoch: int, value: float) -> Path:
    d = run / checkpoint_files.name(epoch)
    d.mkdir(parents=True)
    checkpoint_files.write(d, {"w": torch.full((4,), value), "epoch": epoch}, {"epoch": epoch})
    return d


def test_names_sort_by_progress() -> None:
    assert checkpoint_files.name(3) == "epoch_0003"
    assert checkpoint_files.parse_name(checkpoint_files.name(3, 120)) == (3, 120)
    assert checkpoint_files.parse_name("checkpoint_2026") is None


def test_newest_intact_is_loaded(tmp_path: Path) -> None:
    make(tmp_path, 1, 1.0)
    make(tmp_path, 2, 2.0)
    loaded = checkpoint_files.load_newest_intact(pafs.LocalFileSystem(), str(tmp_path), torch.device("cpu"))
    assert loaded is not None
    found, state, skipped = loaded
    assert found.epoch == 2 and state["w"][0].item() == 2.0 and skipped == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_meta"])
def test_damaged_latest_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    make(tmp_path, 1, 1.0)
    bad = make(tmp_path, 2, 2.0)
    blob = (bad / checkpoint_files.STATE).read_bytes()
    if damage == "truncate":
        (bad / checkpoint_files.STATE).write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        (bad / checkpoint_files.STATE).write_bytes(blob[:-9] + bytes([blob[-9] ^ 0xFF]) + blob[-8:])
    else:
        (bad / checkpoint_files.META).unlink()
    fs = pafs.LocalFileSystem()
    loaded = checkpoint_files.load_newest_intact(fs, str(tmp_path), torch.device("cpu"))
    assert loaded is not None
    found, state, skipped = loaded
    assert found.epoch == 1 and state["w"][0].item() == 1.0
    assert skipped == [str(bad)]
    assert (bad / checkpoint_files.STATE).exists() or damage == "no_meta"  # nothing is deleted


def test_digest_tracks_optimizer_state() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    empty = checkpoint_files.digest(opt.state_dict())
    p.grad = torch.ones(3)
    opt.step()
    stepped = checkpoint_files.digest(opt.state_dict())
    assert empty != stepped
    again = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    again.load_state_dict(opt.state_dict())
    assert checkpoint_files.digest(again.state_dict()) == stepped


def test_digest_reads_channels_last_state_as_its_logical_bytes() -> None:
    # On GPU the recipe's model is channels_last, and so is SGD's momentum: a 1x1 conv's (C, K, 1, 1)
    # buffer counts as contiguous with a last stride of K (the resume that first ran on an H100 failed here).
    plain = {"w": torch.randn(128, 64, 1, 1), "v": torch.randn(8, 3, 5, 5)}
    last = {k: v.to(memory_format=torch.channels_last) for k, v in plain.items()}
    assert last["w"].stride(-1) == 64 and last["v"].stride(-1) == 3
    assert checkpoint_files.digest(last) == checkpoint_files.digest(plain)
    assert checkpoint_files.digest(last) != checkpoint_files.digest({**plain, "w": plain["w"] + 1})


def test_the_best_checkpoint_is_copied_aside_only_when_it_scores_higher(tmp_path: Path) -> None:
    fs, run = pafs.LocalFileSystem(), str(tmp_path)
    scores = {1: 0.5, 2: 0.8, 3: 0.7}
    for epoch, acc in scores.items():
        d = tmp_path / checkpoint_files.name(epoch)
        d.mkdir()
        checkpoint_files.write(d, {"epoch": epoch}, {"epoch": epoch, checkpoint_files.SCORE: acc})
    kept = [checkpoint_files.keep_best(fs, run, str(tmp_path / checkpoint_files.name(e))) for e in scores]
    assert [k.epoch if k else None for k in kept] == [1, 2, None]
    assert sorted(p.name for p in (tmp_path / checkpoint_files.BEST).iterdir()) == ["epoch_0002"]
    kept_state = tmp_path / "best/epoch_0002" / checkpoint_files.STATE
    assert kept_state.stat().st_ino == (tmp_path / "epoch_0002" / checkpoint_files.STATE).stat().st_ino  # a hard link
    shutil.rmtree(tmp_path / "epoch_0002")  # rotated out by --keep: the copy stays
    best = checkpoint_files.best(fs, run)
    assert (
        best is not None and best.path == str(tmp_path / "best/epoch_0002") and checkpoint_files.verify(fs, best.path)
    )
    # A replacement cut short between its two moves leaves best.old: it still counts, and is finished.
    (tmp_path / checkpoint_files.BEST).rename(tmp_path / "best.old")
    assert checkpoint_files.best(fs, run).epoch == 2  # type: ignore[union-attr]
    assert checkpoint_files.keep_best(fs, run, str(tmp_path / checkpoint_files.name(3))) is None
    assert (tmp_path / "best/epoch_0002").is_dir() and not (tmp_path / "best.old").exists()
