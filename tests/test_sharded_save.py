"""The parts of raytrain.save_sharded and raytrain.save_whole that run without a process group: their
staging in TMPDIR, a whole save's write in the upload step, the host copy it writes from, and the copy
into storage when it fails (real files; Ray's storage context stood in for by one that copies as it does,
or raises as a full filesystem does)."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
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


class _Storage:
    """Ray Train's storage context for one checkpoint, copying as its own upload does."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.storage_filesystem = pafs.LocalFileSystem()

    def persist_current_checkpoint(self, checkpoint: Any, name: str) -> Any:
        import ray.train

        shutil.copytree(checkpoint.path, self.dest / name, dirs_exist_ok=True)
        return ray.train.Checkpoint(str(self.dest / name))


def test_a_whole_save_is_written_once_in_the_upload_step_then_copied(tmp_path: Path) -> None:
    import ray.train

    staging, runs = tmp_path / "staging", tmp_path / "run"
    staging.mkdir()
    writes: list[str] = []

    def files(directory: str, state: object) -> None:
        writes.append(directory)
        (Path(directory) / "state.pt").write_bytes(b"the state")

    class State:  # what the files are written from: let go of once written, though Ray Train keeps the call
        pass

    state = State()
    held = weakref.ref(state)
    write = sharded._Write(future=Future(), staging=str(staging), started=0.0)
    upload = sharded._WriteThenCopy(functools.partial(files, state=state), write, _Storage(runs))
    del state
    checkpoint = ray.train.Checkpoint.from_directory(str(staging))
    for _ in range(2):  # Ray Train retries a failed upload with the same call: the files are written once
        got = upload(checkpoint, "epoch_0002")
    assert writes == [str(staging)] and write.copied.is_set() and held() is None
    assert got.path == str(runs / "epoch_0002") and (runs / "epoch_0002" / "state.pt").read_bytes() == b"the state"


def test_a_whole_saves_write_that_fails_fails_the_run_naming_the_full_disk(tmp_path: Path) -> None:
    import ray.train

    from raytrain.service import outcomes

    staging = tmp_path / "staging"
    staging.mkdir()

    def files(directory: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    write = sharded._Write(future=Future(), staging=str(staging), started=0.0)
    upload = sharded._WriteThenCopy(files, write, _Storage(tmp_path / "run"))
    with pytest.raises(RuntimeError, match=r"writing the checkpoint into .* failed .*RAYTRAIN_TMPDIR") as failed:
        upload(ray.train.Checkpoint.from_directory(str(staging)), "epoch_0002")
    assert outcomes.out_of_space(failed.value) and write.copied.is_set()
    assert not (tmp_path / "run").exists()


def test_a_whole_saves_write_that_fails_otherwise_says_what_failed_first(tmp_path: Path) -> None:
    import ray.train

    staging = tmp_path / "staging"
    staging.mkdir()

    def files(directory: str) -> None:
        raise TypeError("cannot pickle '_thread.lock' object")

    write = sharded._Write(future=Future(), staging=str(staging), started=0.0)
    upload = sharded._WriteThenCopy(files, write, _Storage(tmp_path / "run"))
    with pytest.raises(RuntimeError) as failed:
        upload(ray.train.Checkpoint.from_directory(str(staging)), "epoch_0002")
    said = str(failed.value)
    assert "failed (TypeError: cannot pickle '_thread.lock' object); " in said, said
    assert "if that disk is full, point RAYTRAIN_TMPDIR at" in said, said  # a hint, not a diagnosis


def test_a_whole_save_whose_report_was_skipped_leaves_no_staging(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    write = sharded._Write(future=Future(), staging=str(staging), started=0.0)
    sharded._WriteThenCopy(lambda _: None, write, _Storage(tmp_path / "run")).abandon()
    assert write.future.done() and write.copied.is_set() and not staging.exists()


@pytest.mark.parametrize("outcome", ["reported", "skipped", "raised"])
def test_a_staged_checkpoint_is_dropped_only_when_its_report_does_not_go_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    """Every staged checkpoint (a whole save's, the last sharded save's) is reported by ``_report_staged``:
    a report Ray Train skips (a worker failed meanwhile; its count of reports does not move) or one that
    raises drops what was staged, once; one that goes through leaves it to Ray's upload. Ray Train's report
    and its count are stood in for: the skip happens inside Ray Train's barrier."""
    import ray.train

    from raytrain import ray_internals

    made = [3]
    seen: list[dict[str, Any]] = []

    def report(metrics: dict[str, Any], **how: Any) -> None:
        seen.append(how)
        if outcome == "raised":
            raise RuntimeError("the controller is gone")
        made[0] += outcome == "reported"

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(ray_internals, "reports_made", lambda: made[0])
    staging = tmp_path / "staging"
    staging.mkdir()
    dropped: list[str] = []
    drop = functools.partial(dropped.append, "dropped")
    if outcome == "raised":
        with pytest.raises(RuntimeError, match="controller is gone"):
            sharded._report_staged(str(staging), {"loss": 1.0}, "epoch_1", drop, checkpoint_upload_fn=print)
    else:
        went = sharded._report_staged(str(staging), {"loss": 1.0}, "epoch_1", drop, checkpoint_upload_fn=print)
        assert went is (outcome == "reported")
    assert dropped == ([] if outcome == "reported" else ["dropped"])
    (how,) = seen
    assert how["checkpoint"].path == str(staging) and how["checkpoint_dir_name"] == "epoch_1"
    assert how["delete_local_checkpoint_after_upload"] is True and how["checkpoint_upload_fn"] is print


def test_the_host_copy_of_a_state_is_its_own_and_loads_as_the_state_did() -> None:
    import collections

    import torch

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    Pair = collections.namedtuple("Pair", "a b")
    tied = torch.ones(3)
    extra = collections.defaultdict(list, {"tied": [tied.detach(), tied.detach()], "array": np.arange(3)})
    state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "pair": Pair(torch.ones(2), [1, 2])}
    state["extra"] = extra
    copy = sharded.host_copy(state)
    tied.add_(1)
    extra["array"] += 1
    # Two tensors of one memory (tied weights, as a state dict names them) share one copy.
    assert copy["extra"]["tied"][0] is copy["extra"]["tied"][1] and torch.equal(copy["extra"]["tied"][0], torch.ones(3))
    assert copy["extra"].default_factory is list and copy["extra"]["array"].tolist() == [0, 1, 2]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    for buffer in optimizer.state.values():
        buffer["momentum_buffer"].mul_(0)
    assert all(torch.equal(copy["model"][k], v) for k, v in before.items())
    assert all(s["momentum_buffer"].abs().sum() > 0 for s in copy["optimizer"]["state"].values())
    assert copy["model"]._metadata == state["model"]._metadata  # each module's version, for load_state_dict
    assert isinstance(copy["pair"], Pair) and copy["pair"].b == [1, 2] and copy["pair"].b is not state["pair"].b
    net.load_state_dict(copy["model"])
    optimizer.load_state_dict(copy["optimizer"])
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
