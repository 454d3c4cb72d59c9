"""`sbatch slurm/ray_cluster.sbatch sweep ...` on 3 testbed nodes: two trials at once, Slurm's time-limit
warning in the middle (the running trials checkpoint), the requeue, and the sweep finishing on the next
attempt with every trial's history whole: each epoch trained once. Its Ray has no drain-node, so the
training learns of the warning from the flag file at once (a drain is test_service_slurm's). A trial that
would start as the job ends waits for the next attempt: tests/test_sweep.py."""

from __future__ import annotations

import json
import re

import pytest

from raytrain.contracts import rundir, sweepdir
from raytrain.contracts.result import RunResult
from tests.conftest import SMALL_MODEL
from tests.slurm_util import STUCK_RAY, Testbed, assert_cleaned_up, exit_code

pytestmark = pytest.mark.slurm
EPOCHS, TRIALS = 6, 2  # epochs of 2-4 s: the flag reaches a trial's loop within one or two
SWEEP = (
    *("sweep", "--param", "lr=loguniform:0.005:0.1", "--trials", str(TRIALS), "--workers", "1", "--concurrent", "2"),
    *("--device", "cpu", "--image-size", "8", "--model", SMALL_MODEL, "--epochs", str(EPOCHS)),
    *("--scheduler", "none", "--storage", "runs", "--name", "swept"),
)


def test_a_sweep_across_three_nodes_checkpoints_on_the_warning_requeues_and_finishes_every_trial(
    testbed: Testbed,
) -> None:
    no_drain = {"RAYTRAIN_RAY_BIN": STUCK_RAY, "RAYTRAIN_TEST_NO_DRAIN": "1"}
    job = testbed.submit("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=4", "--time=15", fit=SWEEP, env=no_drain)
    first = testbed.wait_output(job, r"^sweep: trial_\d{5} epoch 1 ", timeout=300)
    assert f"sweep: {TRIALS} trial(s) of lr=loguniform:0.005:0.1; 2 at once, each 1 worker(s) x 1 CPU" in first
    testbed.run("scancel", "--signal=USR2", "--batch", job)  # what --signal=B:USR2@T delivers
    ending = testbed.wait_output(job, r"requeueing job", timeout=240)
    assert "driver exited with status 75" in ending and "ray drain-node failed" in ending, ending
    assert "sweep: not finished; run the same command again" in ending, ending
    info = testbed.wait_done(job, timeout=600)
    log = testbed.output(job)
    assert info["JobState"] == "COMPLETED" and exit_code(info) == 0 and info["Restarts"] == "1", log
    assert "resuming (finished trials kept, stopped ones stay stopped)" in log, log

    root = testbed.work / "runs" / "swept"
    records = [sweepdir.TrialRecord.from_json(r) for r in json.loads((root / sweepdir.TRIALS).read_text())]
    assert sorted(r.name for r in records) == [sweepdir.trial_name(i) for i in range(TRIALS)], records
    assert {r.status for r in records} == {"completed"}, records
    resumed = 0
    for r in records:
        run = root / sweepdir.RUNS / r.name
        result = RunResult.from_json(json.loads((run / rundir.RESULT).read_text()))
        assert result.status == "completed" and result.epochs_completed == EPOCHS and result.world_size == 1
        history = [json.loads(line)["metrics"] for line in (run / rundir.HISTORY).read_text().splitlines()]
        whole = [m["epoch"] for m in history if "preempted" not in m]
        assert whole == list(range(1, EPOCHS + 1)), (r.name, history)  # every epoch once, none twice
        resumed += result.resumed_from is not None
    # The warning came while trials trained: at least one stopped with a checkpoint and went on from it.
    assert resumed >= 1 and re.search(r"^sweep: trial_\d{5} preempted: ", log, re.M), log
    assert_cleaned_up(job)
