"""Faults on the Slurm testbed: the head's Ray dying (the job requeues and resumes), a job killed outright
and resubmitted, a worker node's Ray lost under an elastic run inside the Podman image (it goes on, and
grows back in a new container), and storage that not every node sees."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from raytrain.contracts import env
from raytrain.contracts.result import EXIT_CANCELLED
from tests import container_image
from tests.conftest import SMALL_MODEL
from tests.slurm_util import FAST_FIT, STUCK_RAY, TWO_NODES, WHOLE_NODES, Testbed, assert_cleaned_up, exit_code

pytestmark = pytest.mark.slurm


def ray_processes(job: str, node: str, names: tuple[str, ...]) -> list[int]:
    """Pids of the job's Ray processes on a testbed node whose command line names one of ``names``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        mine = f"SLURM_JOB_ID={job}".encode() in environ and f"SLURMD_NODENAME={node}".encode() in environ
        if mine and any(n in cmdline for n in names):
            found.append(int(proc.name))
    return found


def test_storage_only_one_node_sees_is_refused_before_training(testbed: Testbed) -> None:
    local = "/tmp/raytrain-node-local-runs"  # each testbed node has a /tmp of its own
    job = testbed.submit(*WHOLE_NODES, fit=("--device", "cpu", "--image-size", "8", "--storage", local, "--name", "nl"))
    info = testbed.wait_done(job, timeout=180)
    out = testbed.output(job)
    assert info["JobState"] == "FAILED" and exit_code(info) == 2, out  # the driver's status is the job's
    assert f"raytrain: error: --storage {local} is not on storage every node sees (node2, node3 cannot see it" in out
    assert "placement:" not in out and "epoch" not in out
    assert_cleaned_up(job)


def test_an_elastic_run_in_an_image_goes_on_without_a_lost_worker_node_and_grows_back_when_it_returns(
    testbed: Testbed, podman_image: tuple[str, dict[str, str]]
) -> None:
    """Inside the Podman image, every process of the job on node3 killed mid-run (its container's and the
    host's), and Ray there unable to start for a while: the watcher lets the elastic run go on, Ray Train
    restarts it on the two nodes left from the newest checkpoint; once node3 can take Ray again the watcher
    starts it there in a new container and the run grows back to three workers. The model is sharded
    (``--strategy fsdp``): each restart reads the newest checkpoint's shards at the new world size, 3 to 2
    and 2 to 3, and the loss goes on from there. The run trains until it has grown back, then its user
    cancels it: three workers save its last checkpoint and the job ends with the driver, never requeued."""
    tag, settings = podman_image
    away = testbed.work / "node3-away"  # while it exists, `ray start` on node3 fails
    away.unlink(missing_ok=True)
    bad_ray = {"RAYTRAIN_RAY_BIN": STUCK_RAY, "RAYTRAIN_TEST_BAD_NODE": "node3", "RAYTRAIN_TEST_BAD_HOW": "exit"}
    # Node3 is tried again every 3 s at most and the run looks for it every 3 s (30 s each by default).
    soon = {env.REJOIN_EVERY.name: "3", env.ELASTIC_CHECK.name: "3"}
    elastic = ("--workers", "2:3", "--cpus-per-worker", "3", "--strategy", "fsdp")  # 4-CPU nodes: a worker each
    # Small enough that three workers of 3 threads each on this 2-core machine train an epoch in seconds.
    small = ("--device", "cpu", "--image-size", "8", "--model", SMALL_MODEL, "--batch-size", "32")
    fit = (*small, *elastic, "--storage", "runs", "--epochs", "1000", "--name", "elastic")
    since = time.time() - 1  # Podman's event times are whole seconds
    in_image = {**settings, env.CONTAINER.name: tag, **bad_ray, **soon, "RAYTRAIN_TEST_BAD_WHILE": str(away)}
    job = testbed.submit(*WHOLE_NODES, fit=fit, env=in_image)
    testbed.wait_output(job, r"^epoch +2/1000 ", timeout=300)
    away.touch()
    victims = ray_processes(job, "node3", ("",))
    assert victims, "no process of the job on node3"
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    testbed.wait_output(job, r"^workers: 2 now, were 3 \(elastic: 2 to 3\)$", timeout=300)
    away.unlink()  # node3 is back
    testbed.wait_output(job, r"^workers: 3 now, were 2 \(elastic: 2 to 3\)$", timeout=300)  # an epoch on 3
    cancelled = testbed.raytrain("cancel", job, "elastic", timeout=120)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    info = testbed.wait_done(job, timeout=300)
    out = testbed.output(job)
    assert exit_code(info) == EXIT_CANCELLED and info["Restarts"] == "0", out  # ended, not requeued
    assert "raytrain: Ray on node3 exited; the elastic run goes on with the nodes left;" in out, out
    assert re.search(r"^workers failed \(rank .*\); Ray Train restarts the workers .*elastic", out, re.M), out
    assert re.search(r"^raytrain: starting Ray on node3 again", out, re.M), out
    assert out.index("workers: 2 now, were 3") < out.index("workers: 3 now, were 2"), out
    node3_log = (testbed.log_dir(job) / "worker-node3.log").read_text()
    assert "ray_that_fails_on: exit on node3" in node3_log, node3_log  # a start while it was away failed
    assert "left by this node's lost Ray" in node3_log, node3_log  # the lost Ray's temp dir swept
    assert node3_log.rstrip().endswith("worker node3: stopped, temp dir removed"), node3_log  # an orderly end
    result = json.loads((testbed.work / "runs/elastic/result.json").read_text())
    assert result["status"] == "cancelled" and result["world_size"] == 3, result
    assert {p["hostname"] for p in result["placement"]} == {"node1", "node2", "node3"}, result
    assert len(result["restarts"]) >= 1 and result["restarts"][0]["resumed_from"], result["restarts"]
    (grew,) = result["resizes"]
    assert (grew["workers"], grew["were"]) == (3, 2) and grew["resumed_from"], grew
    # Resumed, not restarted from scratch: every epoch once, in order, and none after the first restart
    # (in epoch 3) comes back near the first epoch's loss (2.32, then 1.98, 1.77, 1.42 ... here).
    assert [m["epoch"] for m in result["history"]] == list(range(1, len(result["history"]) + 1)), result["history"]
    losses = [m["train_loss"] for m in result["history"]]
    assert len(losses) >= 4 and max(losses[2:]) < 0.9 * losses[0], losses
    shards = {p.name for p in Path(result["last_checkpoint"]).glob("__*.distcp")}  # saved by three workers
    assert shards == {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}, shards
    # node3's Ray ran in the image before and after: its first container, those that failed to start while
    # it was away, and the one it grew back in; none is left, nor anything the killed ones left.
    assert f"every Ray process and driver runs in {tag} (podman)" in out, out
    started = container_image.started(settings, job, since)
    assert sum(c == (0, "ray-worker", "node3") for c in started) >= 3, started
    assert_cleaned_up(job)
    assert container_image.left(settings, job) == []


