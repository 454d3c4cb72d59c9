"""The batch script's Python helpers: port blocks, addresses, object store sizing (real sockets, locks)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import zlib
from pathlib import Path

import pytest

from raytrain import processes, slurm_env, waits
from raytrain.contracts import env
from raytrain.errors import UserError
from raytrain.launch import netinfo, node, ports

# Below Linux's default ephemeral range (32768-60999), where the kernel never hands a port out by chance.
BLOCK = {"base": 31000, "size": 40, "count": 3}


@pytest.fixture(autouse=True)
def own_names(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Socket names of this test's own: another run of the suite on the host, or a test before, holds none."""
    test = zlib.crc32(request.node.nodeid.encode())  # a socket name has at most 107 bytes
    monkeypatch.setattr(ports, "NAME_PREFIX", f"raytrain-ports-test-{os.getpid()}-{test:08x}-")


def claimed(held: contextlib.ExitStack, job: str, lock_dir: Path | None) -> ports.PortBlock:
    """A block claimed for JOB, its locks released when HELD closes (a failing test leaks none)."""
    block, hold = ports.claim(job, lock_dir=lock_dir, **BLOCK)
    held.callback(hold.release)
    return block


def test_two_jobs_on_a_node_get_different_blocks(tmp_path: Path) -> None:
    with contextlib.ExitStack() as held:
        a = claimed(held, "job-1", tmp_path)
        b = claimed(held, "job-1", tmp_path)  # same hash start, first block is held
        assert a.index != b.index
        assert set(a.fixed_ports()).isdisjoint(b.fixed_ports())
        assert a.worker_range[1] < b.base or b.worker_range[1] < a.base
    with contextlib.ExitStack() as held:
        assert claimed(held, "job-1", tmp_path).index == a.index  # released: the first block is free again


def test_two_users_jobs_starting_at_once_on_a_node_get_different_blocks(tmp_path: Path) -> None:
    """Two users' jobs whose ids hash to the same first block start on a node at the same moment: neither
    sees the other's lock file, and nothing binds the block's ports yet (Ray takes seconds to start). The
    block's socket name, which any user's process in the node's network namespace contends for, still
    parts them; and a third job that sees no lock directory at all (its name taken by another user)."""
    (tmp_path / "alice").mkdir()
    (tmp_path / "bob").mkdir()
    with contextlib.ExitStack() as held:
        blocks = [claimed(held, "job-4", where) for where in (tmp_path / "alice", tmp_path / "bob", None)]
        assert len({b.index for b in blocks}) == 3


def test_a_node_that_forbids_socket_names_claims_by_lock_and_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(block: ports.PortBlock) -> int | None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(ports, "_netns_lock", forbidden)
    with contextlib.ExitStack() as held:
        a, hold = ports.claim("job-5", lock_dir=tmp_path, **BLOCK)
        held.callback(hold.release)
        assert len(hold.fds) == 1  # the lock file alone
        assert claimed(held, "job-5", tmp_path).index != a.index


def test_a_block_with_a_busy_port_is_skipped(tmp_path: Path) -> None:
    with contextlib.ExitStack() as held:
        first = claimed(held, "job-2", tmp_path)
    with socket.socket() as s, contextlib.ExitStack() as held:
        s.bind(("0.0.0.0", first.port("gcs")))
        s.listen()
        assert claimed(held, "job-2", tmp_path).index != first.index


@pytest.mark.parametrize("where", ["worker", "torch"])
def test_a_block_another_users_job_uses_anywhere_in_its_range_is_skipped(tmp_path: Path, where: str) -> None:
    """A job that holds its block by locks this user cannot see (one from before the socket name, a
    layout of other sizes), and whose named ports may all be free a moment (its head elsewhere): a port in
    use anywhere in the block (a Ray worker's, torch's rendezvous) keeps the block out."""
    with contextlib.ExitStack() as held:
        first = claimed(held, "job-3", tmp_path)
    port = first.worker_range[1] if where == "worker" else first.torch_range[0]
    (tmp_path / "another-users-locks").mkdir()
    with socket.socket() as s, contextlib.ExitStack() as held:
        s.bind(("0.0.0.0", port))
        s.listen()
        assert claimed(held, "job-3", tmp_path / "another-users-locks").index != first.index


