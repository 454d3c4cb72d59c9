"""The batch script's requeue policy and its Slurm calls (raytrain.launch.requeue, raytrain.slurm_env), with
Slurm's commands stubbed on PATH: what each way an attempt ends decides, the time limit checked against the
warning's lead, and every call bounded in time when Slurm does not answer. The testbed runs the real thing
(tests/test_shared_cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain import slurm_env
from raytrain.contracts import jobdir
from raytrain.errors import UserError
from raytrain.launch import requeue
from raytrain.launch.requeue import Ending
from raytrain.service import jobs
from tests.conftest import cli_env


def stub(bin_dir: Path, name: str, script: str) -> Path:
    """A Slurm command on PATH: a shell script (``$@`` its arguments)."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def slurm_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5", 300),  # sbatch --time=M
        ("4:00", 240),  # M:SS (squeue %l)
        ("1:00:00", 3600),
        ("2-3", (2 * 24 + 3) * 3600),
        ("1-02:03", ((24 + 2) * 60 + 3) * 60),
        ("1-02:03:04\n", 93784),
        ("UNLIMITED", None),
    ],
)
def test_slurm_times_parse(text: str, seconds: int | None) -> None:
    assert slurm_env.parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5", 300), ("1:30", 120), ("1:00:01", 3660), ("0:59", 60), ("UNLIMITED", None), ("0", None)],  # 0: no limit
)
def test_a_time_option_is_the_limit_slurm_applies_rounded_up_to_a_minute(text: str, seconds: int | None) -> None:
    assert slurm_env.parse_time_option(text) == seconds


def test_signal_leads_parse() -> None:
    assert slurm_env.parse_signal_lead("B:USR2@300") == 300
    assert slurm_env.parse_signal_lead("USR1") == 60  # Slurm's default lead
    with pytest.raises(ValueError):
        slurm_env.parse_signal_lead("B:USR2@soon")


def test_a_time_limit_the_warning_comes_before_is_refused() -> None:
    refused = r"^the job's time limit \(4:00\) leaves no time to train before the warning that comes 300 s"
    with pytest.raises(UserError, match=refused):
        slurm_env.check_time_limit(240, 300)
    with pytest.raises(UserError, match=r"up to 60 s earlier\): ask for a --time longer than 6:00 plus start-up"):
        slurm_env.check_time_limit(360, 300)
    slurm_env.check_time_limit(361, 300)
    slurm_env.check_time_limit(None, 300)  # unlimited, or squeue could not say


def ending(**kw: object) -> Ending:
    base = {"on_term": False, "driver_status": None, "warned": False, "stopping": False, "serving": False}
    return Ending(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("what", "requeued"),
    [
        (ending(driver_status=75, warned=True), True),  # checkpointed on the warning
        (ending(driver_status=76), True),  # the cluster failed under the driver
        (ending(driver_status=1, warned=True), True),  # failed while ending: its checkpoint may be cut short
        (ending(driver_status=1), False),  # a failure of the training itself
        (ending(driver_status=0, warned=True), False),  # done before the time limit
        (ending(on_term=True, term_reason="TimeLimit"), True),  # the time limit, warned or not
        (ending(on_term=True, warned=True, term_reason="TimeLimit"), True),
        (ending(on_term=True, warned=True, term_reason=None), True),  # squeue silent: the warning came first
        (ending(on_term=True, term_reason="None"), False),  # scancel
        (ending(on_term=True, warned=True, term_reason="None"), False),  # scancel after the warning
        (ending(on_term=True, term_reason=None), False),  # no warning, squeue silent: a cancel
        (ending(driver_status=75, stopping=True), False),  # raytrain stop
        (ending(on_term=True, term_reason="TimeLimit", serving=True), False),  # drivers are told, not the job
        (ending(driver_status=143, warned=True, cancelled=True), False),  # raytrain cancel, as the job ended
        (ending(driver_status=143, warned=True), True),  # killed as the job ended
    ],
)
def test_what_requeues(what: Ending, requeued: bool) -> None:
    assert requeue.decide(what, restart_count=0, max_requeues=3)[0] is requeued


