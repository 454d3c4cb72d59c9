"""The run directory: one driver per run (its lock: a live holder is never taken over, a gone one is taken
over atomically, a holder that lost its lock notices), and what the directory records."""

from __future__ import annotations

import json
import multiprocessing
import os
import posixpath
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from raytrain import waits
from raytrain.contracts.rundir import LOCK, LOCK_CLAIM_PREFIX
from raytrain.errors import UserError
from raytrain.service import checkpoint_index, runlock, runs
from raytrain.service.config import RunConfig

HOST = socket.gethostname()


def opened(tmp_path: Path) -> runs.RunDir:
    storage = runs.Storage.open(str(tmp_path / "runs"))
    return runs.open_run(storage, RunConfig(storage=storage.uri, name="r"), experiment={}, intact=lambda fs, p: True)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[runs.RunDir]:
    """A run that has been started once, and is not locked."""
    first = opened(tmp_path)
    with runs.claimed(first, experiment={}, settings={}, workers=1, echo=print):
        pass
    yield opened(tmp_path)


def dead_pid() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(out.stdout)


def holder(**kw: object) -> runlock.Holder:
    """A holder as another driver would have written it (``kw`` overrides)."""
    me = runlock.Holder.me()
    fields = {**me.__dict__, "nonce": os.urandom(8).hex(), **kw}
    return runlock.Holder(**fields)  # type: ignore[arg-type]


def plant(run: runs.RunDir, who: runlock.Holder) -> Path:
    path = Path(run.path) / LOCK
    path.write_bytes(who.to_bytes())
    return path


def slurm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, job: str, restart: int, listed: str = "") -> None:
    """This process inside attempt RESTART of Slurm job JOB; squeue lists the jobs in LISTED (keys, spaces
    between), as ``squeue --jobs=KEY --format=%T`` answers for one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "squeue").write_text(
        f'#!/bin/sh\nfor a in "$@"; do case "$a" in --jobs=*) key="${{a#--jobs=}}";; esac; done\n'
        f'case " {listed} " in *" $key "*) echo RUNNING;; esac\n'
    )
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "c1")


def take(run: runs.RunDir) -> tuple[runlock.Lock, list[str]]:
    said: list[str] = []
    return runlock.acquire(Path(run.path), run.name, said.append), said


def test_a_new_run_directory_is_private(run: runs.RunDir) -> None:
    assert Path(run.path).stat().st_mode & 0o777 == 0o700


def test_a_lock_whose_process_is_gone_is_taken_over(run: runs.RunDir) -> None:
    dead = dead_pid()
    lock = plant(run, holder(pid=dead))
    mine, said = take(run)
    assert runlock.read(lock).nonce == mine.holder.nonce and runlock.read(lock).pid == os.getpid()
    assert said == [f"run: taking over the lock of pid {dead} on {HOST} (job -, since {mine.holder.since}): "
                    f"pid {dead} is no longer running on {HOST}"]  # fmt: skip
    mine.release()
    assert not lock.exists()


def test_a_later_process_that_reuses_the_pid_is_not_the_holder(run: runs.RunDir) -> None:
    """The holder's pid runs again, as another process (pid reuse): its start time tells them apart."""
    started = psutil.Process().create_time()
    plant(run, holder(pid=os.getpid(), started=started - 3600))
    mine, said = take(run)
    assert said and said[0].endswith(f"pid {os.getpid()} is no longer running on {HOST}")
    mine.release()