def test_no_free_block_says_what_to_do(tmp_path: Path) -> None:
    with contextlib.ExitStack() as held:
        for _ in range(BLOCK["count"]):
            claimed(held, "j", tmp_path)
        with pytest.raises(UserError, match="set RAYTRAIN_PORT_BASE") as mine:
            ports.claim("j", lock_dir=tmp_path, **BLOCK)
        assert "socket names" not in str(mine.value)  # this user's own jobs hold them
        # Another user's: only the names tell, and the error says which to look for.
        (tmp_path / "another-users-locks").mkdir()
        with pytest.raises(UserError, match=r"3 of them because their socket names are held \(`ss -xlp"):
            ports.claim("j", lock_dir=tmp_path / "another-users-locks", **BLOCK)


def test_a_layout_reaching_into_the_ephemeral_range_is_refused() -> None:
    linux = (32768, 60999)
    ports.check_layout(20000, 500, 25, ephemeral=linux)  # the default: up to 32499
    ports.check_layout(61000, 500, 9, ephemeral=linux)  # above the range
    with pytest.raises(
        UserError, match=r"ephemeral range 32768-60999 .* at 32768, .* set RAYTRAIN_PORT_BLOCKS=25 \(at"
    ):
        ports.check_layout(20000, 500, 26, ephemeral=linux)
    # Each setting it offers passes, and none is one the settings themselves refuse (a base below 1024).
    for site, (base, count) in {linux: (40000, 4), (10000, 65535): (20000, 25), (2000, 60000): (1024, 25)}.items():
        with pytest.raises(UserError) as refused:
            ports.check_layout(base, 500, count, ephemeral=site)
        offered = re.findall(r"RAYTRAIN_PORT_BASE=(\d+) RAYTRAIN_PORT_BLOCKS=(\d+)", str(refused.value))
        assert offered, str(refused.value)
        for offered_base, offered_count in offered:
            assert (
                int(offered_base) >= 1024
                and ports.check_layout(int(offered_base), 500, int(offered_count), site) is None
            )
    # A site that hands out every port leaves no layout outside the range: a warning, and the job goes on.
    warning = ports.check_layout(20000, 500, 25, ephemeral=(1024, 65535))
    assert warning and "leaves no room for a port block outside it" in warning


def test_block_layout_keeps_named_ports_and_ranges_apart() -> None:
    block = ports.PortBlock(index=2, base=21000, size=500)
    fixed = block.fixed_ports()
    assert len(set(fixed)) == len(fixed) == 12  # Ray's 11, and the job's Prometheus
    assert max(fixed) < block.torch_range[0] <= block.torch_range[1] < block.worker_range[0]
    assert block.worker_range == (21020, 21499)


def test_addresses() -> None:
    assert netinfo.route_source("127.0.0.1") == "127.0.0.1"
    assert netinfo.iface_of("127.0.0.1") == "lo"
    assert netinfo.ip_of("lo") == "127.0.0.1"
    with pytest.raises(UserError, match="RAYTRAIN_IFNAME=nosuch0 has no IPv4 address"):
        netinfo.ip_of("nosuch0")
    assert netinfo.head_address("anything", ifname=None, override="10.1.2.3") == "10.1.2.3"


def test_object_store_fits_shm_and_slurm_memory() -> None:
    job = slurm_env.current({"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": "1000"})
    assert node.object_store_bytes(job) == int(1000 * 1024**2 * 0.3)
    import shutil

    huge = slurm_env.current({"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": str(10**9)})
    assert node.object_store_bytes(huge) <= int(shutil.disk_usage("/dev/shm").free * 0.9) + 1


