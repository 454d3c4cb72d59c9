"""The run lock: a live holder keeps a run; a holder that is gone (its process, its Slurm job, its host) is taken
over with a message, so a resubmitted job goes on with its run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain.contracts.rundir import LOCK
from raytrain.errors import UserError
from raytrain.service import runs
from raytrain.service.config import RunConfig

HOST = socket.gethostname()


def begun(tmp_path: Path) -> runs.RunDir:
    storage = runs.Storage.open(str(tmp_path / "runs"))
    run = runs.open_run(storage, RunConfig(storage=storage.uri, name="r"), experiment={}, intact=lambda fs, p: True)
    runs.begin(run, experiment={}, settings={}, workers=1)
    return run


def lock_of(run: runs.RunDir, **owner: object) -> Path:
    path = Path(run.path) / LOCK
    path.write_text(json.dumps({"since": "20261122T000000Z", **owner}))
    return path


def test_a_new_run_directory_is_private(tmp_path: Path) -> None:
    assert Path(begun(tmp_path).path).stat().st_mode & 0o777 == 0o700


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path: Path) -> None:
    run = begun(tmp_path)
    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        ).stdout
    )
    lock = lock_of(run, host=HOST, pid=dead, slurm_job=None)
    said: list[str] = []
    with runs.locked(run, said.append):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert said == [f"run: taking over the lock of pid {dead} on {HOST}: pid {dead} is no longer running on {HOST}"]
    assert not lock.exists()


def test_a_live_holder_keeps_the_run(tmp_path: Path) -> None:
    run = begun(tmp_path)
    lock = lock_of(run, host=HOST, pid=os.getpid(), slurm_job=None)
    with pytest.raises(UserError, match=rf"run 'r' is in use by pid {os.getpid()} on {HOST}"), runs.locked(run, print):
        pass
    assert lock.exists()


def test_a_holder_elsewhere_is_gone_once_its_slurm_job_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"  # what Slurm's squeue prints for --format='%A %i': job 78 runs, 77 has ended
    squeue.write_text("#!/bin/sh\necho '78 78'\necho '80 79_1'\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert runs._gone({"host": "node9", "pid": 5, "slurm_job": "77"}, 1.0) == "its Slurm job 77 has ended"
    assert runs._gone({"host": "node9", "pid": 5, "slurm_job": "78"}, 1.0) is None
    assert runs._gone({"host": "node9", "pid": 5, "slurm_job": "79_1"}, 1.0) is None
    assert runs._gone({"host": "node9", "pid": 5, "slurm_job": None}, 1.0) is None  # refreshed 1 s ago: running
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    assert runs._gone({"host": "node9", "pid": 5, "slurm_job": "77"}, 1.0) is None  # squeue cannot say: running


def test_a_holder_on_another_host_that_stopped_refreshing_its_lock_is_gone(tmp_path: Path) -> None:
    """Outside Slurm, a holder on a host that died cannot be asked: its lock's mtime, which a live driver
    refreshes, says it."""
    run = begun(tmp_path)
    lock = lock_of(run, host="node9", pid=5, slurm_job=None)
    with pytest.raises(UserError, match=r"run 'r' is in use by pid 5 on node9"), runs.locked(run, print):
        pass  # refreshed just now: it may still run
    stale = lock.stat().st_mtime - runs.LOCK_STALE_S - 60
    os.utime(lock, (stale, stale))
    said: list[str] = []
    with runs.locked(run, said.append):
        pass
    assert said == [
        "run: taking over the lock of pid 5 on node9: it has not refreshed the lock for 11 min (a live driver "
        "does every 30 s): its host is down or cut off"
    ]


def test_a_held_lock_is_refreshed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = begun(tmp_path)
    monkeypatch.setattr(runs, "LOCK_HEARTBEAT_S", 0.01)
    lock = Path(run.path) / LOCK
    with runs.locked(run, print):
        old = lock.stat().st_mtime - 100
        os.utime(lock, (old, old))
        deadline = time.monotonic() + 10
        while lock.stat().st_mtime == old and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for the refresh, with a deadline
        assert lock.stat().st_mtime > old


def test_storage_some_node_cannot_see_is_refused(tmp_path: Path) -> None:
    storage = runs.Storage.open(str(tmp_path / "runs"))
    probes: list[str] = []

    def missing_on_node3(path: str) -> list[str]:
        probes.append(path)
        assert Path(path).is_file()  # written before the nodes look for it
        return ["node3"]

    with pytest.raises(UserError, match=r"is not on storage every node sees \(node3 cannot see it; node-local\?\)"):
        runs.check_shared(storage, missing_on_node3)
    assert probes and not Path(probes[0]).exists()  # the probe is removed
    runs.check_shared(storage, lambda path: [])  # every node sees it


def test_a_resume_with_another_worker_count_says_the_global_batch_changes(tmp_path: Path) -> None:
    storage = runs.Storage.open(str(tmp_path / "runs"))

    def reopened() -> runs.RunDir:
        return runs.open_run(storage, RunConfig(storage=storage.uri, name="r"), experiment={}, intact=lambda f, p: True)

    first = reopened()
    assert first.workers_note(2) is None  # a new run
    runs.begin(first, experiment={}, settings={}, workers=2)
    second = reopened()
    assert second.workers == 2 and second.workers_note(2) is None
    note = second.workers_note(4)
    assert note is not None and "trained with 2 workers and goes on with 4: the global batch" in note and "2x" in note
    runs.begin(second, experiment={}, settings={}, workers=4)
    assert reopened().workers_note(4) is None  # said once: the run now trains with 4