def test_a_live_holder_is_never_taken_over_even_of_this_very_job_and_attempt(
    run: runs.RunDir, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two drivers submitted to one serving job carry the same job id and restart count."""
    slurm(monkeypatch, tmp_path, job="41", restart=0, listed="41")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(live.pid).create_time()
        lock = plant(run, holder(pid=live.pid, started=started, slurm_job="41", cluster="c1", restart=0))
        before = lock.read_bytes()
        with pytest.raises(UserError, match=rf"run 'r' is in use by pid {live.pid} on {HOST} \(job 41, "):
            take(run)
        assert lock.read_bytes() == before
        # Elsewhere (the driver on another node of the job), with squeue listing the job: still held.
        plant(run, holder(host="node9", pid=live.pid, slurm_job="41", cluster="c1", restart=0))
        with pytest.raises(UserError, match=r"is in use by pid \d+ on node9"):
            take(run)
    finally:
        live.kill()
        live.wait()


def test_a_requeued_attempt_takes_over_its_own_earlier_attempt(
    run: runs.RunDir, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    slurm(monkeypatch, tmp_path, job="41", restart=1, listed="41")
    plant(run, holder(host="node9", pid=5, slurm_job="41", cluster="c1", restart=0))
    mine, said = take(run)
    assert said[0].endswith("it is attempt 0 of this job, 41, which Slurm ended before it started attempt 1")
    mine.release()
    # The same job id on another cluster (job ids are per cluster) is not this job.
    plant(run, holder(host="node9", pid=5, slurm_job="41", cluster="c2", restart=0))
    with pytest.raises(UserError, match="is in use by pid 5 on node9"):
        take(run)


def test_a_holder_elsewhere_holds_while_squeue_lists_its_job_however_old_its_lock(
    run: runs.RunDir, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A suspended job refreshes nothing, and is listed: its lock is not stale. Once unlisted, it is gone."""
    slurm(monkeypatch, tmp_path, job="90", restart=0, listed="78 79_1")
    lock = plant(run, holder(host="node9", pid=5, slurm_job="78", cluster="c1"))
    old = time.time() - 10 * runlock.STALE_S
    os.utime(lock, (old, old))
    with pytest.raises(UserError, match="is in use by pid 5 on node9 \\(job 78"):
        take(run)
    plant(run, holder(host="node9", pid=5, slurm_job="79_1", cluster="c1"))
    with pytest.raises(UserError, match="in use"):
        take(run)
    plant(run, holder(host="node9", pid=5, slurm_job="77", cluster="c1"))
    mine, said = take(run)
    assert said[0].endswith("its Slurm job 77 has ended")
    mine.release()


def test_without_slurm_a_holder_elsewhere_is_stale_by_the_file_servers_clock(
    run: runs.RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Age is the file server's now (a fresh file's mtime) minus the lock's mtime: this host's clock, here
    made to run an hour fast, plays no part."""
    lock = plant(run, holder(host="node9", pid=5, slurm_job=None))
    real = time.time
    monkeypatch.setattr(runlock.time, "time", lambda: real() + 3600)
    with pytest.raises(UserError, match=r"run 'r' is in use by pid 5 on node9"):
        take(run)  # refreshed just now, by the server's clock
    stale = lock.stat().st_mtime - runlock.STALE_S - 60
    os.utime(lock, (stale, stale))
    mine, said = take(run)
    assert said[0].endswith(
        "it has not refreshed the lock for 11 min (a live driver does every 30 s) and Slurm cannot vouch for it: "
        "its host is down or cut off"
    )
    mine.release()


def _race(run: runs.RunDir, drivers: int) -> tuple[list[runlock.Lock], list[str]]:
    """DRIVERS threads released at once to take the run's lock: the locks won, and the refusals."""
    start = threading.Barrier(drivers)
    won: list[runlock.Lock] = []
    refused: list[str] = []

    def race() -> None:
        start.wait()
        try:
            won.append(take(run)[0])
        except UserError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=race) for _ in range(drivers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, refused


def test_racing_drivers_exactly_one_takes_over_a_gone_holder(run: runs.RunDir) -> None:
    """Threads released at once, many times over: every time exactly one wins; the rest are refused."""
    for _ in range(30):
        plant(run, holder(pid=dead_pid()))
        won, refused = _race(run, 6)
        assert len(won) == 1 and len(refused) == 5, (won, refused)
        assert runlock.read(Path(run.path) / LOCK).nonce == won[0].holder.nonce
        won[0].release()


def _race_in_a_process(path: str, go: object, out: object) -> None:
    go.wait()  # type: ignore[attr-defined]
    try:
        lock = runlock.acquire(Path(path), "r", lambda line: None)
        out.put(("won", lock.holder.nonce))  # type: ignore[attr-defined]
        time.sleep(1)  # hold it while the others look
        lock.release()
    except UserError as exc:
        out.put(("refused", str(exc)))  # type: ignore[attr-defined]


def test_racing_driver_processes_exactly_one_takes_over(run: runs.RunDir) -> None:
    plant(run, holder(pid=dead_pid()))
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race_in_a_process, args=(run.path, go, out)) for _ in range(4)]
    for p in procs:
        p.start()
    go.set()
    outcomes = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert sorted(kind for kind, _ in outcomes) == ["refused", "refused", "refused", "won"], outcomes
    assert all("in use by" in msg or "just taken over" in msg for kind, msg in outcomes if kind == "refused")


def test_a_claim_whose_maker_died_half_way_is_taken_over_in_turn(run: runs.RunDir) -> None:
    """A driver that claimed a gone holder and died before it replaced the lock: followed, and taken over."""
    first = plant(run, holder(pid=dead_pid()))
    claimer = holder(pid=dead_pid())
    (Path(run.path) / f"{LOCK_CLAIM_PREFIX}{runlock.read(first).nonce}").write_bytes(claimer.to_bytes())
    mine, said = take(run)
    assert f"the lock of pid {claimer.pid} " in said[0]
    mine.release()