def test_requeues_stop_at_the_cap_with_a_line() -> None:
    requeued, said = requeue.decide(ending(driver_status=75), restart_count=3, max_requeues=3)
    assert not requeued and said is not None and "has restarted 3 times (RAYTRAIN_MAX_REQUEUES=3)" in said


def job(restart: int = 0) -> slurm_env.SlurmJob:
    found = slurm_env.current({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restart)})
    assert found is not None
    return found


def test_a_time_limit_requeues_through_scontrol(slurm_bin: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    stub(slurm_bin, "squeue", "echo TimeLimit")
    stub(slurm_bin, "scontrol", f'echo "$@" >> {calls}')
    requeued, lines = requeue.run(job(), ending(on_term=True), max_requeues=3)
    assert requeued and calls.read_text() == "requeue 77\n"
    assert lines == [
        "requeueing job 77 (restart 1 of at most 3): it reached its time limit; the next attempt resumes from "
        "the newest checkpoint"
    ]


def test_the_requeue_line_survives_the_sigterm_the_requeue_sends(slurm_bin: Path, tmp_path: Path) -> None:
    """Slurm SIGTERMs every process of a job it requeues, the batch script's ``launch requeue`` (and its
    scontrol) included, as soon as it takes the requeue: the line that says so must still be written."""
    calls = tmp_path / "calls"
    stub(slurm_bin, "scontrol", f'echo "$@" >> {calls}; kill -TERM $PPID $$')
    env = cli_env({"PATH": os.environ["PATH"], "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain.launch", "requeue", "--on", "exit", "--driver-status", "75", "--warned"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert calls.read_text() == "requeue 77\n"
    assert proc.returncode == 0, proc.stderr
    assert "raytrain: requeueing job 77 (restart 1 of at most 3): the driver stopped early with a checkpoint" in (
        proc.stdout + proc.stderr
    )


def test_slurm_that_does_not_answer_bounds_every_call(slurm_bin: Path, tmp_path: Path) -> None:
    """A hanging squeue: the SIGTERM trap's question is cut short and the warning decides; a hanging
    scontrol: the requeue gives up with a line. Nothing waits past its bound."""
    stub(slurm_bin, "squeue", "exec sleep 600")
    calls = tmp_path / "calls"
    stub(slurm_bin, "scontrol", f'echo "$@" >> {calls}')
    start = time.monotonic()
    assert slurm_env.live_jobs(timeout_s=1) is None and slurm_env.time_left_s("77", timeout_s=1) is None
    assert slurm_env.job_steps("77", timeout_s=1) is None
    requeued, _ = requeue.run(job(), ending(on_term=True, warned=True), max_requeues=3)
    assert requeued and calls.read_text() == "requeue 77\n"
    assert time.monotonic() - start < 2 + requeue.TERM_REASON_TIMEOUT_S + 2
    stub(slurm_bin, "scontrol", "exec sleep 600")
    start = time.monotonic()
    requeued, lines = requeue.run(job(), ending(driver_status=75), max_requeues=3)
    assert not requeued and lines == [
        f"error: scontrol requeue failed (scontrol did not answer within {requeue.REQUEUE_TIMEOUT_S:.0f} s): "
        "resubmit the same command to resume"
    ]
    assert time.monotonic() - start < requeue.REQUEUE_TIMEOUT_S + 2


def test_a_job_slurm_no_longer_knows_is_told_apart_from_a_slurm_that_does_not_answer(
    slurm_bin: Path, tmp_path: Path
) -> None:
    """What `raytrain stop` and `fit --slurm`'s follow go by: "gone" ends them, "cannot say" does not."""
    stub(slurm_bin, "scontrol", 'echo "JobId=$4 JobState=RUNNING StdOut=/x/raytrain-$4.out"')
    assert slurm_env.job_state("77") == "RUNNING" and slurm_env.stdout_of("77") == Path("/x/raytrain-77.out")
    stub(slurm_bin, "scontrol", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    assert slurm_env.job_state("77") is None
    stub(slurm_bin, "scontrol", 'echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1')
    with pytest.raises(slurm_env.SlurmSilent, match=r"could not say about job 77 \(slurm_load_jobs error: Socket"):
        slurm_env.job_state("77")
    assert slurm_env.stdout_of("77") is None
    stub(slurm_bin, "scontrol", "exec sleep 600")
    start = time.monotonic()
    with pytest.raises(slurm_env.SlurmSilent, match="did not answer about job 77 in 1 s"):
        slurm_env.job_info("77", timeout_s=1)
    assert time.monotonic() - start < 5


def test_a_wait_for_a_job_goes_on_through_a_silent_slurm_and_ends_once_its_cluster_is_up(
    slurm_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`raytrain submit`'s wait: a controller that does not answer does not end it; the job's own files say
    when its cluster is up."""
    stub(slurm_bin, "scontrol", 'echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1')
    monkeypatch.setenv("RAYTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(jobs, "_POLL_S", 0.01)
    said: list[str] = []

    def echo(line: str) -> None:
        said.append(line)
        directory = jobdir.job_dir("77")  # the cluster comes up while the controller stays silent
        directory.mkdir(parents=True)
        (directory / jobdir.CLUSTER).write_text("{}")
        (directory / jobdir.READY).write_text("")

    assert jobs.wait_for_cluster("77", echo) == jobdir.job_dir("77")
    assert said == [
        "job 77 is in a state Slurm's controller does not say (it does not answer); waiting for it "
        "(Ctrl-C stops waiting, not the job)"
    ]


def setup_cli(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m raytrain.launch setup`` as the batch script runs it, inside a job on node1 of node[1-3]
    (Slurm stubbed)."""
    if not (tmp_path / "bin" / "scontrol").exists():
        stub(tmp_path / "bin", "scontrol", 'echo "$@" >> calls; printf "node1\\nnode2\\nnode3\\n"')
    full = cli_env(
        {
            "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "node[1-3]",
            "SLURMD_NODENAME": "node1",
            "SLURM_SUBMIT_DIR": str(tmp_path),
            "RAYTRAIN_STATE_DIR": str(tmp_path / "state"),
            "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
            **env,
        }
    )
    cmd = [sys.executable, "-m", "raytrain.launch", "setup"]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_setup_names_the_allocations_nodes_head_first_and_runs_on_the_first_only(tmp_path: Path) -> None:
    stub(tmp_path / "bin", "squeue", "echo 1:00:00")
    out = setup_cli(tmp_path, {})
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "node1 node2 node3", out.stderr
    assert (tmp_path / "calls").read_text() == "show hostnames node[1-3]\n"
    elsewhere = setup_cli(tmp_path, {"SLURMD_NODENAME": "node2"})
    assert elsewhere.returncode == 2 and elsewhere.stderr.strip() == (
        "raytrain: error: the batch script runs on node2, not on the allocation's first node node1: "
        "run slurm/ray_cluster.sbatch with sbatch, not as a step of another job"
    )
    stub(tmp_path / "bin", "scontrol", "exit 1")
    silent = setup_cli(tmp_path, {})
    assert silent.returncode == 2 and "scontrol cannot expand the job's node list 'node[1-3]'" in silent.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RAYTRAIN_PORT_BASE": "2e4"}, "RAYTRAIN_PORT_BASE='2e4' is not a whole number: give a whole number of at "),
        ({"RAYTRAIN_MAX_REQUEUES": "-1"}, "RAYTRAIN_MAX_REQUEUES=-1 is below 0"),
        ({"RAYTRAIN_JOIN_TIMEOUT": "soon"}, "RAYTRAIN_JOIN_TIMEOUT='soon' is not a number"),
        ({"RAYTRAIN_STOP_GRACE": "x"}, "RAYTRAIN_STOP_GRACE='x' is not a number"),
        ({"RAYTRAIN_PORT_BASE": "64000"}, "reaches port 76499, past 65535: lower the base or the number of blocks"),
        ({"RAYTRAIN_PORT_BLOCKS": "88"}, "blocks of RAYTRAIN_PORT_BLOCK=500 ports reaches into this node's ephemeral"),
        ({"RAYTRAIN_PORT_BLOCK": "50"}, "RAYTRAIN_PORT_BLOCK=50 is too small: a block holds raytrain's 20 named"),
        ({"SQUEUE_SAYS": "4:00"}, "the job's time limit (4:00) leaves no time to train before the warning"),
    ],
)
def test_bad_settings_stop_the_job_before_anything_is_made(tmp_path: Path, env: dict[str, str], message: str) -> None:
    stub(tmp_path / "bin", "squeue", f"echo {env.pop('SQUEUE_SAYS', '4:00:00')}")
    start = time.monotonic()
    out = setup_cli(tmp_path, env)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("raytrain: error: "), out.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in out.stderr and time.monotonic() - start < 30
    assert not (tmp_path / "state").exists() and not (tmp_path / "raytrain-logs").exists()


def test_setup_makes_the_private_dirs_and_marks_a_serving_job(tmp_path: Path) -> None:
    stub(tmp_path / "bin", "squeue", "echo 1:00:00")
    out = setup_cli(tmp_path, {})
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "state" / "77" / "token").is_file() and not (tmp_path / "state" / "77" / "serving").exists()
    logs = tmp_path / "raytrain-logs" / "77"
    assert (logs / "attempt-0").is_dir() and logs.stat().st_mode & 0o777 == 0o700


def test_a_log_directory_that_is_a_link_or_another_users_is_refused(tmp_path: Path) -> None:
    stub(tmp_path / "bin", "squeue", "echo 1:00:00")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (tmp_path / "raytrain-logs").mkdir()
    planted = tmp_path / "raytrain-logs" / "77"
    planted.symlink_to(elsewhere)  # planted by someone who can write the log root
    out = setup_cli(tmp_path, {})
    assert out.returncode == 2 and f"the job's log directory {planted} is a symbolic link: set RAYTRAIN_LOG_DIR" in (
        out.stderr
    )
    assert elsewhere.stat().st_mode & 0o777 == 0o755 and not list(elsewhere.iterdir())  # nothing done through it
    assert not (tmp_path / "state").exists()  # no token made for a job that does not start
    if os.geteuid() == 0:  # another user's directory (root can make one)
        planted.unlink()
        planted.mkdir()
        os.chown(planted, 4242, 4242)
        out = setup_cli(tmp_path, {})
        assert out.returncode == 2 and "belongs to uid 4242, not to you" in out.stderr, out.stderr


def test_fit_slurm_refuses_a_time_the_warning_comes_before_submitting_nothing(tmp_path: Path) -> None:
    from tests.conftest import assert_user_error, run_cli

    sbatch = stub(tmp_path / "bin", "sbatch", f"echo called >> {tmp_path / 'sbatch-called'}")
    stub(tmp_path / "bin", "sinfo", "true")  # a partition with no usable nodes
    on_path = {"PATH": f"{sbatch.parent}:{os.environ['PATH']}"}
    out = run_cli("fit", "--slurm", "--workers", "2", "--", "--time=5", env=on_path)
    assert_user_error(out, "the job's time limit (5:00) leaves no time to train before the warning that comes 300 s")
    out = run_cli("fit", "--slurm", "--workers", "2", "--", "-t", "1:50", "--signal=B:USR2@60", env=on_path)
    # Slurm rounds 1:50 up to 2 minutes: the limit the job would get, and still too short.
    assert_user_error(out, "the job's time limit (2:00) leaves no time to train before the warning that comes 60 s")
    # A shorter lead given with --signal makes the same --time fine (what fails next is the empty partition).
    out = run_cli("fit", "--slurm", "--workers", "2", "--", "--time=5", "--signal=B:USR2@60", env=on_path)
    assert_user_error(out, "sinfo shows no usable nodes in the default partition")
    assert not (tmp_path / "sbatch-called").exists()


@pytest.mark.parametrize(("status", "requeued"), [(0, False), (1, True), (75, True), (76, True)])
def test_a_sigterm_after_the_driver_ended_goes_by_its_status(status: int, requeued: bool) -> None:
    """The time limit lands between the driver's end and the teardown's: a completed run is not run again;
    a preempted one, or one that failed while the job was ending, still requeues."""
    what = ending(on_term=True, driver_status=status, warned=True, term_reason="TimeLimit")
    assert requeue.decide(what, restart_count=0, max_requeues=3)[0] is requeued


@pytest.mark.parametrize("value", ["inf", "1e300", "nan"])
def test_a_number_setting_that_would_overflow_is_one_line(tmp_path: Path, value: str) -> None:
    from tests.conftest import assert_user_error, run_cli

    out = run_cli("fit", "--dry-run", "--storage", str(tmp_path), env={"RAYTRAIN_STORAGE_TIMEOUT": value})
    assert_user_error(out, f"RAYTRAIN_STORAGE_TIMEOUT={value} is too large")


@pytest.mark.parametrize(
    ("driver", "ended"),
    [
        ("batch", True),  # its ticket still there, with the cancel request
        ("noted", True),  # its ticket gone: the driver noted its cancelled end, its status not yet collected
        ("trial", False),  # a sweep's trial (an actor) under the batch script's driver: the sweep goes on
        ("submitted", False),  # another driver's run on the job's cluster (`raytrain submit`)
    ],
)
def test_the_time_limit_ends_a_job_whose_driver_is_still_ending_its_cancelled_run(
    slurm_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str, ended: bool
) -> None:
    """`raytrain cancel` asked the batch script's own driver's run to end, and the time limit's SIGTERM comes
    while it still checkpoints or ends (no status yet): the job ends with it, not requeued. A cancel of a
    trial or of another driver's run does not decide for the job."""
    from raytrain.contracts import env
    from raytrain.contracts.jobdir import CANCEL, DRIVER_ENDED, QUEUE, EndRequest
    from raytrain.contracts.result import EXIT_CANCELLED
    from raytrain.service import admission

    calls = tmp_path / "calls"
    stub(slurm_bin, "squeue", "echo TimeLimit")
    stub(slurm_bin, "scontrol", f'echo "$@" >> {calls}')
    job_dir = tmp_path / "jobs" / "77"
    job_dir.mkdir(parents=True)
    if driver == "noted":
        (job_dir / DRIVER_ENDED).write_text(f"{EXIT_CANCELLED}\n")
    else:
        if driver != "submitted":
            monkeypatch.setenv(env.BATCH_DRIVER.name, "1")
        actor = "actor-1" if driver == "trial" else None
        place = admission.Place.take(
            job_dir, run="r", cluster="c", ray_job="01000000", workers=1, per_worker={"CPU": 1.0}, actor=actor
        )
        place.set_phase("running")
        asked = EndRequest(why=CANCEL, by="someone", deadline=time.time() + 60, at=time.time())
        asked.write(job_dir / QUEUE, place.ticket.request_file)
        assert jobdir.batch_run_cancelled(job_dir) is ended
    settings = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain.launch", "requeue", "--on", "term", "--warned"],
        env=cli_env({**settings, env.STATE_DIR.name: str(tmp_path / "jobs")}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == (1 if ended else 0), proc.stdout + proc.stderr
    assert calls.exists() is not ended, proc.stdout + proc.stderr
