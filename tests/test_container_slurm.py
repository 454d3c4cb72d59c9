"""The whole cluster inside the user's image, for real: Debian's Podman on the 3-node testbed, running an
image built from Debian's own packages (tests/container_image.py) whose python3 is not the host's. A
serving cluster boots in it, is locked down, and takes the recipe across 3 nodes, a stock script after
`--` and `raytrain status` from the login node, each started inside the image, and scancel leaves no
container and no process; an image that cannot run the job fails it in one line before anything starts.
`raytrain fit --slurm --container` through Slurm's warning -> checkpoint -> requeue -> resume is
test_scale_slurm's job, run in this image. (Apptainer and Pyxis: their command lines, in test_container.)"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain.contracts import env
from raytrain.contracts.jobdir import job_dir
from raytrain.contracts.result import RunResult
from tests import container_image
from tests.conftest import REPO
from tests.lockdown import assert_locked_down
from tests.slurm_util import Testbed, assert_cleaned_up, exit_code, job_processes

pytestmark = pytest.mark.slurm
WHOLE_NODES = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=4")
STOCK = ("python3", "-m", "tests.user_code.stock_train", "--storage", "runs")  # the image has python3 only
SPREAD = ("--workers", "3", "--cpus-per-worker", "3")  # one worker a node
FIT = ("--device", "cpu", "--image-size", "8", *SPREAD, "--storage", "runs")


def assert_nothing_left(settings: dict[str, str], job: str) -> None:
    assert_cleaned_up(job)
    assert container_image.left(settings, job) == []


@pytest.fixture
def serving(testbed: Testbed, podman_image: tuple[str, dict[str, str]]) -> Iterator[tuple[str, float]]:
    """A serving cluster in the image, just submitted, and when (Podman's event times are whole seconds)."""
    tag, settings = podman_image
    since = time.time() - 1
    job = testbed.submit(*WHOLE_NODES, fit=("--serve",), env={**settings, env.CONTAINER.name: tag})
    try:
        yield job, since
    finally:
        testbed.run("scancel", job, check=False)


def test_a_serving_cluster_in_an_image_is_locked_down_and_runs_every_driver_inside(
    testbed: Testbed, podman_image: tuple[str, dict[str, str]], serving: tuple[str, float]
) -> None:
    tag, settings = podman_image
    (job, since), with_image = serving, {**settings, env.CONTAINER.name: tag}
    submit = ("submit", job, "--")
    recipe = testbed.raytrain(*submit, "fit", *FIT, "--epochs", "1", "--name", "in-image", env=with_image)
    assert recipe.returncode == 0 and "done: 1 epochs" in recipe.stdout, recipe.stdout + recipe.stderr
    out = testbed.output(job)
    assert f"every Ray process and driver runs in {tag} (podman)" in out, out
    result = RunResult.from_json(json.loads((testbed.work / "runs/in-image/result.json").read_text()))
    assert sorted(p.hostname for p in result.placement) == ["node1", "node2", "node3"]

    # Every Ray process of the job runs in the image: Podman marks its containers' processes, and the
    # interpreter is the image's Debian python3, not the host's.
    processes = [p for p in job_processes(job) if re.search(r"raylet|gcs_server|raytrain.launch node", p)]
    assert len(processes) >= 6, processes  # a raylet and a supervisor a node, the GCS
    for line in processes:
        pid = line.split(":")[0]
        assert b"container=podman" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"), line
    supervisors = [p for p in processes if "raytrain.launch node" in p]
    assert len(supervisors) == 3 and all(": python3 -m raytrain.launch node" in p for p in supervisors), supervisors
    token = (job_dir(job) / "token").read_text()
    assert_locked_down(testbed, job, token, trainers_expected=0)

    stock = testbed.raytrain(*submit, *STOCK, *SPREAD, "--epochs", "2", "--name", "stock", env=with_image)
    assert stock.returncode == 0 and "stock script done: epoch 2" in stock.stdout, stock.stdout + stock.stderr
    status = testbed.raytrain("status", job, env=with_image)
    assert status.returncode == 0 and re.search(r"^free: 12 of 12 CPUs", status.stdout, re.M), status.stdout

    testbed.run("scancel", job)  # Slurm's own end, not `raytrain stop`: each node's Ray stops in its image
    testbed.wait_done(job, timeout=60)
    started = container_image.started(settings, job, since)
    roles = sorted({re.sub(rf"^raytrain-{job}\.0-(.+)-node\d+-\d+$", r"\1", n) for n in started})
    # The check on every node, each node's Ray, both drivers and the status call: all in the image.
    assert roles == ["check", "ray-head", "ray-worker", "raytrain-driver", "raytrain-status"], started
    assert sum(n.startswith(f"raytrain-{job}.0-raytrain-driver-") for n in started) == 2, started
    assert_nothing_left(settings, job)


@pytest.mark.parametrize(
    ("tag", "mounts", "message"),
    [
        ("localhost/raytrain-none:1", None, r"cannot start localhost/raytrain-none:1 \(podman\) on node1: .*"),
        # Without this checkout bound in, the image's python3 has no raytrain (nor torch) at all.
        (None, "/opt", r"python3 in localhost/raytrain-testbed:\w+ \(podman\) on node1 cannot import raytrain .*"),
    ],
)
def test_an_image_that_cannot_run_the_job_fails_it_in_one_line_naming_the_node(
    testbed: Testbed, podman_image: tuple[str, dict[str, str]], tag: str | None, mounts: str | None, message: str
) -> None:
    ours, settings = podman_image
    settings = {**settings, env.CONTAINER.name: tag or ours, env.CONTAINER_MOUNTS.name: mounts or REPO.as_posix()}
    job = testbed.submit(*WHOLE_NODES, fit=("--serve",), env=settings)
    info = testbed.wait_done(job, timeout=120)
    out = testbed.output(job)
    assert info["JobState"] == "FAILED" and exit_code(info) == 2, out
    errors = [ln for ln in out.splitlines() if ln.startswith("raytrain: error: ")]
    assert len(errors) == 1 and re.match(rf"raytrain: error: {message} \(and 2 more node\(s\)\)$", errors[0]), out
    assert "head on node1" not in out  # nothing started
    assert_nothing_left(settings, job)