def test_a_driver_that_lost_its_lock_notices_and_never_removes_the_others(run: runs.RunDir) -> None:
    mine, _ = take(run)
    guard = mine.guard()
    guard.check()  # held: no error
    other = holder(pid=os.getpid(), host="node9")
    (Path(run.path) / LOCK).write_bytes(other.to_bytes())  # taken over (wrongly, say by hand)
    with pytest.raises(runlock.LockLost, match=r"run 'r' was taken over by pid \d+ on node9 .* stopped without"):
        guard.check()
    with pytest.raises(UserError):  # in the driver, the same is a one-line user error
        mine.check()
    mine.release()
    assert runlock.read(Path(run.path) / LOCK).nonce == other.nonce  # not ours: left alone
    (Path(run.path) / LOCK).unlink()
    with pytest.raises(runlock.LockLost, match="lost its lock while this driver trained"):
        guard.check()


def test_the_heartbeat_refreshes_the_lock_and_stops_once_it_is_lost(
    run: runs.RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.01)
    lock_file = Path(run.path) / LOCK
    with runlock.held(Path(run.path), "r", print) as mine:
        old = lock_file.stat().st_mtime - 100
        os.utime(lock_file, (old, old))
        assert waits.until(lambda: lock_file.stat().st_mtime > old, timeout_s=10, every_s=0.01)
        lock_file.write_bytes(holder(host="node9").to_bytes())
        assert waits.until(lambda: mine.lost, timeout_s=10, every_s=0.01) is not None
        old = lock_file.stat().st_mtime - 100
        os.utime(lock_file, (old, old))
        time.sleep(0.1)  # ten heartbeats: none may touch another's lock
        assert lock_file.stat().st_mtime == old


def test_nothing_in_the_run_is_written_before_its_lock_is_held(run: runs.RunDir) -> None:
    """A driver that checked the run (free) and then finds it taken writes nothing: not the index it
    settled on, not the experiment."""
    index = Path(run.path) / checkpoint_index.ray_internals.CHECKPOINT_SNAPSHOT
    index.write_text("{ damaged")  # settling would move it aside and write a new one
    meta = Path(run.path) / "raytrain_run.json"
    before = {p.name: p.read_bytes() for p in Path(run.path).iterdir()}
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        plant(run, holder(pid=live.pid, started=psutil.Process(live.pid).create_time()))
        with (
            pytest.raises(UserError, match="in use"),
            runs.claimed(run, experiment={}, settings={}, workers=3, echo=print),
        ):
            pass
    finally:
        live.kill()
        live.wait()
    after = {p.name: p.read_bytes() for p in Path(run.path).iterdir() if p.name != LOCK}
    assert after == {k: v for k, v in before.items() if k != LOCK} and json.loads(meta.read_text())["workers"] == 1


def test_a_legacy_lock_without_a_nonce_is_taken_over_once(run: runs.RunDir) -> None:
    lock = Path(run.path) / LOCK
    lock.write_text(json.dumps({"host": HOST, "pid": dead_pid(), "slurm_job": None, "since": "20261122T000000Z"}))
    mine, said = take(run)
    assert said and "is no longer running" in said[0]
    mine.release()


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

    def begin(run: runs.RunDir, workers: int) -> None:
        with runs.claimed(run, experiment={}, settings={}, workers=workers, echo=print):
            pass

    first = reopened()
    assert first.workers_note(2) is None  # a new run
    begin(first, 2)
    second = reopened()
    assert second.workers == 2 and second.workers_note(2) is None
    note = second.workers_note(4)
    assert note is not None and "trained with 2 workers and goes on with 4: the global batch" in note and "2x" in note
    begin(second, 4)
    assert reopened().workers_note(4) is None  # said once: the run now trains with 4


def reopen(tmp_path: Path, **cfg: object) -> runs.RunDir:
    storage = runs.Storage.open(str(tmp_path / "runs"))
    config = RunConfig(storage=storage.uri, name="r", **cfg)  # type: ignore[arg-type]
    return runs.open_run(storage, config, experiment={}, intact=lambda fs, p: True)