DEAD_HEAD_EPOCHS = 10  # of 2-3 s: the first attempt got to 3 (its head killed in 2), the second to 5 (in CI)


def test_a_dead_head_requeues_and_a_job_killed_outright_resubmitted_goes_on_with_its_run(testbed: Testbed) -> None:
    """Two faults, one run. The head's Ray dies mid-run (its GCS killed): the batch script stops the
    driver, requeues the job, and the next attempt resumes from the newest checkpoint, taking over the lock
    its first attempt left. Then that job is killed outright (batch script, Ray, supervisors and driver
    SIGKILLed: no teardown) and the same command submitted again: the new job takes over the dead driver's
    lock, resumes the run from its newest checkpoint, and sweeps what the killed job left (its node temp
    dirs, its private dir)."""
    fit = (*FAST_FIT, "--epochs", str(DEAD_HEAD_EPOCHS), "--name", "again")
    first = testbed.submit(*TWO_NODES, fit=fit)
    testbed.wait_output(first, rf"^epoch +2/{DEAD_HEAD_EPOCHS} ", timeout=300)
    gcs = ray_processes(first, "node1", ("gcs_server",))
    assert gcs, "no GCS of the job on node1"
    for pid in gcs:
        os.kill(pid, signal.SIGKILL)
    out = testbed.wait_output(first, r"requeueing job", timeout=120)
    assert re.search(r"raytrain: error: Ray on node1 exited; the cluster is broken", out), out
    assert "driver exited with status 76" in out, out
    resuming = rf"^run: \S+/again: resuming from (epoch_\d{{4}}) \(epoch (\d+) of {DEAD_HEAD_EPOCHS} done\)$"
    out = testbed.wait_output(first, rf"(?ms){resuming}.*^epoch +\d+/", timeout=400)  # the second attempt's first
    assert testbed.job(first)["Restarts"] == "1", out
    requeued = re.search(resuming, out, re.M)
    assert requeued and int(requeued.group(2)) >= 2, out
    reached = max(int(e) for e in re.findall(r"^epoch +(\d+)/", out[requeued.end() :], re.M))
    taken = rf"^run: taking over the lock of pid \d+ on node1 \(job {first}, since \w+\): it is attempt 0 of this job"
    assert re.search(rf"{taken}, {first}, which Slurm ended before it started attempt 1$", out, re.M), out

    # The OOM killer, or a reboot that keeps /tmp: no teardown runs. The driver goes first: once the batch
    # script is dead, Slurm would SIGTERM the driver, which then lets go of its lock the orderly way.
    victims = ray_processes(first, "node1", ("-m raytrain fit",))
    assert victims, "no driver of the job on node1"
    for node in ("node1", "node2"):
        victims += ray_processes(first, node, ("",))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    testbed.wait_done(first, timeout=120)
    second = testbed.submit(*TWO_NODES, fit=fit)  # the same command
    info = testbed.wait_done(second, timeout=600)
    out = testbed.output(second)
    assert info["JobState"] == "COMPLETED" and exit_code(info) == 0, out
    resumed = re.search(resuming, out, re.M)
    assert resumed and int(resumed.group(2)) >= reached, (reached, out)  # the epochs the second attempt reported
    gone = rf"(pid \d+ is no longer running on node1|its Slurm job {first} has ended)"
    assert re.search(rf"^run: taking over the lock of pid \d+ on node1 \(job {first}, since \w+\): {gone}$", out, re.M)
    swept = f"removed the Ray temp dirs of your ended jobs {first} (killed before their teardown)"
    logs = testbed.log_dir(second)
    assert all(swept in (logs / f"{role}-{n}.log").read_text() for role, n in WORKER_LOGS), out
    result = json.loads((testbed.work / "runs/again/result.json").read_text())
    assert result["status"] == "completed" and result["epochs_completed"] == DEAD_HEAD_EPOCHS
    assert Path(result["resumed_from"]["checkpoint"]).name == resumed.group(1)
    assert_cleaned_up(first)
    assert_cleaned_up(second)


WORKER_LOGS = (("head", "node1"), ("worker", "node2"))
