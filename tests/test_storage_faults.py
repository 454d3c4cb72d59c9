"""Storage that fails for a moment or stalls (raytrain.fsio): a transient read error is retried and never
taken for damage, one that lasts is one line with nothing changed, and a stalled mount is a one-line error
within RAYTRAIN_STORAGE_TIMEOUT. The flaky filesystem is pyarrow's own LocalFileSystem behind a handler that
fails the reads a test names; the stall is a real blocking open (a FIFO nobody writes)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from raytrain import fsio, ray_internals
from raytrain.contracts.rundir import MANIFEST
from raytrain.recipe import checkpoint_files
from raytrain.service import checkpoint_index
from tests.conftest import assert_user_error, run_cli


class Flaky(pafs.FileSystemHandler):  # type: ignore[misc]
    """The local filesystem, except that opening a file whose path ends with one of ``fail`` raises EIO
    that many more times (a count of -1: for ever)."""

    def __init__(self, fail: dict[str, int]) -> None:
        self.local = pafs.LocalFileSystem()
        self.fail = fail
        self.failed: list[str] = []

    def _maybe_fail(self, path: str) -> None:
        for suffix, left in self.fail.items():
            if path.endswith(suffix) and left != 0:
                self.fail[suffix] = left - 1 if left > 0 else -1
                self.failed.append(path)
                raise OSError(errno.EIO, f"Input/output error: {path}")

    def open_input_stream(self, path: str) -> Any:
        self._maybe_fail(path)
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        self._maybe_fail(path)
        return self.local.open_input_file(path)

    # The rest is the local filesystem's.
    def get_type_name(self) -> str:
        return "flaky"

    def equals(self, other: Any) -> bool:
        return other is self

    def get_file_info(self, paths: list[str]) -> Any:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: Any) -> Any:
        return self.local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise NotImplementedError

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return self.local.open_output_stream(path)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        return self.local.open_append_stream(path)

    def normalize_path(self, path: str) -> str:
        return path


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsio, "BACKOFF_S", (0.01, 0.01, 0.01))


def run_with_two_checkpoints(run: Path) -> bytes:
    """A recipe run with epoch_0001 and epoch_0002 registered (manifests, Ray Train's index); its index."""
    kept = []
    for i in (1, 2):
        ckpt = run / checkpoint_files.name(i)
        ckpt.mkdir(parents=True)
        checkpoint_files.write(ckpt, {"model": {"w": torch.ones(2) * i}, "epoch": i}, {"epoch": i})
        manifest = checkpoint_index.manifest_of(pafs.LocalFileSystem(), str(ckpt), {"epoch": i}, float(i))
        (ckpt / MANIFEST).write_bytes(manifest.to_bytes())
        kept.append(ray_internals.Registered(ckpt.name, {"epoch": i}, i - 1))
    index = ray_internals.write_checkpoint_snapshot(kept, 2)
    (run / ray_internals.CHECKPOINT_SNAPSHOT).write_bytes(index)
    return index


@pytest.mark.parametrize(
    "flaky", [MANIFEST, checkpoint_files.META, checkpoint_files.STATE, ray_internals.CHECKPOINT_SNAPSHOT]
)
def test_a_read_that_fails_for_a_moment_is_tried_again_not_taken_for_damage(tmp_path: Path, flaky: str) -> None:
    index = run_with_two_checkpoints(tmp_path)
    fs = pafs.PyFileSystem(handler := Flaky({flaky: 2}))
    point = checkpoint_index.settle(fs, str(tmp_path), checkpoint_files.verify)
    assert point.latest == str(tmp_path / "epoch_0002") and point.skipped == [] and point.index is None
    assert len(handler.failed) == 2
    assert (tmp_path / ray_internals.CHECKPOINT_SNAPSHOT).read_bytes() == index


@pytest.mark.parametrize("flaky", [MANIFEST, checkpoint_files.STATE, ray_internals.CHECKPOINT_SNAPSHOT])
def test_a_read_that_keeps_failing_is_one_line_and_nothing_is_rewritten(tmp_path: Path, flaky: str) -> None:
    index = run_with_two_checkpoints(tmp_path)
    fs = pafs.PyFileSystem(Flaky({flaky: -1}))
    with pytest.raises(fsio.StorageError, match=r"^storage kept failing while reading .*Input/output error.*4 tries\)"):
        checkpoint_index.settle(fs, str(tmp_path), checkpoint_files.verify)
    assert (tmp_path / ray_internals.CHECKPOINT_SNAPSHOT).read_bytes() == index  # not moved aside, not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["epoch_0001", "epoch_0002", ray_internals.CHECKPOINT_SNAPSHOT]
    )