def test_a_run_directory_others_can_write_or_that_is_a_link_is_refused(run: runs.RunDir, tmp_path: Path) -> None:
    path = Path(run.path)
    os.chmod(path, 0o777)  # opened to all (chmod -R a+rwX): anyone may have planted checkpoints
    with pytest.raises(UserError, match=r"run directory .*/r is writable by other users \(mode 777\): pick another"):
        reopen(tmp_path)
    os.chmod(path, 0o770)
    with pytest.raises(UserError, match=r"is writable by other users \(mode 770\).*--share-group shares a run"):
        reopen(tmp_path)
    os.chmod(path, 0o755)  # readable by others is their business; writable is not
    assert reopen(tmp_path).existed
    path.rename(tmp_path / "real")
    path.symlink_to(tmp_path / "real")
    with pytest.raises(UserError, match="is a symbolic link"):
        reopen(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root")
def test_another_users_run_is_refused_unless_shared_with_a_group_of_yours(run: runs.RunDir, tmp_path: Path) -> None:
    path = Path(run.path)
    os.chown(path, 4242, 4242)
    with pytest.raises(UserError, match=r"belongs to uid 4242, not to you: pick another --name or --storage"):
        reopen(tmp_path)
    os.chown(path, 4242, 0)  # the group root is in, shared with it
    os.chmod(path, 0o2770)
    assert reopen(tmp_path, share_group="root").group == 0
    with pytest.raises(UserError, match="belongs to uid 4242"):
        reopen(tmp_path)  # without --share-group it is still not yours
    with pytest.raises(UserError, match="--share-group nosuchgroup: no such group"):
        RunConfig(storage="x", name="r", share_group="nosuchgroup")


def test_a_new_shared_run_is_made_for_its_group(tmp_path: Path) -> None:
    shared = reopen(tmp_path, share_group=grp_of_mine())
    with runs.claimed(shared, experiment={}, settings={}, workers=1, echo=print):
        pass
    st = Path(shared.path).stat()
    assert st.st_mode & 0o7777 == 0o2770 and st.st_gid == shared.group


def grp_of_mine() -> str:
    import grp

    return grp.getgrgid(os.getgid()).gr_name


def test_an_index_that_names_a_checkpoint_outside_the_run_is_refused(run: runs.RunDir, tmp_path: Path) -> None:
    """Planted by someone who could write the run: it must not make a resume load another run's weights."""
    from raytrain import ray_internals

    elsewhere = tmp_path / "alice" / "epoch_0009"
    elsewhere.mkdir(parents=True)
    planted = ray_internals.write_checkpoint_snapshot([ray_internals.Registered("../../alice/epoch_0009", {}, 0)], 1)
    index = Path(run.path) / ray_internals.CHECKPOINT_SNAPSHOT
    index.write_bytes(planted)
    with pytest.raises(UserError, match=r"index .* is not the run's own: it names '../../alice/epoch_0009'"):
        reopen(tmp_path)
    assert index.read_bytes() == planted  # nothing rewritten on a guess


def test_another_users_holder_is_judged_by_slurm_not_by_a_pid_this_user_may_not_see(
    run: runs.RunDir, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run shared with a group: another member's driver on this host, whose pid this user may not see
    (/proc mounted hidepid), holds it while Slurm lists its job, whoever's job that is."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "squeue-says"
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {state}\n")  # squeue -j <job> --format=%T
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    state.write_text("RUNNING\n")
    plant(run, holder(pid=dead_pid(), uid=4242, slurm_job="55", cluster=None))
    with pytest.raises(UserError, match=r"is in use by pid \d+ on .* \(job 55,"):
        take(run)
    state.write_text("")  # squeue lists it no more
    mine, said = take(run)
    assert said[0].endswith("its Slurm job 55 has ended")
    mine.release()


def test_a_take_over_never_replaces_a_lock_other_than_the_one_it_judged_gone(
    run: runs.RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock judged gone is replaced meanwhile (a --fresh moved the run aside, and a new driver made a new
    lock): the claim succeeds, the replacement must not."""
    plant(run, holder(pid=dead_pid()))
    judge = runlock.gone
    newcomer = holder(pid=os.getpid(), host="node9")

    def gone_then_replaced(*args: object) -> str | None:
        why = judge(*args)  # type: ignore[arg-type]
        (Path(run.path) / LOCK).write_bytes(newcomer.to_bytes())
        return why

    monkeypatch.setattr(runlock, "gone", gone_then_replaced)
    with pytest.raises(UserError, match="was just taken over by another driver"):
        take(run)
    assert runlock.read(Path(run.path) / LOCK).nonce == newcomer.nonce


def test_a_transient_error_reading_the_lock_is_tried_again(run: runs.RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from raytrain import fsio

    monkeypatch.setattr(fsio, "BACKOFF_S", (0.01, 0.01, 0.01))
    mine, _ = take(run)
    real, failures = Path.read_bytes, [2]

    def flaky(self: Path) -> bytes:
        if self.name == LOCK and failures[0] > 0:
            failures[0] -= 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", flaky)
    mine.guard().check()  # held: the stale handle was a moment's
    assert failures == [0] and mine.still_held()
    mine.release()


def test_an_unreadable_lock_is_a_holder_for_a_moment_then_gone(run: runs.RunDir) -> None:
    """A lock file that does not parse (a crash between create and write, in an older raytrain) is judged
    the same by the read-only check and the take-over: in use while fresh, gone once old."""
    lock = Path(run.path) / LOCK
    lock.write_text("{")
    with pytest.raises(UserError, match="in use by pid 0"):
        runlock.check_free(Path(run.path), "r")
    with pytest.raises(UserError, match="in use by pid 0"):
        take(run)
    old = lock.stat().st_mtime - 60
    os.utime(lock, (old, old))
    assert runlock.check_free(Path(run.path), "r") is not None
    mine, said = take(run)
    assert "its lock file does not parse" in said[0]
    mine.release()


@pytest.mark.parametrize("renames", [True, False])
def test_fresh_moves_the_old_run_aside_on_storage_without_a_lock_or_refuses_to_touch_it(
    tmp_path: Path, renames: bool
) -> None:
    """On storage that is not a local filesystem (an object store: no lock), ``--fresh`` still moves the old
    run aside whole before the new one writes anything; where the storage cannot move a directory, it says
    so in one line and leaves the old run as it was."""
    import fsspec
    import pyarrow as pa
    import pyarrow.fs as pafs

    class NoRenames(pafs.FSSpecHandler):  # as object stores without a rename of directories answer
        def move(self, src: str, dest: str) -> None:
            if self.fs.isdir(src):
                raise pa.ArrowNotImplementedError("This filesystem does not support moving directories")
            super().move(src, dest)

    if renames:
        storage = runs.Storage.open("mock:///runs")
    else:
        memory = fsspec.filesystem("memory")
        root = f"/{tmp_path.name}/runs"  # fsspec's memory filesystem is one per process
        memory.makedirs(root, exist_ok=True)
        storage = runs.Storage(uri=f"memory://{root}", fs=pafs.PyFileSystem(NoRenames(memory)), root=root)
    fs = storage.fs
    assert not isinstance(fs, pafs.LocalFileSystem)

    def opened(fresh: bool) -> runs.RunDir:
        config = RunConfig(storage=storage.uri, name="r", fresh=fresh)
        return runs.open_run(storage, config, experiment={"lr": 1}, intact=lambda fs, p: True)

    with runs.claimed(opened(False), experiment={"lr": 1}, settings={}, workers=1, echo=print) as (old, lock):
        assert lock is None
        fs.create_dir(posixpath.join(old.path, "epoch_0005"))
        with fs.open_output_stream(posixpath.join(old.path, "epoch_0005", "state.pt")) as out:
            out.write(b"the old run's")

    def listed() -> list[str]:
        return sorted(i.path for i in fs.get_file_info(pafs.FileSelector(storage.root, recursive=True)))

    kept = listed()
    fresh = opened(True)
    assert fresh.moved_aside and not fresh.existed
    if not renames:
        refused = r"^--fresh: run 'r' could not be moved aside to .*: pick another --name"
        with (
            pytest.raises(UserError, match=refused),
            runs.claimed(fresh, experiment={"lr": 1}, settings={}, workers=1, echo=print),
        ):
            pass
        assert listed() == kept
        return
    with runs.claimed(fresh, experiment={"lr": 1}, settings={}, workers=1, echo=print) as (new, _):
        assert new.resume.latest is None
    with fs.open_input_stream(posixpath.join(fresh.moved_aside, "epoch_0005", "state.pt")) as f:
        assert f.read() == b"the old run's"
    assert fs.get_file_info(posixpath.join(fresh.path, "epoch_0005")).type == pafs.FileType.NotFound


def test_fresh_on_an_object_store_is_refused_before_anything_starts() -> None:
    """Arrow's S3 and GCS filesystems move one object, never a directory: ``--fresh`` there says so at once,
    before the cluster starts, instead of failing on the move once it has."""
    import pyarrow.fs as pafs

    for fs in (pafs.S3FileSystem(anonymous=True, region="us-east-1"), pafs.GcsFileSystem(anonymous=True)):
        with pytest.raises(UserError, match=r"^--fresh: run 'r' cannot be moved aside on this storage \(\w+ renames"):
            runs.refuse_move(fs, "bucket/runs/r", "--fresh: run 'r'")
    runs.refuse_move(runs.Storage.open("mock:///runs").fs, "runs/r", "--fresh: run 'r'")  # moves directories