def test_slurm_counts_parse() -> None:
    env = {"SLURM_JOB_ID": "9", "SLURM_CPUS_ON_NODE": "4(x3)", "SLURM_GPUS_ON_NODE": "gpu:a100:2"}
    env |= {"SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "2"}
    job = slurm_env.current(env)
    assert job is not None
    assert (job.cpus_on_node, job.gpus_on_node, job.key, job.restart_count) == (4, 2, "8_3", 2)
    assert slurm_env.current({}) is None


def launch(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "raytrain.launch", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def setup_env(state: Path, job: str = "42", **more: str) -> dict[str, str]:
    """What `launch setup` sees inside a Slurm job: its id, the state and log roots."""
    return {"SLURM_JOB_ID": job, "RAYTRAIN_STATE_DIR": str(state), "RAYTRAIN_LOG_DIR": str(state / "logs"), **more}


def test_setup_makes_a_private_fresh_token_and_the_log_dir(tmp_path: Path) -> None:
    env = setup_env(tmp_path / "jobs", SLURM_RESTART_COUNT="2")
    proc = launch("setup", env=env)
    assert proc.returncode == 0, proc.stderr
    job = tmp_path / "jobs" / "42"
    lines = [str(job), str(tmp_path / "jobs/logs/42/attempt-2"), "75", "76", slurm_env.node_name()]  # no node list
    assert proc.stdout.splitlines() == lines
    assert (tmp_path / "jobs/logs/42/attempt-2").is_dir()
    assert (tmp_path / "jobs/logs/42").stat().st_mode & 0o777 == 0o700
    first = (job / "token").read_text()
    assert job.stat().st_mode & 0o777 == 0o700 and (job / "token").stat().st_mode & 0o777 == 0o600
    assert len(first) == 64 and int(first, 16) >= 0
    assert launch("setup", env=env).returncode == 0  # a requeued attempt gets a new token
    assert (job / "token").read_text() != first


@pytest.mark.parametrize("where", ["unwritable", "not-private"])
def test_setup_fails_closed(tmp_path: Path, where: str) -> None:
    if where == "unwritable":
        state, job = Path("/proc/raytrain-no-such"), Path("/proc/raytrain-no-such/7")
    else:
        state, job = tmp_path, tmp_path / "7"
        job.mkdir(mode=0o777)
        os.chmod(job, 0o777)
        os.chown(job, 65534, 65534)  # someone else's directory: it must not hold our token
    proc = launch("setup", env=setup_env(state, "7", RAYTRAIN_LOG_DIR=str(tmp_path / "logs")))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "raytrain: error:" in proc.stderr and "RAYTRAIN_STATE_DIR" in proc.stderr
    assert not (job / "token").exists()


def test_sweep_removes_only_ended_jobs_of_this_cluster(tmp_path: Path) -> None:
    from raytrain.contracts import jobdir
    from raytrain.launch import state_dirs

    def job(name: str, cluster: str | None) -> Path:
        (path := tmp_path / name).mkdir()
        (path / "token").write_text("t")
        if cluster:
            (path / jobdir.CLUSTER_MARK).write_text(cluster + "\n")
        return path

    own, running, ended = job("10", "a"), job("11", "a"), job("12", "a")
    other_cluster, unmarked = job("13", "b"), job("14", None)
    (tmp_path / "15").write_text("not a directory")
    removed = state_dirs.sweep(tmp_path, own="10", cluster="a", live={"10", "11"})
    assert removed == ["12"] and not ended.exists()
    assert all(p.exists() for p in (own, running, other_cluster, unmarked, tmp_path / "15"))
    assert state_dirs.sweep(tmp_path / "missing", own="10", cluster="a", live=set()) == []


def test_setup_marks_the_cluster(tmp_path: Path) -> None:
    # squeue is not needed to mark: the sweep that follows is skipped when it cannot answer
    assert launch("setup", env=setup_env(tmp_path, SLURM_CLUSTER_NAME="c1")).returncode == 0
    assert (tmp_path / "42" / "slurm-cluster").read_text() == "c1\n"


def test_the_drain_deadline_is_the_warnings_lead_or_what_is_left_of_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted from when the signal came (the batch script's trap stamps it), not from when a helper that
    started later asks squeue."""
    from raytrain.launch.preempt import deadline_for

    now = time.time()
    assert deadline_for(None, 300, now - 12) == now - 12 + 280  # the lead, less the margin for teardown
    assert deadline_for(None, 15, now) == now + 10  # never sooner than 10 s after the signal
    left: list[int | None] = [60]
    monkeypatch.setattr(slurm_env, "time_left_s", lambda job_id, timeout_s: left[0])
    assert 39 <= deadline_for("7", 300, now - 12) - now <= 41  # the job ends before the lead is out
    left[0] = 4 * 3600  # an scancel --signal=USR2 long before the end stands for the warning
    assert deadline_for("7", 300, now - 12) == now - 12 + 280
    left[0] = None  # squeue silent or the job unlimited
    assert deadline_for("7", 300, now) == now + 280


def test_dashboard_hint_and_missing_job(tmp_path: Path) -> None:
    import json

    from tests.conftest import assert_user_error, run_cli

    job = tmp_path / "77"
    job.mkdir()
    (job / "cluster.json").write_text(
        json.dumps(
            {"head_node": "gpu17", "dashboard_port": 20502, "token_path": f"{job}/token", "submit_host": "login2"}
        )
    )
    out = run_cli("dashboard", "77", env={"RAYTRAIN_STATE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "ssh -N -L 8265:127.0.0.1:20502 -J " in out.stdout and "@login2 " in out.stdout
    assert out.stdout.rstrip().count("\n") == 3 and f"{job}/token" in out.stdout
    assert_user_error(
        run_cli("dashboard", "78", env={"RAYTRAIN_STATE_DIR": str(tmp_path)}), "no running raytrain cluster for job 78"
    )


def test_preemption_watch_channels_and_pace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.train
    import torch
    from ray.train.v2.api.preemption import PreemptionInfo

    from raytrain.contracts.jobdir import EndRequest
    from raytrain.launch.preempt import write_flag
    from raytrain.service.preemption import CANCEL, FLAG, RAY, YIELD, PreemptionWatch

    drained: list[object] = []
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: drained[0] if drained else None, raising=False)
    flag = tmp_path / "preempt"
    watch = PreemptionWatch(str(flag), rank=0, device=torch.device("cpu"), target_s=3600)
    assert not any(watch.after_step() for _ in range(6))
    assert watch.every == 1000  # steps take microseconds here: check rarely
    ends_at = write_flag(tmp_path, time.time() + 300).read_text()  # what the batch script drops: the deadline
    assert watch.requested() and watch.via == FLAG and watch.deadline == float(ends_at)
    assert 290 < watch.deadline - time.time() < 301
    other = PreemptionWatch(None, rank=1, device=torch.device("cpu"))
    drained.append(PreemptionInfo(deadline_ms=1_800_000_000_500, preempted_node_to_ranks={"n": [1]}))
    assert other.after_step() and other.via == RAY and other.deadline == 1_800_000_000.5
    unknown = PreemptionWatch(str(tmp_path / "empty"), rank=0, device=torch.device("cpu"))
    (tmp_path / "empty").touch()  # a flag from before deadlines, or one Slurm could not date
    drained.clear()
    assert unknown.requested() and unknown.deadline is None
    # A drain that had no deadline, then the flag with one: the deadline is learned at the next check,
    # and the answer stays True between checks.
    later = tmp_path / "later"
    later.mkdir()
    late = PreemptionWatch(str(later / "preempt"), rank=0, device=torch.device("cpu"), target_s=3600)
    drained.append(PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"n": [1]}))
    assert late.requested() and late.via == RAY and late.deadline is None
    write_flag(later, time.time() + 100)
    assert late.requested() and late.via == RAY and late.deadline is not None
    assert 90 < late.deadline - time.time() < 101
    assert all(late.after_step() for _ in range(8))  # past calibration: checks are rare, the answer stays
    # One run asked to end (a run of higher priority needs its room; raytrain cancel): its request, read by
    # rank 0 beside the flag; the job's own end, when both come, is the reason, unless the run was cancelled:
    # a cancelled run ends as one, so that the job's requeue does not resume it.
    drained.clear()
    request = tmp_path / "run.end"
    asked = PreemptionWatch(str(tmp_path / "none"), rank=0, device=torch.device("cpu"), request_path=str(request))
    assert not asked.requested()
    EndRequest(why=YIELD, by="run 'high' (priority high)", deadline=time.time() + 120, at=time.time()).write(
        tmp_path, request.name
    )
    assert asked.requested() and asked.via == YIELD and asked.deadline is not None
    both = PreemptionWatch(str(flag), rank=0, device=torch.device("cpu"), request_path=str(request))
    assert both.requested() and both.via == FLAG
    EndRequest(why=CANCEL, by="alice with raytrain cancel", deadline=time.time() + 60, at=time.time()).write(
        tmp_path, request.name
    )
    cancelled = PreemptionWatch(str(flag), rank=0, device=torch.device("cpu"), request_path=str(request))
    assert cancelled.requested() and cancelled.via == CANCEL


def test_port_locks_are_private_and_cannot_be_planted(tmp_path: Path) -> None:
    locks, why = ports.lock_dir(tmp_path)
    assert locks == tmp_path / f"raytrain-ports-{os.getuid()}" and why is None
    assert locks.stat().st_mode & 0o777 == 0o700
    block, hold = ports.claim("job-9", lock_dir=locks, **BLOCK)
    try:
        assert len(hold.fds) == 2 and (locks / f"block-{block.base}.lock").stat().st_mode & 0o777 == 0o600
    finally:
        hold.release()

    # Another user took the name first: no shared locks then, but blocks are still claimed (by probing).
    other = tmp_path / "other"
    other.mkdir()
    planted = other / f"raytrain-ports-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)
    locks, why = ports.lock_dir(other)
    assert locks is None and why and "is not a private directory of yours (owner uid 65534" in why
    block, hold = ports.claim("job-9", lock_dir=None, **BLOCK)
    try:
        assert len(hold.fds) == 1 and block.index in range(BLOCK["count"])  # the socket name alone
    finally:
        hold.release()


def test_temp_dirs_are_fresh_private_and_unguessable(tmp_path: Path) -> None:
    planted = tmp_path / "rt77.0"  # what another user could create ahead of job 77 under the old fixed name
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    first, second = node.make_temp_dir(tmp_path, "77", 0), node.make_temp_dir(tmp_path, "77", 0)
    assert first != second and first != planted and first.name.startswith("rt77.0.")
    assert first.stat().st_uid == os.getuid() and first.stat().st_mode & 0o777 == 0o700
    with pytest.raises(UserError, match=r"cannot make Ray's temp dir in .* set RAYTRAIN_TMPDIR"):
        node.make_temp_dir(tmp_path / "missing", "77", 0)


def test_the_watcher_lets_an_elastic_run_lose_a_worker_node_but_not_the_head(tmp_path: Path) -> None:
    """Real processes stand in for the Ray steps and the driver; the watcher is the batch script's own."""
    import subprocess
    import sys

    from raytrain.contracts.jobdir import ELASTIC
    from raytrain.contracts.result import EXIT_LOST

    def step() -> subprocess.Popen[bytes]:
        return subprocess.Popen(["sleep", "600"])

    head, worker, driver = step(), step(), step()
    (tmp_path / ELASTIC).write_text("1\n")
    specs = [f"--watch=node1:{head.pid}:{tmp_path}/h.log", f"--watch=node2:{worker.pid}:{tmp_path}/w.log"]
    cmd = [sys.executable, "-m", "raytrain.launch", "watch", "--driver", str(driver.pid), "--job-dir", str(tmp_path)]
    watcher = subprocess.Popen([*cmd, *specs], stderr=subprocess.PIPE, text=True)
    try:
        worker.kill()
        worker.wait()
        assert watcher.stderr is not None
        said = watcher.stderr.readline()
        assert said.startswith("raytrain: Ray on node2 exited; the elastic run goes on with the nodes left; Ray there")
        assert watcher.poll() is None and driver.poll() is None  # still watching; the driver trains on
        head.kill()
        head.wait()
        assert watcher.wait(timeout=30) == EXIT_LOST
        assert "Ray on node1 exited; the cluster is broken" in watcher.stderr.read()
        assert driver.wait(timeout=30) == -15  # stopped with SIGTERM
    finally:
        for p in (head, worker, driver, watcher):
            if p.poll() is None:
                p.kill()


def test_a_node_start_sweeps_the_temp_dirs_of_ended_jobs_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("rt5.0.abc", "rt7_2.1.xyz", "rt9.0.live", "rt11.0.mine", "rt0-localfit", "rt12.0.file"):
        (tmp_path / name).mkdir() if name != "rt12.0.file" else (tmp_path / name).write_text("")
    monkeypatch.setattr(slurm_env, "live_jobs", lambda: {"9", "11"})  # squeue's answer
    assert node.sweep_ended(tmp_path, own="11") == ["5", "7_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rt0-localfit", "rt11.0.mine", "rt12.0.file", "rt9.0.live"]
    monkeypatch.setattr(slurm_env, "live_jobs", lambda: None)  # squeue cannot say: nothing goes
    (tmp_path / "rt5.0.again").mkdir()
    assert node.sweep_ended(tmp_path, own="11") == [] and (tmp_path / "rt5.0.again").is_dir()


@pytest.mark.parametrize(
    ("every", "first", "waits"), [(None, 10.0, [20.0, 30.0, 30.0, 30.0]), ("3", 1.0, [2.0, 3.0, 3.0, 3.0])]
)
def test_a_lost_worker_nodes_ray_starts_again_backing_off_and_is_left_out_after_repeated_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: str | None, first: float, waits: list[float]
) -> None:
    from raytrain.contracts.jobdir import RAY_STEP_PREFIX
    from raytrain.launch import steps
    from raytrain.launch.ready import Watched

    if every is not None:  # RAYTRAIN_REJOIN_EVERY: the longest wait; the first is a third of it
        monkeypatch.setenv(env.REJOIN_EVERY.name, every)
    else:
        monkeypatch.delenv(env.REJOIN_EVERY.name, raising=False)
    clock = [1000.0]
    monkeypatch.setattr(steps.time, "monotonic", lambda: clock[0])
    rejoins = steps.Rejoins(tmp_path, [])
    lost = Watched(node="node3", pid=1, log=str(tmp_path / "worker-node3.log"))
    assert "the run grows back" in (rejoins.lost(lost) or "")  # the batch script's own step: a loss
    node = rejoins.nodes["node3"]
    assert node.due == 1000.0 + first
    seen = []
    for _ in range(4):  # starts that fail at once (the node is down): tried less and less often, quietly
        node.started = clock[0]
        clock[0] += 1
        assert rejoins.lost(lost) is None
        seen.append(node.due - clock[0] if node.due is not None else None)
    assert seen == waits
    for _ in range(steps.MAX_LOSSES - 2):  # Ray that joined, ran, and died again
        node.started = clock[0]
        clock[0] += steps.UP_S
        assert "the run grows back" in (rejoins.lost(lost) or "")
        assert node.due == clock[0] + first  # back to the short wait
    node.started, node.due = clock[0], None
    clock[0] += steps.UP_S
    assert "without node3 from now on" in (rejoins.lost(lost) or "") and node.due is None
    argv = steps.step_argv(
        role="worker", node="node3", job_dir=tmp_path, log_dir=tmp_path, output=Path(lost.log), head="h:1", rejoin=2
    )
    assert argv[0] == "srun" and f"--job-name={RAY_STEP_PREFIX}worker-node3" in argv and "--open-mode=append" in argv
    assert argv[-4:] == ["--head", "h:1", "--rejoin", "2"]


STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def test_a_node_stop_ends_its_group_and_a_worker_that_left_it_within_the_grace(tmp_path: Path) -> None:
    """The supervisor's stop: SIGTERM to the group, the grace, then SIGKILL to whatever ignored it, in the
    group and out of it (found by the node's temp dir); another node's process on the host is untouched."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    import psutil

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    temp_dir = tmp_path / "rt-node"
    script = tmp_path / "ray_start.py"  # stands in for `ray start --block`: its group ignores SIGTERM
    script.write_text(f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {STUBBORN!r}])\n{STUBBORN}\n")
    left_group = subprocess.Popen([sys.executable, "-c", STUBBORN, str(temp_dir)], start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", STUBBORN, str(tmp_path / "another-node")])
    try:
        sup = node.Supervisor(temp_dir, grace_s=0.5)
        runner = threading.Thread(target=sup.run, args=([sys.executable, str(script)], dict(os.environ)))
        runner.start()

        def group() -> list[psutil.Process]:
            return processes.with_descendants(processes.of([sup.proc])) if sup.proc is not None else []

        members = waits.until(lambda: len(group()) == 2 and group(), timeout_s=30, every_s=0.05)
        assert members, "the stand-in did not start its child"
        watched = [*members, psutil.Process(left_group.pid)]
        sup.stopping = True
        runner.join(10)
        started = time.monotonic()
        sup.stop()
        assert time.monotonic() - started < 0.5 + processes.KILL_WAIT_S + 1
        running = [p for p in watched if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert running == []
        assert bystander.poll() is None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for p in (left_group, bystander):
            p.kill()
            p.wait()


# Stands in for `ray start --block`: fails its first FAILS starts (a raylet that timed out on a slow agent),
# then joins (writes Ray's started file in its temp dir) and exits with 7, as a node lost later would.
FLAKY_RAY = """
import sys
from pathlib import Path
temp = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--temp-dir=")))
starts = temp.parent / "starts"
n = int(starts.read_text()) + 1 if starts.exists() else 1
starts.write_text(str(n))
(temp / "session_latest" / "logs").mkdir(parents=True, exist_ok=True)
(temp / "session_latest" / "logs" / "raylet.out").write_text("start " + str(n))
if n <= int(sys.argv[1]):
    sys.exit(1)
(temp / {started!r}).write_text("10.0.0.1:6379")
sys.exit(7)
"""


@pytest.mark.parametrize(
    ("role", "rejoin", "fails", "starts", "status"),
    [("worker", 0, 2, 3, 7), ("worker", 0, 5, 3, 1), ("head", 0, 1, 1, 1), ("worker", 1, 1, 1, 1)],
    ids=["worker-joins-on-its-third-start", "worker-that-never-starts", "head", "lost-worker-back"],
)
def test_a_worker_nodes_ray_that_fails_its_own_start_is_started_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str, rejoin: int, fails: int, starts: int, status: int
) -> None:
    """A worker node's Ray that exits before its node joined starts again, up to START_TRIES, each failed
    start's Ray logs kept; one that exits after it joined (a lost node) is not, nor is the head's, nor a lost
    node's start again (the batch script's watcher backs off and tries again itself)."""
    import signal
    import sys

    from raytrain import ray_internals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    temp_dir, logs = tmp_path / "rt-node", tmp_path / "logs"
    node.ray_temp(temp_dir).mkdir(parents=True)
    logs.mkdir()
    script = tmp_path / "ray_start.py"
    script.write_text(FLAKY_RAY.format(started=ray_internals.STARTED_FILE))
    args = node.NodeArgs(
        role=role,
        job_dir=tmp_path,
        log_dir=logs,
        head=None if role == "head" else "10.0.0.1:6379",
        ifname=None,
        head_ip=None,
        tmp_root=tmp_path,
        port_base=BLOCK["base"],
        port_block=BLOCK["size"],
        port_blocks=BLOCK["count"],
        ray_cmd=(sys.executable,),
        rejoin=rejoin,
    )
    cmd = [sys.executable, str(script), str(fails), f"--temp-dir={node.ray_temp(temp_dir)}"]
    try:
        sup = node.Supervisor(temp_dir, grace_s=0.5)
        assert node.run_ray(sup, cmd, dict(os.environ), args=args, temp_dir=temp_dir, nodename="node3") == status
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert (temp_dir / "starts").read_text() == str(starts)
    kept = sorted(p.name for p in logs.iterdir())
    assert kept == [f"ray-{role}-node3-failed-start-{n}" for n in range(1, starts)], kept
    for n in range(1, starts):
        assert (logs / kept[n - 1] / "raylet.out").read_text() == f"start {n}"
    said = re.findall(
        r"node3: Ray exited with status 1 before this node joined; starting it again \((\d) of 3\); "
        r"its Ray logs are in (\S+)$",
        capsys.readouterr().err,
        re.M,
    )
    assert said == [(str(n + 1), str(logs / kept[n - 1])) for n in range(1, starts)], said


def test_a_stop_takes_a_zombie_as_ended_and_kills_what_ignores_sigterm() -> None:
    """A process that exited but is not yet reaped (its parent lives on, or init is slow) holds nothing: a
    stop does not wait the grace for it. One that ignores SIGTERM is killed when the grace is over."""
    import subprocess
    import sys

    import psutil

    parent = subprocess.Popen(  # forks a child that exits at once, and never reaps it
        [sys.executable, "-c", "import os, time\nif os.fork() == 0: os._exit(0)\ntime.sleep(600)"]
    )
    # It says when it ignores SIGTERM: its command line shows as soon as it starts, before it does.
    stubborn = subprocess.Popen(
        [sys.executable, "-c", STUBBORN.replace("; time.sleep", "; print('ignoring', flush=True); time.sleep")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        zombie = waits.until(
            lambda: next((c for c in psutil.Process(parent.pid).children() if c.status() == "zombie"), None),
            timeout_s=30,
            every_s=0.05,
        )
        assert zombie is not None, "the child did not exit"
        started = time.monotonic()
        processes.terminate([zombie], grace_s=20)
        assert time.monotonic() - started < 2, "waited for a zombie to be reaped"
        assert parent.poll() is None  # its parent untouched

        assert stubborn.stdout is not None and stubborn.stdout.readline() == "ignoring\n"
        started = time.monotonic()
        held = psutil.Process(stubborn.pid)
        processes.terminate([held], grace_s=1)
        assert 1 <= time.monotonic() - started < 1 + processes.KILL_WAIT_S
        assert not psutil.pid_exists(stubborn.pid) or held.status() == psutil.STATUS_ZOMBIE
    finally:
        for p in (parent, stubborn):
            p.kill()
            p.wait()


def test_the_join_wait_names_a_head_whose_ray_dies_under_it_at_once(tmp_path: Path) -> None:
    """A real Ray head whose GCS is killed while the batch script's join wait reads it: the wait says which
    node's Ray exited, with its log, in seconds (Ray's own client would retry for a minute, then end it)."""
    import shutil
    import subprocess
    import sys
    import tempfile
    import threading
    import time

    import psutil

    from raytrain.contracts.jobdir import SLURM_NODE_LABEL

    temp = Path(tempfile.mkdtemp(prefix="rtw", dir="/tmp"))  # short: Ray's socket paths
    (tmp_path / "token").write_text(os.urandom(32).hex())
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "token")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "head.log"
    start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats"]
    opts = [f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--include-dashboard=false"]
    with log.open("wb") as out:
        head = subprocess.Popen(
            [*start, *opts, f"--temp-dir={temp}/ray", f"--labels={SLURM_NODE_LABEL}=node1"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    threading.Thread(target=head.wait, daemon=True).start()  # reaped at once, as the batch script's bash does
    never = subprocess.Popen(["sleep", "600"])  # a node that never joins, so the wait goes on reading
    specs = [f"--watch=node1:{head.pid}:{log}", f"--watch=node2:{never.pid}:{tmp_path}/w.log"]
    cmd = [sys.executable, "-m", "raytrain.launch", "wait", f"--address=127.0.0.1:{port}", f"--job-dir={tmp_path}"]
    wait = subprocess.Popen([*cmd, *specs, "--timeout=300"], env=env, stderr=subprocess.PIPE, text=True)
    try:

        def reading() -> bool:  # Ray is up, and the wait holds a connection to its GCS: it reads the node table
            held = psutil.Process(wait.pid).net_connections()
            up = "Ray runtime started" in log.read_text()
            return up and any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in held)

        assert waits.until(reading, timeout_s=120, every_s=0.2), log.read_text()
        gcs = next(p for p in psutil.Process(head.pid).children(recursive=True) if p.name() == "gcs_server")
        gcs.kill()
        killed = time.monotonic()
        try:
            _, err = wait.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"head {head.poll()}: {log.read_text()[-3000:]}") from None
        assert wait.returncode == 2 and time.monotonic() - killed < 30, err
        assert f"raytrain: error: Ray on node1 exited before the cluster was up; see {log}" in err, err
        assert "Traceback" not in err
    finally:
        for p in (wait, never):
            p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, 9)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_process_group_is_signalled_only_while_it_still_holds_its_id() -> None:
    import subprocess

    import psutil

    leader = subprocess.Popen(["sleep", "600"], process_group=0)  # a group of its own, as start_new_session
    member = subprocess.Popen(["sleep", "600"], process_group=leader.pid)
    try:
        held = psutil.Process(leader.pid)
        assert processes.group_held(held)
        leader.kill()
        leader.wait()  # reaped: only the member keeps the group's id from being handed out again
        assert processes.group_held(held)
        member.kill()
        member.wait()
        assert not processes.group_held(held)  # the id is free: signalling it could reach a stranger
    finally:
        for p in (leader, member):
            p.kill()
            p.wait()
