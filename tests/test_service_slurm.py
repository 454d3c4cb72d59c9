"""The Slurm-booted cluster as a service for any Ray Train code, on the 3-node testbed: a user's sharded
train function preempted and resumed, and a serving cluster inside the user's image (Debian's Podman,
tests/container_image.py) taking drivers from the login node (in turn, by priority, at once, too big; runs
cancelled), every one of them started in the image. A stock script through `--` under a real time limit is
in test_shared_cluster; `fit --slurm` sizing its own allocation, in the image through a requeue, in
test_scale_slurm; an image that cannot run the job, in test_container_slurm."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain import ray_internals
from raytrain.contracts import env, rundir
from raytrain.contracts.jobdir import job_dir
from raytrain.contracts.result import RunResult
from raytrain.recipe import checkpoint_files
from tests import container_image
from tests.conftest import REPO
from tests.lockdown import assert_dashboard_hint, assert_locked_down
from tests.slurm_util import FAST_FIT, WHOLE_NODES, Testbed, assert_cleaned_up, job_processes, wait_text

pytestmark = pytest.mark.slurm
USER_CODE = {"PYTHONPATH": str(REPO)}  # where tests.user_code lives, on every node (shared filesystem)
STOCK = ("python3", "-m", "tests.user_code.stock_train", "--storage", "runs")  # an image may have python3 only
FSDP = "tests.user_code.fsdp_train:train_func"
# 3 CPUs a worker on 4-CPU nodes: Ray itself has to put the three workers on three nodes.
SPREAD = ("--workers", "3", "--cpus-per-worker", "3")


def result_of(testbed: Testbed, name: str) -> RunResult:
    return RunResult.from_json(json.loads((testbed.work / "runs" / name / "result.json").read_text()))


def test_a_sharded_train_function_whose_last_save_misses_the_deadline_stops_as_preempted_and_requeues(
    testbed: Testbed,
) -> None:
    """The README's FSDP2 function (tests/user_code/fsdp_train.py) on 3 nodes, world size 3, each rank
    saving its shard in the background every epoch. Slurm's warning (an scancel --signal=USR2 standing
    for --signal=B:USR2@50) gives the training 30 s (the lead less the batch script's 20 s for teardown
    and requeue), counted down in Ray's drain of a node; its last save, slowed on purpose far past that,
    is abandoned with a line, and the driver still stops as preempted, on its newest whole checkpoint: the
    job requeues. (The resume, resharded, is test_train_func's; a requeued job's, test_scale_slurm's.)"""
    fit = ("--train-func", FSDP, "--config", "epochs=4", "--config", "steps=100", "--config", "slow_last_save=600")
    fit += ("--device", "cpu", "--cpus-per-worker", "1", "--storage", "runs", "--name", "sharded")
    job = testbed.submit(*WHOLE_NODES, fit=fit, env={**USER_CODE, env.SIGNAL_LEAD.name: "50"})
    testbed.wait_output(job, r"^epoch 1/4 ", timeout=300)
    testbed.run("scancel", "--signal=USR2", "--batch", job)  # what --signal=B:USR2@50 delivers
    first = testbed.wait_output(job, r"requeueing job", timeout=180)
    # 30 s from the signal (the lead less 20 s), counted down by the time the drain is asked for
    drained = re.search(r"^drained node2 for preemption \(deadline (\d+) s\)$", first, re.M)
    assert drained and 20 <= int(drained.group(1)) <= 30 and "driver exited with status 75" in first, first
    assert re.search(r"^last save abandoned: .*the job had \d+ s left", first, re.M), first
    saved = re.search(r"^preempted: checkpoint (epoch_(\d{4})) saved", first, re.M)
    assert saved, first
    assert testbed.wait_state(job, {"PENDING", "RUNNING"}, timeout=60)["Restarts"] == "1"
    attempt_0 = testbed.output(job).split("/attempt-1")[0]  # the requeue's own SIGTERM is not a second ending
    assert attempt_0.count("requeueing job") == 1 and "SIGTERM" not in attempt_0, attempt_0
    run = testbed.work / "runs" / "sharded" / saved.group(1)
    assert {p.name for p in run.glob("__*.distcp")} == {f"__{r}_0.distcp" for r in range(3)}
    testbed.run("scancel", job)
    assert_cleaned_up(job)


@dataclass(frozen=True)
class Serving:
    job: str
    since: float  # a moment before its sbatch (Podman's event times are whole seconds)
    env: dict[str, str]  # what the user's shell exports: the image, its runtime's settings, tests.user_code
    settings: dict[str, str]  # the runtime's settings alone


@pytest.fixture
def serving(testbed: Testbed, podman_image: tuple[str, dict[str, str]]) -> Iterator[Serving]:
    """A serving cluster on all three nodes inside the testbed's image, just submitted (not yet up); cancelled
    afterwards should the test not have ended it."""
    tag, settings = podman_image
    with_image = {**USER_CODE, **settings, env.CONTAINER.name: tag}
    since = time.time() - 1
    job = testbed.submit(*WHOLE_NODES, fit=("--serve",), env=with_image)
    try:
        yield Serving(job, since, with_image, settings)
    finally:
        testbed.run("scancel", job, check=False)


FIT = ("fit", *FAST_FIT)


def test_a_serving_cluster_in_an_image_takes_drivers_in_turn_by_priority_and_at_once_and_cancels_runs(
    testbed: Testbed, serving: Serving
) -> None:
    job, user = serving.job, serving.env

    # Each driver's output and status come back here. The first is submitted while the job is still pending
    # or starting: waited for, with a line.
    submit = ("submit", job, "--")
    # Priorities: a low-priority fit holds 9 of the 12 CPUs; a high-priority stock script that needs them asks
    # it to yield: it checkpoints where it is, queues again (status shows both, and why), and resumes from that
    # very checkpoint once the high one has ended, so nothing is trained twice. Then cancelled: it checkpoints
    # and ends (143).
    holder_out, waiter_out = testbed.work / "holds.out", testbed.work / "waits.out"
    holder = testbed.spawn_raytrain(
        *("submit", "--priority", "low", job, "--", *FIT, *SPREAD, "--epochs", "1000", "--name", "holds"),
        out=holder_out,
        env={**user, env.PROGRESS_EVERY.name: "1"},
    )
    first = wait_text(holder_out, r"^epoch +1/1000 ", timeout=420)
    assert re.search(rf"^job {job} is (pending|starting its cluster).*; waiting for it", first, re.M), first
    waiter = testbed.spawn_raytrain(
        *("submit", "--priority", "high", job, "--", *STOCK, *SPREAD, "--epochs", "2", "--name", "waits"),
        out=waiter_out,
        env=user,
    )
    asks = (
        r"raytrain: waits: waiting for 3 worker\(s\) of 3 CPU: .*; asked run 'holds' \(priority low\) to yield theirs"
    )
    wait_text(waiter_out, asks, timeout=120)
    yielded = wait_text(holder_out, r"^run: holds: waiting for 3 worker\(s\) of 3 CPU: ", timeout=120)
    stopped = re.search(r"^preempted: checkpoint (epoch_\d+(?:_step_\d+)?) saved, to yield its room", yielded, re.M)
    assert stopped and "it yields its room to a run of higher priority" in yielded, yielded
    queued = testbed.raytrain("status", job, env=user)
    assert re.search(r"^runs: 1\n  run 'waits' \(priority high, driver pid", queued.stdout, re.M), queued.stdout
    assert re.search(r"^waiting: 1 run\(s\).*\n  run 'holds' \(priority low, driver pid", queued.stdout, re.M)
    assert waiter.wait(timeout=300) == 0, waiter_out.read_text()
    waited = waiter_out.read_text()
    assert "raytrain: waits: its turn: 3 worker(s) fit what is free now" in waited
    assert "stock script done: epoch 2" in waited, waited
    assert sorted(p.hostname for p in result_of(testbed, "waits").placement) == ["node1", "node2", "node3"]
    wait_text(holder_out, rf"resuming from {stopped.group(1)} (?s:.*)^progress: epoch ", timeout=300)
    ended = testbed.raytrain("cancel", job, "holds", env=user, timeout=180)
    assert ended.returncode == 0 and "run 'holds': ended" in ended.stdout, ended.stdout + ended.stderr
    assert holder.wait(timeout=60) == 143, holder_out.read_text()
    assert re.search(
        r"^cancelled: checkpoint epoch_\d+(_step_\d+)? saved; rerun the same command", holder_out.read_text(), re.M
    )
    held = result_of(testbed, "holds")
    assert held.status == "cancelled" and held.preempted_via == "cancel", held
    assert held.resumed_from and str(held.resumed_from["checkpoint"]).endswith(stopped.group(1)), held.resumed_from

    # Then, in turn: a stock Ray Tune script whose trials each fit a TorchTrainer. The trainers start in Tune's
    # actors, not in the driver, and still load raytrain's callback (each trial's run gets its result.json and
    # history).
    tune_script = ("python3", "-m", "tests.user_code.stock_tune", "--storage", "runs", "--trials", "2")
    tuned = testbed.raytrain(*submit, *tune_script, env=user)
    assert tuned.returncode == 0 and "stock tune done: best loss" in tuned.stdout, tuned.stdout + tuned.stderr
    trials = sorted((testbed.work / "runs").glob("tuned-*_0000[01]"))
    assert len(trials) == 2, trials
    for trial in trials:
        result = RunResult.from_json(json.loads((trial / rundir.RESULT).read_text()))
        assert result.kind == "script" and result.status == "completed" and result.epochs_completed == 2, result
        assert len((trial / rundir.HISTORY).read_text().splitlines()) == 2

    # Two drivers of one run at once (the same command submitted twice): exactly one trains it, the other is
    # refused in one line, and the run's checkpoints and index stay the winner's.
    outs = [testbed.work / f"race-{i}.out" for i in (1, 2)]
    racers = [testbed.spawn_raytrain(*submit, *FIT, "--epochs", "2", "--name", "race", out=o, env=user) for o in outs]
    codes = sorted(r.wait(timeout=400) for r in racers)
    texts = [out.read_text() for out in outs]
    assert codes == [0, 2], texts
    winner, loser = (texts[0], texts[1]) if "done: 2 epochs" in texts[0] else (texts[1], texts[0])
    refused = r"^raytrain: error: run 'race' is in use by pid \d+ on node1"
    assert "done: 2 epochs" in winner and re.search(refused, loser, re.M), loser
    race = testbed.work / "runs" / "race"
    kept, _ = ray_internals.read_checkpoint_snapshot((race / ray_internals.CHECKPOINT_SNAPSHOT).read_bytes())
    assert [k.dir_name for k in kept][-1] == "epoch_0002" and sorted(p.name for p in race.glob("epoch_*")) == [
        "epoch_0001",
        "epoch_0002",
    ]
    assert checkpoint_files.verify(pafs.LocalFileSystem(), str(race / "epoch_0002"))
    assert result_of(testbed, "race").status == "completed" and not (race / "driver.lock").exists()

    # More workers than the allocation holds: a clear error at once, not a hang.
    big = testbed.raytrain(*submit, *STOCK, "--workers", "4", "--cpus-per-worker", "3", env=user, timeout=120)
    assert big.returncode != 0
    assert (
        "ScalingConfig(num_workers=4) needs 3 CPU per worker, but this Ray cluster (3 node(s), 12 CPU in all) "
        "holds 3 such worker(s)" in big.stdout + big.stderr
    )

    # At once: two long runs share the cluster; status shows both; the cluster is locked down meanwhile.
    outs = [testbed.work / f"at-once-{i}.out" for i in (1, 2)]
    runs = [
        testbed.spawn_raytrain(
            *submit,
            *STOCK,
            "--workers",
            "3",
            "--cpus-per-worker",
            "1",
            "--epochs",
            "100000",
            "--name",
            f"at-once-{i}",
            out=out,
            env=user,
        )
        for i, out in enumerate(outs, start=1)
    ]
    for out in outs:
        wait_text(out, r"raytrain: epoch 1 ", timeout=300)
    status = testbed.raytrain("status", job, env=user)
    assert status.returncode == 0, status.stderr
    assert "free: 6 of 12 CPUs, 0 of 0 GPUs" in status.stdout and "drivers: 2" in status.stdout, status.stdout
    assert (
        len(re.findall(r"^  pid \d+ on 10\.77\.0\.11 since .*tests\.user_code\.stock_train", status.stdout, re.M)) == 2
    )
    assert re.search(r"^  node1 +10\.77\.0\.11 +\d/4 +0/0$", status.stdout, re.M), status.stdout
    assert_locked_down(testbed, job, job_dir(job), trainers_expected=6, runs=2)
    hint = testbed.raytrain("dashboard", job).stdout
    assert_dashboard_hint(hint, testbed.output(job), job_dir(job))

    # One of them cancelled: a stock script never asks raytrain.ending_soon(), so its controller stops it once
    # the grace has passed; the other goes on.
    cancelled = testbed.raytrain("cancel", "--grace", "2", job, "at-once-1", env=user, timeout=120)
    assert cancelled.returncode == 0 and "run 'at-once-1': ended" in cancelled.stdout, cancelled.stdout
    assert runs[0].wait(timeout=60) != 0 and runs[1].poll() is None
    assert "at-once-1: cancelled by root with raytrain cancel; its training did not end in time" in outs[0].read_text()

    # Every Ray process of the job runs in the image: Podman marks its containers' processes, and the
    # interpreter is the image's Debian python3, not the host's.
    ray_processes = [p for p in job_processes(job) if re.search(r"raylet|gcs_server|raytrain.launch node", p)]
    assert len(ray_processes) >= 6, ray_processes  # a raylet and a supervisor a node, the GCS
    for line in ray_processes:
        pid = line.split(":")[0]
        assert b"container=podman" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"), line
    supervisors = [p for p in ray_processes if "raytrain.launch node" in p]
    assert len(supervisors) == 3 and all(": python3 -m raytrain.launch node" in p for p in supervisors), supervisors

    # Slurm's own end (`raytrain stop` is test_monitoring_slurm's): each node's Ray stops inside its image,
    # and so do the drivers still running.
    testbed.run("scancel", job)
    testbed.wait_done(job, timeout=60)
    for run in runs:
        assert run.wait(timeout=60) != 0
    started = container_image.started(serving.settings, job, serving.since)
    # The check on every node, each node's Ray, every driver (the refused ones too) and status: in the image.
    assert {c.attempt for c in started} == {0}, started
    roles = sorted({c.role for c in started})
    assert roles == ["check", "ray-head", "ray-worker", "raytrain-driver", "raytrain-status"], started
    assert sum(c.role == "raytrain-driver" for c in started) == 8, started
    assert_cleaned_up(job)
    assert container_image.left(serving.settings, job) == []