def test_a_worker_loading_through_a_failing_storage_does_not_fall_back_to_an_older_checkpoint(tmp_path: Path) -> None:
    run_with_two_checkpoints(tmp_path)
    fs = pafs.PyFileSystem(Flaky({f"epoch_0002/{checkpoint_files.STATE}": -1}))
    with pytest.raises(fsio.StorageError):
        checkpoint_files.load_newest_intact(fs, str(tmp_path), torch.device("cpu"))
    found, state, skipped = checkpoint_files.load_newest_intact(
        pafs.PyFileSystem(Flaky({f"epoch_0002/{checkpoint_files.STATE}": 1})), str(tmp_path), torch.device("cpu")
    ) or (None, None, None)
    assert found is not None and found.epoch == 2 and skipped == [] and state is not None


def test_a_stalled_call_is_given_up_on_within_its_bound() -> None:
    start = time.monotonic()
    stalled = threading.Event()  # set when the test ends: the stalled calls' threads end with it
    try:
        with pytest.raises(
            fsio.StorageError, match=r"within 1 s while listing x: a stalled mount\? nothing was changed;"
        ):
            fsio.bounded(stalled.wait, "listing x", timeout_s=1)
        assert time.monotonic() - start < 3
        # A write left running may yet land: the line does not say that nothing changed.
        with pytest.raises(fsio.StorageError, match=r"while moving x: a stalled mount\? it may still take effect once"):
            fsio.bounded(stalled.wait, "moving x", timeout_s=1, writes=True)
    finally:
        stalled.set()
    no_space = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(
        fsio.StorageError, match=r"storage failed while writing y \(\[Errno 28\] No space left.*\): it may be"
    ):
        fsio.bounded(lambda: (_ for _ in ()).throw(no_space), "writing y", 5, writes=True)


def test_a_long_read_that_goes_on_answering_is_not_a_stall() -> None:
    """Checking a large checkpoint's CRCs takes longer than the bound; storage answers every chunk."""

    def long_read() -> str:
        for _ in range(12):
            time.sleep(0.1)
            fsio.answered()
        return "read"

    assert fsio.bounded(long_read, "reading z", timeout_s=0.5) == "read"


def test_fit_on_a_stalled_run_directory_says_so_within_the_bound(tmp_path: Path) -> None:
    """The run's lock is a FIFO nobody writes: reading it blocks, as a read from a hung NFS mount does."""
    from raytrain.contracts.rundir import LOCK, RUN_META
    from raytrain.service.config import fingerprint

    func = "tests.user_code.train_func:train_func"
    run = tmp_path / "runs" / "stalled"
    run.mkdir(parents=True, mode=0o700)
    experiment = {"train_func": func, "config": {}, "data": {}}
    (run / RUN_META).write_text(json.dumps({"fingerprint": fingerprint(experiment), "experiment": experiment}))
    os.mkfifo(run / LOCK)
    args = ("fit", "--train-func", func, "--dry-run", "--storage", str(tmp_path / "runs"), "--name", "stalled")
    out = run_cli(*args, env={"RAYTRAIN_STORAGE_TIMEOUT": "3"}, timeout=60)
    assert_user_error(out, "storage did not answer within 3 s while reading run 'stalled' in ", "a stalled mount?")
    assert out.seconds < 20


def test_a_storage_timeout_that_is_not_a_number_is_one_line(tmp_path: Path) -> None:
    out = run_cli("fit", "--dry-run", "--storage", str(tmp_path), env={"RAYTRAIN_STORAGE_TIMEOUT": "soon"})
    assert_user_error(out, "RAYTRAIN_STORAGE_TIMEOUT='soon' is not a number")
