"""An image that cannot run the job fails it in one line naming the node, before any Ray process starts:
Debian's Podman on the 3-node testbed, with the image built from Debian's own packages
(tests/container_image.py). The cluster itself in that image: test_service_slurm's serving cluster (drivers
in turn and at once, status, lockdown, scancel leaving no container and no process) and test_scale_slurm's
`raytrain fit --slurm --container` through Slurm's warning -> checkpoint -> requeue -> resume. Apptainer and
Pyxis: their command lines, in test_container."""

from __future__ import annotations

import re

import pytest

from raytrain.contracts import env
from tests import container_image
from tests.conftest import REPO
from tests.slurm_util import WHOLE_NODES, Testbed, assert_cleaned_up, exit_code

pytestmark = pytest.mark.slurm


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
    assert_cleaned_up(job)
    assert container_image.left(settings, job) == []
