"""Shared fixtures: real Parquet datasets, the CLI as a subprocess, and a real local Ray per module."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
# A torchvision model for runs that test what the service does, not what the model learns: 1.4 M parameters
# where resnet18 has 11.7 M, whose 45 MB of gradients cost gloo most of each step on a 2-core machine.
SMALL_MODEL = "shufflenet_v2_x0_5"
GOLDEN = Path(__file__).resolve().parent / "golden"

# A suite started in the background of a non-interactive shell (`make test &`, a CI runner's) inherits
# SIGINT ignored, and so would every `raytrain` it starts, which would then take no Ctrl-C until Ray Train
# installs its own handler: the commands here get a terminal's SIGINT, as a user's have.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def image_table(n: int, *, classes: int = 3, size: int = 8, seed: int = 0) -> pa.Table:
    """n distinct random RGB images (as PNG bytes) with labels cycling through the classes."""
    rng = np.random.default_rng(seed)
    blobs = [png(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]
    return pa.table({"image": pa.array(blobs, pa.binary()), "label": pa.array(np.arange(n) % classes, pa.int64())})


def write_parquet(path: Path, table: pa.Table) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def damage_a_page(path: Path, column: int, row_group: int = 1) -> None:
    """Overwrite the header of one data page of a Parquet file, leaving its footer whole (so the data check,
    which reads footers, passes)."""
    offset = pq.read_metadata(path).row_group(row_group).column(column).data_page_offset
    blob = bytearray(path.read_bytes())
    blob[offset : offset + 16] = b"\xff" * 16
    path.write_bytes(bytes(blob))


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a user outside any Slurm job or Ray cluster, plus ``env``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))}
    full_env.update(env or {})
    return full_env


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300) -> CliResult:
    """Run ``raytrain`` exactly as a user would, in a fresh interpreter."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", *args],
        cwd=cwd,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


_SPAWNED: list[subprocess.Popen[str]] = []


def spawn_cli(*args: str, stderr: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``raytrain ARGS`` in the background: its stdout a pipe to read as lines come, its stderr into a
    file (a pipe that nobody reads until the end could fill and block). It ends with its test at the latest."""
    with stderr.open("w") as err:
        cmd = [sys.executable, "-m", "raytrain", *args]
        proc = subprocess.Popen(cmd, env=cli_env(env), stdout=subprocess.PIPE, stderr=err, text=True)
    _SPAWNED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _no_command_outlives_its_test() -> Iterator[None]:
    """A test that fails while a command it spawned still runs stops it (SIGTERM: a local cluster is shut
    down), so that its run holds no CPUs of a Ray that the next test joins."""
    yield
    while _SPAWNED:
        proc = _SPAWNED.pop()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def read_until(proc: subprocess.Popen[str], prefix: str) -> str:
    """What PROC printed up to and including its first line starting with PREFIX (or all of it, at EOF)."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            break
    return "".join(seen)


def read_rest(proc: subprocess.Popen[str], timeout: float) -> str:
    """The rest of what PROC prints, until it exits within ``timeout`` seconds. Read through the same
    buffered pipe ``read_until`` reads: ``communicate(timeout=...)`` reads the raw pipe, so lines that
    ``read_until`` had already buffered would be lost."""
    stdout = proc.stdout
    assert stdout is not None
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(stdout.read()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        proc.kill()
        reader.join(30)
        raise AssertionError(f"raytrain still ran after {timeout:.0f} s; it printed: {''.join(out)}")
    proc.wait(timeout=30)
    return "".join(out)


def assert_user_error(result: CliResult, *fragments: str) -> None:
    """A user error: exit 2 within seconds, exactly one line on stderr naming the problem, no traceback."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("raytrain: error: "), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result.seconds < 30, f"took {result.seconds:.1f} s"


@contextlib.contextmanager
def _local_ray() -> Iterator[Any]:
    """A real local Ray cluster (token auth, private temp dir) started by this process: its ClusterInfo."""
    from raytrain.service import cluster

    os.environ.pop("RAY_ADDRESS", None)
    # Ray workers must import helpers defined in test modules.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with cluster.connect(dashboard=False) as info:
        yield info


@pytest.fixture(scope="module")
def ray_local() -> Iterator[object]:
    """A real local Ray cluster shared by one test module. Each module's is a new cluster with a new token
    in the same process, as a notebook that trains twice would have."""
    with _local_ray() as info:
        yield info


@pytest.fixture(scope="module")
def ray_to_join() -> Iterator[dict[str, str]]:
    """A real local Ray for one test module, and the settings with which `raytrain` commands join it, as the
    commands inside a Slurm job join the job's cluster one after another: each spends no Ray start (12 s
    here), and each finds the cluster as the runs before it, failed ones included, left it."""
    from raytrain.contracts import env

    with _local_ray() as info:
        assert info.token_path
        yield {
            env.RAY_ADDRESS.name: info.address,
            env.RAY_AUTH_MODE.name: "token",
            env.RAY_AUTH_TOKEN_PATH.name: info.token_path,
        }


def golden(name: str, actual: str) -> None:
    """Compare with tests/golden/<name>; RAYTRAIN_UPDATE_GOLDEN=1 rewrites it after a deliberate change."""
    path = GOLDEN / name
    if os.environ.get("RAYTRAIN_UPDATE_GOLDEN") == "1":
        path.write_text(actual)
    expected = path.read_text() if path.exists() else None
    assert actual == expected, (
        f"{path} differs from the output. If the change is intended, re-run this test with "
        f"RAYTRAIN_UPDATE_GOLDEN=1 and review `git diff {path.relative_to(REPO)}`.\n--- actual ---\n{actual}"
    )


@pytest.fixture(scope="session")
def testbed() -> object:
    """The Slurm testbed (tests/testbed, 4 nodes), booted once per session; it stays up for reuse."""
    from tests.slurm_util import boot_testbed

    return boot_testbed()


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A Slurm test's own jobs are cancelled once it ends, passed or failed: a job a failed test left
    running (a run of 100000 epochs, one that requeues) would hold the testbed's nodes and fail the tests
    after it on timeouts. Jobs of module fixtures, submitted before the test, are theirs to end."""
    if "slurm" not in request.keywords:
        yield
        return
    bed = request.getfixturevalue("testbed")
    before = len(bed.submitted)
    yield
    for job in bed.submitted[before:]:
        bed.run("scancel", job, check=False)


@pytest.fixture(scope="session")
def podman_image() -> tuple[str, dict[str, str]]:
    """The testbed's Podman image (tests/container_image.py, built once), and the settings that run a job
    in it: what a user exports before sbatch, less RAYTRAIN_CONTAINER, which each test sets its own way."""
    from tests import container_image

    return container_image.ensure_with_settings()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server (tests/mlflow_server.py) for the session: its URL."""
    from tests import mlflow_server

    with mlflow_server.running(tmp_path_factory.mktemp("mlflow")) as url:
        yield url
