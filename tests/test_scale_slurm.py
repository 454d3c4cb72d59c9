"""`raytrain fit --workers 16` on 4 testbed nodes of 4 CPUs, as a user submits it from the login node: the
allocation sized by `--slurm`, world size 16 with 4 ranks on every node as planned, metrics over all 16, and
Slurm's time-limit signal -> checkpoint mid-epoch -> requeue -> resume exactly where it stopped. The job runs
in the testbed's Podman image (`--container`, tests/container_image.py): every attempt's Ray and driver
inside it, and no container left after the job. Its Ray has no drain-node (the flag file tells the training),
and node4's first start of Ray fails (as a raylet whose dashboard agent is slow does): it starts again."""

from __future__ import annotations

import collections
import json
import re
import time
from pathlib import Path

import pytest

from raytrain.contracts.result import RunResult
from tests import container_image
from tests.conftest import SMALL_MODEL
from tests.slurm_util import STUCK_RAY, Testbed, assert_cleaned_up, exit_code

pytestmark = pytest.mark.slurm
EPOCHS = 6  # ~8 s each: the flag, written at once, reaches the loop of 16 ranks on 2 cores within ~10 s
# A small torchvision model at the digits' 8 px keeps 16 gloo ranks on a 2-core machine inside CI's time.
SIXTEEN = (
    *("--workers", "16", "--device", "cpu", "--model", SMALL_MODEL, "--image-size", "8"),
    *("--batch-size", "16", "--epochs", str(EPOCHS), "--storage", "runs", "--name", "sixteen"),
)
PLAN_ROW = re.compile(r"^  (\d+) +(node\d+) +(10\.77\.0\.\d+) +cpu$", re.M)


def test_sixteen_workers_on_four_nodes_train_and_resume_after_the_time_limit_signal(
    testbed: Testbed, podman_image: tuple[str, dict[str, str]]
) -> None:
    tag, settings = podman_image
    image = ("--container", tag, "--container-runtime", "podman")
    fails_once = testbed.work / "node4-fails-once"
    fails_once.touch()
    faults = {
        "RAYTRAIN_RAY_BIN": STUCK_RAY,
        "RAYTRAIN_TEST_NO_DRAIN": "1",  # a Ray without drain-node
        **{"RAYTRAIN_TEST_BAD_NODE": "node4", "RAYTRAIN_TEST_BAD_HOW": "exit-once"},
        "RAYTRAIN_TEST_BAD_WHILE": str(fails_once),
    }
    since = time.time()
    out = testbed.raytrain(
        "fit", "--slurm", *image, *SIXTEEN, "--", "--time=15", env={**settings, **faults}, timeout=400
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Sized by the placement plan's rules: a worker per CPU, sharing one CPU a node with data loading.
    submitted = re.search(
        r"^submitted job (\d+) \(--ntasks-per-node=1 --nodes=4 --gpus-per-node=0 --cpus-per-task=4\)", out.stdout, re.M
    )
    assert submitted, out.stdout
    job = submitted[1]
    assert re.match(rf"epoch +1/{EPOCHS} ", out.stdout.splitlines()[-2]), out.stdout

    testbed.run("scancel", "--signal=USR2", "--batch", job)  # what --signal=B:USR2@T delivers
    first = testbed.wait_output(job, r"requeueing job", timeout=120)
    assert "driver exited with status 75" in first, first
    assert "ray drain-node failed (Error: No such command 'drain-node'.)" in first, first
    assert re.search(r"stopped after \d+ batches: the job is ending \(flag-file\)", first), first
    node4 = (testbed.log_dir(job) / "worker-node4.log").read_text()
    assert "ray_that_fails_on: exit-once on node4" in node4, node4
    assert "worker node4: Ray exited with status 1 before this node joined; starting it again (2 of 3)" in node4
    assert not fails_once.exists()
    stopped_at = first.split("preempted: checkpoint ")[1].split()[0]
    info = testbed.wait_done(job, timeout=600)  # Slurm holds a requeued job back for cred_expire (testbed: 10 s)
    log = testbed.output(job)
    assert info["JobState"] == "COMPLETED" and exit_code(info) == 0 and info["Restarts"] == "1", log
    assert info["NumNodes"] == "4" and info["TimeLimit"] == "00:15:00", info
    assert f"resuming from {stopped_at} " in log, log
    assert log.count(f"every Ray process and driver runs in {tag} (podman)") == 2, log

    result = RunResult.from_json(json.loads((testbed.work / "runs/sixteen/result.json").read_text()))
    assert result.status == "completed" and result.world_size == 16 and result.epochs_completed == EPOCHS
    # Ranks 0-15, four on every node, exactly where the plan each attempt printed put them.
    assert collections.Counter(p.hostname for p in result.placement) == {f"node{i}": 4 for i in range(1, 5)}
    placed = [(str(p.rank), p.hostname, p.ip) for p in sorted(result.placement, key=lambda p: p.rank)]
    plans = PLAN_ROW.findall(log)
    assert len(plans) == 2 * 16 and plans[:16] == plans[16:] == placed, plans
    # The second attempt starts where the first stopped: nothing trained is lost, nothing trained twice.
    assert result.resumed_from and Path(result.resumed_from["checkpoint"]).name == stopped_at
    assert result.epochs_this_attempt == EPOCHS - result.resumed_from["epoch"]
    # Metrics are all-reduced over the 16 ranks: each whole epoch counts every training row, not one rank's
    # share (the resumed epoch counts the rows it had left).
    rows = int(re.search(r"^data: \S+: (\d+) rows \(~20% held out", log, re.M)[1])  # type: ignore[index]
    full = [h["train_samples"] for h in result.history if h["epoch"] > result.resumed_from["epoch"] + 1]
    assert all(h["train_samples"] > 0 for h in result.history), result.history
    assert full and all(0.75 * rows <= n <= 0.85 * rows for n in full), (rows, full)
    assert (Path(result.last_checkpoint or "") / "state.pt").is_file()
    assert_cleaned_up(job)
    started = container_image.started(settings, job, since)
    ray = {(c.attempt, c.role) for c in started if c.role.startswith("ray-")}
    assert ray == {(attempt, f"ray-{role}") for attempt in (0, 1) for role in ("head", "worker")}, started
    assert container_image.left(settings, job) == []
