"""Which checkpoint a run resumes from, when Ray Train's index and the storage disagree (real files,
Ray Train's own index format)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain import ray_internals
from raytrain.contracts.rundir import MANIFEST, FileSum, Manifest, Part
from raytrain.errors import UserError
from raytrain.service import checkpoint_index, checksums

FS = pafs.LocalFileSystem()
SNAPSHOT = ray_internals.CHECKPOINT_SNAPSHOT


def make_run(run: Path, names: list[str]) -> None:
    """A run as Ray Train and raytrain leave it: checkpoint dirs with manifests, and Ray's index."""
    kept = []
    for i, name in enumerate(names):
        (run / name).mkdir(parents=True)
        (run / name / "model.pt").write_bytes(bytes(100 + i))
        manifest = checkpoint_index.manifest_of(FS, str(run / name), {"epoch": i + 1}, reported_at=1.0 + i)
        (run / name / MANIFEST).write_bytes(manifest.to_bytes())
        kept.append(ray_internals.Registered(name, {"epoch": i + 1}, i))
    (run / SNAPSHOT).write_bytes(ray_internals.write_checkpoint_snapshot(kept, len(names)))


SHARDS = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", ".metadata"]


def dcp_metadata(files: list[str]) -> bytes:
    """torch.distributed.checkpoint's .metadata naming ``files`` as what the ranks wrote (as DCP pickles it)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    where = {MetadataIndex(f"t{i}"): _StorageInfo(name, 0, 1) for i, name in enumerate(files)}
    return pickle.dumps(Metadata(state_dict_metadata={}, storage_data=where))


def make_sharded_run(run: Path, names: list[str]) -> None:
    """A run of three ranks saving with torch.distributed.checkpoint: a shard from each (the coordinator's
    .metadata from rank 0), every rank's part, the manifest the controller merges from them, Ray's index."""
    kept = []
    for i, name in enumerate(names):
        directory = run / name
        directory.mkdir(parents=True)
        for rank in range(3):
            mine = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
            for f in mine:
                blob = bytes([rank + i + 1]) * 20000
                (directory / f).write_bytes(dcp_metadata(SHARDS[:3]) + blob if f == ".metadata" else blob)
            sums = checksums.sum_files(FS, str(directory), mine)
            part = Part(rank=rank, files=sums, world_size=3, report_index=i + 1, group=f"g{i}", every_rank=True)
            checksums.write_part(FS, str(directory), part)
        manifest = checkpoint_index.manifest_of(FS, str(directory), {"epoch": i + 1}, reported_at=1.0 + i)
        (directory / MANIFEST).write_bytes(manifest.to_bytes())
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


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("one shard overwritten in place", "__1_0.distcp is not as it was written: CRC32 "),
        ("one shard truncated", "__2_0.distcp holds 10000 bytes of 20000"),
        ("one shard missing", "__1_0.distcp is missing"),
        ("the metadata missing", ".metadata is missing"),
        # A rank's copy of the last save failed: its files went again, and the manifest Ray's registration
        # wrote lists what was there; torch's metadata still names the shard.
        ("one rank's copy dropped before the manifest", "not every rank recorded its part of it"),
        ("rank 0's copy dropped before the manifest", "not every rank recorded its part of it"),
    ],
)
def test_a_sharded_checkpoint_with_one_shard_damaged_is_passed_over_and_named(
    tmp_path: Path, damage: str, why: str
) -> None:
    make_sharded_run(tmp_path, ["c1", "c2"])
    newest = tmp_path / "c2"
    manifest = Manifest.from_bytes((newest / MANIFEST).read_bytes())
    assert sorted(manifest.files) == sorted(SHARDS) and manifest.version == 2
    assert all(s.crc32 is not None and s.size == 20000 for n, s in manifest.files.items() if n != ".metadata")
    shard = newest / (why.split(" ")[0] if why.startswith(("__", ".metadata")) else "__1_0.distcp")
    if damage.endswith("in place"):
        with shard.open("r+b") as f:  # 4 KB in the middle zeroed, the size unchanged
            f.seek(8000)
            f.write(bytes(4096))
    elif damage.endswith("truncated"):
        shard.write_bytes(shard.read_bytes()[:10000])
    elif damage.endswith("before the manifest"):
        rank = 0 if damage.startswith("rank 0") else 1
        for f in [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else []):
            (newest / f).unlink()
        (newest / rundir_part(rank)).unlink()
        rewritten = checkpoint_index.manifest_of(FS, str(newest), {"epoch": 2}, reported_at=2.0)
        (newest / MANIFEST).write_bytes(rewritten.to_bytes())
    else:
        shard.unlink()
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(tmp_path / "c1") and point.skipped == [str(newest)]
    assert point.why[str(newest)].startswith(why), point.why
    assert index_names(point.index) == ["c1"]
    if damage.endswith("before the manifest"):  # by the parts alone: a shallow check, on any storage
        assert (checkpoint_index.damage(FS, str(newest), deep=False) or "").startswith(why)


@pytest.mark.parametrize("ranks", [(2,), (0, 2)])
def test_a_checkpoint_that_some_ranks_report_is_whole_with_their_files(tmp_path: Path, ranks: tuple[int, ...]) -> None:
    # Ray Train takes a report's checkpoint from whichever ranks give one: the last pipeline stage alone,
    # or one rank a node. Only a save every rank writes part of (raytrain's sharded saves) needs them all.
    make_run(tmp_path, ["c1", "c2"])
    newest = tmp_path / "c2"
    (newest / "model.pt").unlink()
    for rank in ranks:
        (newest / f"rank{rank}.pt").write_bytes(bytes([rank]) * 300)
        sums = checksums.sum_files(FS, str(newest), [f"rank{rank}.pt"])
        checksums.write_part(FS, str(newest), Part(rank=rank, files=sums, world_size=4, report_index=2, group="g"))
    manifest = checkpoint_index.manifest_of(FS, str(newest), {"epoch": 2}, reported_at=2.0)
    (newest / MANIFEST).write_bytes(manifest.to_bytes())
    for deep in (True, False):
        assert checkpoint_index.damage(FS, str(newest), deep=deep) is None
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(newest) and point.skipped == [], point.why
    (newest / f"rank{ranks[-1]}.pt").write_bytes(b"x" * 300)  # and a file of theirs damaged is still found
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(tmp_path / "c1") and point.why[str(newest)].startswith(f"rank{ranks[-1]}.pt is not as")


def test_the_record_of_a_checkpoint_takes_the_ranks_sums_and_sums_only_what_they_do_not_cover(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    directory.mkdir()
    for name in ("a", "b", "c"):
        (directory / name).write_bytes(name.encode() * 1000)
    # Rank 0 summed "a" (a CRC nobody could compute from the bytes: taken from the part, not read again);
    # rank 1 summed "b" at a size another upload has since replaced; nobody summed "c".
    checksums.write_part(FS, str(directory), Part(rank=0, files={"a": FileSum(size=1000, crc32=7)}))
    checksums.write_part(FS, str(directory), Part(rank=1, files={"b": FileSum(size=5, crc32=1), "gone": FileSum(3, 9)}))
    recorded = checksums.record(FS, str(directory))
    assert recorded["a"] == FileSum(size=1000, crc32=7)
    assert recorded["b"] == checksums.sum_file(FS, str(directory / "b")) and recorded["b"].size == 1000
    assert recorded["c"] == checksums.sum_file(FS, str(directory / "c"))
    assert recorded["gone"] == FileSum(3, 9)  # a file a rank uploaded that is not there: the checkpoint is not whole
    assert not any(checksums.own(n) for n in recorded)


def test_a_manifest_of_version_1_is_checked_by_size(tmp_path: Path) -> None:
    make_run(tmp_path, ["c1", "c2"])
    for i, name in enumerate(("c1", "c2")):
        (tmp_path / name / MANIFEST).write_text(json.dumps({"files": {"model.pt": 100 + i}, "metrics": {}}))
    assert Manifest.from_bytes((tmp_path / "c2" / MANIFEST).read_bytes()).files == {"model.pt": FileSum(101, None)}
    (tmp_path / "c2" / "model.pt").write_bytes(b"\xff" * 101)  # same size: a version-1 manifest cannot tell
    assert checkpoint_index.settle(FS, str(tmp_path), always).latest == str(tmp_path / "c2")
    (tmp_path / "c2" / "model.pt").write_bytes(b"x")
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(tmp_path / "c1") and point.why == {str(tmp_path / "c2"): "model.pt holds 1 bytes of 101"}


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
    no = "its own check refuses it"
    with pytest.raises(UserError, match=rf"of run .* verifies \(missing or damaged: c2: {no}; c1: {no}\).*--fresh"):
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
    # Nor is one every rank of a worker group uploaded and recorded before Ray Train collected it: the next
    # start resumes from it. One rank's part alone does not make it whole.
    (tmp_path / "epoch_0002" / "shard").write_bytes(b"x" * 100)
    for rank in (0, 1):
        part = Part(rank=rank, files=checksums.sum_files(FS, str(tmp_path / "epoch_0002"), ["shard"]), world_size=2)
        checksums.write_part(FS, str(tmp_path / "epoch_0002"), dataclasses.replace(part, report_index=3, group="g"))
        found = cut_short(FS, str(tmp_path), 0.0, ("best",), lambda fs, p: p.endswith("_0001"))
        assert found == ([str(tmp_path / "epoch_0002")] if rank == 0 else []), (rank, found)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saves it, as no_dist says
def test_a_checkpoint_every_rank_uploaded_but_ray_never_collected_is_found_whole_or_named(tmp_path: Path) -> None:
    """ray-project/ray#41700: a rank died before the controller polled a report every rank had made. The
    checkpoint of the report after the last one collected is found by its ranks' parts; a torch distributed
    checkpoint is whole only when a part came with every file its metadata names."""
    import torch
    import torch.distributed.checkpoint as dcp

    make_run(tmp_path, ["c1"])  # report 1 collected
    lost = tmp_path / "c2"
    dcp.save({"w": torch.arange(5000.0)}, storage_writer=dcp.FileSystemWriter(str(lost)), no_dist=True)
    written = sorted(p.name for p in lost.iterdir())
    assert written == [".metadata", "__0_0.distcp"], written

    def parts(rank0: list[str], index: int = 2) -> None:
        for f in lost.glob(".raytrain-part-*"):
            f.unlink()
        sums = checksums.sum_files(FS, str(lost), rank0)
        part = Part(rank=0, files=sums, world_size=1, report_index=index, metrics={"epoch": 2}, written_at=5.0)
        checksums.write_part(FS, str(lost), part)

    parts(written)
    found = checkpoint_index.uncollected(FS, str(tmp_path), 2)
    assert found == [checkpoint_index.Uncollected(str(lost), {"epoch": 2}, 5.0, 1, None, report_index=2)]
    assert checkpoint_index.uncollected(FS, str(tmp_path), 3) == []  # not the report after the last collected
    parts(written, index=1)  # an upload of an earlier report that was collected under another name
    assert checkpoint_index.uncollected(FS, str(tmp_path), 2) == []
    parts([".metadata"])  # the rank that wrote the shard died while uploading it: no part came with it
    [found] = checkpoint_index.uncollected(FS, str(tmp_path), 2)
    assert found.damage == "__0_0.distcp came with no rank's part (its upload did not finish)"
    parts(written)
    with (lost / "__0_0.distcp").open("r+b") as f:
        f.seek(100)
        f.write(bytes(64))
    [found] = checkpoint_index.uncollected(FS, str(tmp_path), 2)
    assert (found.damage or "").startswith("__0_0.distcp is not as it was written: CRC32")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_stopped_before_ray_collected_a_whole_checkpoint_resumes_from_it(tmp_path: Path) -> None:
    """The last attempt ended (a stop, a killed driver) after every rank uploaded its checkpoint and before
    Ray Train's controller collected the report: the next start resumes from it, recorded as recovered; a
    damaged one is passed over and named."""
    import torch
    import torch.distributed.checkpoint as dcp

    make_run(tmp_path, ["c1"])
    lost = tmp_path / "c2"
    dcp.save({"w": torch.arange(5000.0)}, storage_writer=dcp.FileSystemWriter(str(lost)), no_dist=True)
    sums = checksums.sum_files(FS, str(lost), [".metadata", "__0_0.distcp"])
    rank0 = Part(rank=0, files=sums, world_size=1, report_index=2, metrics={"epoch": 2}, written_at=5.0)
    checksums.write_part(FS, str(lost), rank0)
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(lost) and len(point.recovered) == 1 and point.skipped == []
    assert index_names(point.index) == ["c1", "c2"]
    checkpoint_index.apply(FS, str(tmp_path), point)
    manifest = Manifest.from_bytes((lost / MANIFEST).read_bytes())
    assert manifest.recovered and manifest.files == sums and manifest.metrics == {"epoch": 2}
    assert checkpoint_index.settle(FS, str(tmp_path), always).index is None  # registered now, like any other

    (lost / MANIFEST).unlink()
    (tmp_path / SNAPSHOT).write_bytes(
        ray_internals.write_checkpoint_snapshot([ray_internals.Registered("c1", {}, 0)], 1)
    )
    with (lost / "__0_0.distcp").open("r+b") as f:
        f.write(bytes(64))
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(tmp_path / "c1") and point.recovered == () and point.skipped == [str(lost)]
    assert point.why[str(lost)].startswith("__0_0.distcp is not as it was written: CRC32")


@pytest.mark.parametrize(
    ("rank1", "recovered"), [("of the same worker group", True), ("of an earlier attempt", False), ("none", False)]
)
def test_an_uncollected_checkpoint_counts_only_with_a_part_from_every_rank_of_one_worker_group(
    tmp_path: Path, rank1: str, recovered: bool
) -> None:
    """Rank 1 died while uploading (no part), or the directory holds its part from an earlier attempt of
    the same report under the same name: nothing says the checkpoint is whole, so it is not taken."""
    make_run(tmp_path, ["c1"])
    lost = tmp_path / "c2"
    lost.mkdir()
    for rank in (0, 1):
        (lost / f"shard-{rank}").write_bytes(bytes([rank]) * 3000)
        group = "g2" if rank == 0 or rank1 == "of the same worker group" else "g1"
        if rank == 0 or rank1 != "none":
            sums = checksums.sum_files(FS, str(lost), [f"shard-{rank}"])
            part = Part(rank=rank, files=sums, world_size=2, report_index=2, group=group, written_at=9.0)
            checksums.write_part(FS, str(lost), part)
    found = checkpoint_index.uncollected(FS, str(tmp_path), 2)
    assert [f.damage for f in found] == ([None] if recovered else []), found
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(lost if recovered else tmp_path / "c1") and point.skipped == []


def _uncollected(run: Path, name: str, report_index: int, at: float, group: str = "g") -> Path:
    """A checkpoint both ranks of worker group ``group`` uploaded and recorded for ``report_index``."""
    directory = run / name
    directory.mkdir()
    for rank in (0, 1):
        (directory / f"shard-{rank}").write_bytes(bytes([rank, report_index]) * 2000)
        sums = checksums.sum_files(FS, str(directory), [f"shard-{rank}"])
        part = Part(
            rank=rank,
            files=sums,
            world_size=2,
            report_index=report_index,
            group=group,
            metrics={"epoch": report_index},
            written_at=at,
        )
        checksums.write_part(FS, str(directory), part)
    return directory


def test_every_whole_checkpoint_ray_never_collected_is_recovered_in_order_up_to_the_first_damaged(
    tmp_path: Path,
) -> None:
    """Asynchronous saves leave more than one checkpoint uploaded and not yet collected when a rank dies:
    each whole one is registered in report order, and the first that is not whole ends the walk, named."""
    make_run(tmp_path, ["c1"])
    c2, c3, c4 = (_uncollected(tmp_path, f"c{i}", i, at=10.0 + i) for i in (2, 3, 4))
    with (c4 / "shard-1").open("r+b") as f:
        f.write(bytes(64))
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert [f.path for f in point.recovered] == [str(c2), str(c3)] and point.latest == str(c3)
    assert point.skipped == [str(c4)] and point.why[str(c4)].startswith("shard-1 is not as it was written")
    assert index_names(point.index) == ["c1", "c2", "c3"]
    checkpoint_index.apply(FS, str(tmp_path), point)
    assert all(Manifest.from_bytes((d / MANIFEST).read_bytes()).recovered for d in (c2, c3))
    assert not (c4 / MANIFEST).exists()
    assert checkpoint_index.settle(FS, str(tmp_path), always).recovered == ()  # registered now


def test_with_ray_trains_index_gone_the_reports_after_the_newest_kept_are_still_found(tmp_path: Path) -> None:
    """The index is gone (rebuilt from the manifests, which do not count reports): the ranks' parts of the
    newest checkpoint kept say which report it came with, and the whole checkpoint uploaded after it that
    Ray Train never collected is recovered, not passed over in silence."""
    make_run(tmp_path, ["c1"])
    sums = checksums.sum_files(FS, str(tmp_path / "c1"), ["model.pt"])
    part = Part(rank=0, files=sums, world_size=1, report_index=1, group="g", metrics={"epoch": 1}, written_at=5.0)
    checksums.write_part(FS, str(tmp_path / "c1"), part)
    c2 = _uncollected(tmp_path, "c2", 2, at=10.0)
    (tmp_path / SNAPSHOT).unlink()
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert [f.path for f in point.recovered] == [str(c2)] and point.latest == str(c2)
    assert index_names(point.index) == ["c1", "c2"]


def test_an_earlier_attempts_later_report_is_not_taken_as_the_sequel_of_a_newer_one(tmp_path: Path) -> None:
    """Attempt A uploaded reports 2 and 3; the run went on from 1 (A's report 2 lost), and attempt B
    uploaded its own report 2 before it too ended. A's report 3 was trained from A's 2, not B's: only B's
    is recovered."""
    make_run(tmp_path, ["c1"])
    _uncollected(tmp_path, "a2", 2, at=20.0, group="A")
    _uncollected(tmp_path, "a3", 3, at=21.0, group="A")
    b2 = _uncollected(tmp_path, "b2", 2, at=30.0, group="B")
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert [f.path for f in point.recovered] == [str(b2)] and point.latest == str(b2) and point.skipped == []


def _saved_again(run: Path, ranks: tuple[int, ...]) -> Path:
    """c2 as a run left it that went back past it (damaged, kept with its manifest of worker group A's
    upload) and saved it again under the same name from worker group B's ``ranks`` of 2, never collected."""
    make_run(run, ["c1", "c2"])
    (run / SNAPSHOT).write_bytes(
        ray_internals.write_checkpoint_snapshot([ray_internals.Registered("c1", {"epoch": 1}, 0)], 1)
    )
    again = run / "c2"
    old = Manifest.from_bytes((again / MANIFEST).read_bytes())
    (again / MANIFEST).write_bytes(dataclasses.replace(old, groups=["A"]).to_bytes())
    (again / "model.pt").unlink()  # the old upload's file, replaced by this attempt's shards
    for rank in ranks:
        (again / f"shard-{rank}").write_bytes(bytes([rank, 9]) * 2000)
        sums = checksums.sum_files(FS, str(again), [f"shard-{rank}"])
        part = Part(rank=rank, files=sums, world_size=2, report_index=2, group="B", metrics={"epoch": 2})
        checksums.write_part(FS, str(again), dataclasses.replace(part, written_at=50.0))
    return again


def test_a_checkpoint_saved_again_under_a_damaged_ones_name_is_judged_by_its_new_parts(tmp_path: Path) -> None:
    """The old manifest no longer describes the directory: the new upload is found by its parts and
    recovered, not hidden by the old manifest nor judged against it."""
    again = _saved_again(tmp_path, (0, 1))
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert [f.path for f in point.recovered] == [str(again)] and point.latest == str(again) and point.skipped == []
    checkpoint_index.apply(FS, str(tmp_path), point)
    written = Manifest.from_bytes((again / MANIFEST).read_bytes())
    assert sorted(written.files) == ["shard-0", "shard-1"] and written.groups == ["B"]
    assert checkpoint_index.damage(FS, str(again)) is None


def test_a_checkpoint_saved_again_by_some_ranks_only_is_not_whole(tmp_path: Path) -> None:
    """Rank 1 died before its upload under the old name finished: neither the old manifest nor the new
    parts vouch for the directory."""
    again = _saved_again(tmp_path, (0,))
    assert (
        checkpoint_index.damage(FS, str(again))
        == "no manifest, and not every rank recorded its part: an upload cut short"
    )
    assert checkpoint_index.settle(FS, str(tmp_path), always).latest == str(tmp_path / "c1")


def test_a_recovered_checkpoint_whose_manifest_was_never_written_is_still_checked_by_its_parts(tmp_path: Path) -> None:
    """The index is written before the recovered checkpoints' manifests: a start cut short in between
    leaves an indexed checkpoint with no manifest, and its ranks' parts vouch for it (or not)."""
    make_run(tmp_path, ["c1"])
    c2 = _uncollected(tmp_path, "c2", 2, at=12.0)
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    (tmp_path / SNAPSHOT).write_bytes(point.index or b"")  # the index written; the manifest never was
    assert checkpoint_index.settle(FS, str(tmp_path), always).latest == str(c2)
    (c2 / "shard-0").write_bytes(b"x")
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert point.latest == str(tmp_path / "c1") and point.why[str(c2)] == "shard-0 holds 1 bytes of 4000"


def test_a_start_finds_an_uncollected_checkpoint_past_reports_made_without_one(tmp_path: Path) -> None:
    """Ray Train's saved count of reports leaves out those made without a checkpoint: c1 was report 1,
    reports 2 and 3 carried metrics only, and report 4's checkpoint was uploaded and never collected.
    The next start still finds it (written after c1), and the index goes on counting from it."""
    make_run(tmp_path, ["c1"])
    rank0 = Part(rank=0, files={}, world_size=2, report_index=1, written_at=10.0)
    checksums.write_part(FS, str(tmp_path / "c1"), rank0)
    _uncollected(tmp_path, "stale", 5, at=9.0)  # from before c1: an earlier attempt's, not this one's
    c4 = _uncollected(tmp_path, "c4", 4, at=14.0)
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert [f.path for f in point.recovered] == [str(c4)] and point.latest == str(c4)
    assert ray_internals.read_checkpoint_snapshot(point.index or b"")[1] == 4


def test_the_walk_passes_reports_without_a_checkpoint_and_stops_at_an_upload_cut_short(tmp_path: Path) -> None:
    """c1 registered (uploaded at 10). Left behind: an earlier attempt's report 2 from before c1, which is
    not c1's sequel; then this attempt's reports 2 and 4 (3 carried metrics only): both recovered. With
    report 3's upload cut short (rank 1 never recorded its part), the walk ends before report 4."""
    make_run(tmp_path, ["c1"])
    checksums.write_part(
        FS, str(tmp_path / "c1"), Part(rank=0, files={}, world_size=2, report_index=1, written_at=10.0)
    )
    _uncollected(tmp_path, "old2", 2, at=5.0, group="A")
    assert checkpoint_index.settle(FS, str(tmp_path), always).recovered == ()  # written before c1: not its sequel
    c2, c4 = _uncollected(tmp_path, "c2", 2, at=12.0), _uncollected(tmp_path, "c4", 4, at=14.0)
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert [f.path for f in point.recovered] == [str(c2), str(c4)] and point.latest == str(c4)
    assert [k.report_index for k in ray_internals.read_checkpoint_snapshot(point.index or b"")[0]] == [0, 1, 3]
    cut = _uncollected(tmp_path, "c3", 3, at=13.0)
    (cut / rundir_part(1)).unlink()
    point = checkpoint_index.settle(FS, str(tmp_path), always)
    assert [f.path for f in point.recovered] == [str(c2)] and point.latest == str(c2)


def rundir_part(rank: int) -> str:
    from raytrain.contracts import rundir

    return rundir.part_name(rank)


def test_a_checkpoint_every_rank_writes_part_of_is_not_whole_without_their_record(tmp_path: Path) -> None:
    """The recipe's sharded checkpoints: with no manifest, only a part from every rank of one worker group
    vouches for one; a directory rank 0 finished uploading while rank 1 was killed is an upload cut short."""
    c = _uncollected(tmp_path, "c", 2, at=1.0)
    assert checkpoint_index.damage(FS, str(c), deep=False, recorded=True) is None
    (c / rundir_part(1)).unlink()
    assert checkpoint_index.damage(FS, str(c), deep=False) is None  # the workload decides
    assert checkpoint_index.damage(FS, str(c), deep=False, recorded=True) == (
        "no manifest, and not every rank recorded its part: an upload cut short"
    )
