"""The parts of raytrain.save_sharded that run without a process group: its staging in TMPDIR, and the
last save's copy into storage when that copy fails (real files; Ray's storage context stood in for by
one that raises as a full filesystem does)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from raytrain.service import sharded


def test_a_dead_workers_staging_is_swept_and_a_live_ones_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    dead = tmp_path / f"{sharded._staging_prefix(gone)}abc"
    live = tmp_path / f"{sharded._staging_prefix(os.getpid())}def"
    elsewhere = tmp_path / f"{sharded.STAGING_PREFIX}{gone}@another-node-ghi"  # a TMPDIR nodes share
    other = tmp_path / "rt-shard-notapid"
    for d in (dead, live, elsewhere, other):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 10)
    sharded._sweep_staging()
    for sweeper in [t for t in threading.enumerate() if t.name == "raytrain-staging-sweep"]:
        sweeper.join(timeout=30)  # (one that ended already is not listed)
    assert not dead.exists() and live.exists() and elsewhere.exists() and other.exists()


class _FullStorage:
    """Ray Train's storage context for one checkpoint, whose copy fails half-way as a full disk does."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.storage_filesystem = pafs.LocalFileSystem()

    def build_checkpoint_path_from_name(self, name: str) -> str:
        return str(self.dest / name)

    def persist_current_checkpoint(self, checkpoint: Any, name: str) -> Any:
        (self.dest / name).mkdir(parents=True)
        (self.dest / name / "__1_0.distcp").write_bytes(b"half")  # cut short
        raise OSError(errno.ENOSPC, "No space left on device")


def _written(staging: Path) -> sharded._Write:
    (staging / "__1_0.distcp").write_bytes(b"a whole shard")
    done: Future[Any] = Future()
    done.set_result(None)
    return sharded._Write(future=done, staging=str(staging), started=0.0)


def test_the_last_saves_copy_that_fails_is_abandoned_and_leaves_no_file_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray.train

    staging, runs = tmp_path / "staging", tmp_path / "run"
    staging.mkdir()
    write = _written(staging)
    copy = sharded._CopyWhenWritten(write, _FullStorage(runs), last=True)
    got = copy(ray.train.Checkpoint.from_directory(str(staging)), "epoch_0003")
    assert got.path == str(runs / "epoch_0003") and not (runs / "epoch_0003" / "__1_0.distcp").exists()
    assert write.copied.is_set()
    out = capsys.readouterr().out
    assert "raytrain: last save abandoned: rank ? could not copy it into the run's storage (" in out, out
    assert "No space left on device" in out and "resumes from its newest checkpoint before it" in out


def test_a_periodic_saves_copy_that_fails_fails_as_ray_trains_own_upload_does(tmp_path: Path) -> None:
    import ray.train

    staging = tmp_path / "staging"
    staging.mkdir()
    copy = sharded._CopyWhenWritten(_written(staging), _FullStorage(tmp_path / "run"))
    with pytest.raises(OSError, match="No space left"):
        copy(ray.train.Checkpoint.from_directory(str(staging)), "epoch_0003")
