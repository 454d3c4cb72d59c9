"""Which checkpoint a run resumes from, when Ray Train's index and the storage disagree (real files,
Ray Train's own index format)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain import ray_internals
from raytrain.contracts.rundir import MANIFEST
from raytrain.errors import UserError
from raytrain.service import checkpoint_index

FS = pafs.LocalFileSystem()
SNAPSHOT = ray_internals.CHECKPOINT_SNAPSHOT


def make_run(run: Path, names: list[str]) -> None:
    """A run as Ray Train and raytrain leave it: checkpoint dirs with manifests, and Ray's index."""
    kept = []
    for i, name in enumerate(names):
        (run / name).mkdir(parents=True)
        (run / name / "model.pt").write_bytes(bytes(100 + i))
        manifest = checkpoint_index.manifest_of(FS, str(run / name), {"epoch": i + 1}, reported_at=1000.0 + i)
        (run / name / MANIFEST).write_bytes(manifest.to_bytes())
        kept.append(ray_internals.Registered(name, {"epoch": i + 1}, i))
    (run / SNAPSHOT).write_bytes(ray_internals.write_checkpoint_snapshot(kept, len(names)))


def always(fs: pafs.FileSystem, path: str) -> bool:
    return True


def index_names(blob: bytes | None) -> list[str]:
    assert blob is not None
    kept, _ = ray_internals.read_checkpoint_snapshot(blob)
    return [k.dir_name for k in kept]


def test_an_intact_run_resumes_from_its_latest_and_keeps_its_index(tmp_path: Path) -> None:
    make_run(tmp_path, ["c1", "c2", "c3"])
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(tmp_path / "c3") and point.skipped == [] and point.index is None


@pytest.mark.parametrize("damage", ["deleted", "truncated", "emptied", "refused by the workload"])
def test_a_missing_or_damaged_newest_checkpoint_is_passed_over(tmp_path: Path, damage: str) -> None:
    make_run(tmp_path, ["c1", "c2", "c3"])
    newest = tmp_path / "c3"
    if damage == "deleted":
        for f in newest.iterdir():
            f.unlink()
        newest.rmdir()
    elif damage == "truncated":
        (newest / "model.pt").write_bytes(b"x")
    elif damage == "emptied":
        (newest / "model.pt").unlink()
    point = checkpoint_index.settle(
        FS, str(tmp_path), lambda fs, p: not (damage.startswith("refused") and p == str(newest))
    )
    assert point.latest == str(tmp_path / "c2") and point.skipped == [str(newest)]
    assert index_names(point.index) == ["c1", "c2"]
    checkpoint_index.apply(FS, str(tmp_path), point)
    assert index_names((tmp_path / SNAPSHOT).read_bytes()) == ["c1", "c2"]
    assert damage == "deleted" or (newest / MANIFEST).exists()  # passed over, never deleted


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_or_missing_index_is_rebuilt_from_the_manifests(tmp_path: Path, damage: str) -> None:
    make_run(tmp_path, ["c1", "c2", "c3"])
    blob = (tmp_path / SNAPSHOT).read_bytes()
    if damage == "truncated":
        (tmp_path / SNAPSHOT).write_bytes(blob[: len(blob) // 2])
    else:
        (tmp_path / SNAPSHOT).unlink()
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(tmp_path / "c3") and index_names(point.index) == ["c1", "c2", "c3"]
    assert point.index_damaged == (damage == "truncated")
    checkpoint_index.apply(FS, str(tmp_path), point)
    assert json.loads((tmp_path / SNAPSHOT).read_bytes())["latest_checkpoint_result"]["checkpoint_dir_name"] == "c3"
    kept_aside = list(tmp_path.glob(f"{SNAPSHOT}.damaged-*"))
    assert [p.read_bytes() for p in kept_aside] == ([blob[: len(blob) // 2]] if damage == "truncated" else [])


def test_nothing_that_verifies_stops_the_run_rather_than_start_over(tmp_path: Path) -> None:
    make_run(tmp_path, ["c1", "c2"])
    with pytest.raises(UserError, match=r"no checkpoint of run .* verifies \(missing or damaged: c2, c1\).*--fresh"):
        checkpoint_index.settle(FS, str(tmp_path), lambda fs, p: False)


def test_a_damaged_index_with_nothing_to_rebuild_it_from_stops_the_run(tmp_path: Path) -> None:
    (tmp_path / "checkpoint_2026").mkdir()
    (tmp_path / SNAPSHOT).write_text("{ truncated")
    with pytest.raises(UserError, match="is damaged and no checkpoint of the run carries a manifest"):
        checkpoint_index.settle(FS, str(tmp_path), always)


def test_a_damaged_index_goes_aside_for_a_workload_that_checks_its_checkpoints_itself(tmp_path: Path) -> None:
    """A full disk can cut Ray Train's index short before any checkpoint got a manifest; the recipe, which
    hashes every file of its checkpoints, then resumes from the newest it finds whole (tests/test_fit.py)."""
    (tmp_path / "epoch_0001").mkdir()
    (tmp_path / SNAPSHOT).write_text("")
    point = checkpoint_index.settle(FS, str(tmp_path), always, checks_contents=True)
    assert point.latest is None and point.index_damaged and point.index is not None
    checkpoint_index.apply(FS, str(tmp_path), point)
    assert [p.name for p in tmp_path.glob(f"{SNAPSHOT}.damaged-*")] and (tmp_path / SNAPSHOT).read_text()


def test_a_run_without_checkpoints_starts_afresh(tmp_path: Path) -> None:
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest is None and point.index is None


def test_only_an_unregistered_upload_is_cut_short_not_the_runs_own_directories(tmp_path: Path) -> None:
    from raytrain.contracts import rundir
    from raytrain.service.checkpoint_index import cut_short

    for name in ("epoch_0002", rundir.TENSORBOARD, "best"):  # an upload cut short; the service's; the recipe's
        (tmp_path / name).mkdir()
    found = cut_short(pafs.LocalFileSystem(), str(tmp_path), since=0.0, own=("best",))
    assert found == [str(tmp_path / "epoch_0002")]
    # A whole checkpoint Ray failed to register (its index write cut short) is not an upload cut short.
    (tmp_path / "epoch_0001").mkdir()
    whole = cut_short(pafs.LocalFileSystem(), str(tmp_path), 0.0, ("best",), lambda fs, p: p.endswith("_0001"))
    assert whole == [str(tmp_path / "epoch_0002")]
