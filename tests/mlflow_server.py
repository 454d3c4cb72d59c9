"""A real MLflow tracking server for the tests, as a site runs one: MLflow's own ``mlflow server`` with a
SQLite backend and artifacts it serves itself. It runs from its own environment (``.mlflow-server``, built by
``make test``): the full MLflow package pins a pyarrow older than raytrain's, and raytrain's ``[mlflow]``
extra is its client (mlflow-skinny) alone."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from raytrain import waits
from tests.conftest import REPO

SERVER = REPO / ".mlflow-server" / "bin" / "mlflow"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextlib.contextmanager
def running(workdir: Path) -> Iterator[str]:
    """A tracking server on a free loopback port, until the block ends; its URL."""
    assert SERVER.exists(), f"{SERVER} is missing: make test builds it (the MLflow server's own environment)"
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log = workdir / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                str(SERVER),
                "server",
                "--host=127.0.0.1",
                f"--port={port}",
                f"--backend-store-uri=sqlite:///{workdir / 'mlflow.db'}",
                f"--artifacts-destination={workdir / 'artifacts'}",
                "--workers=1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            # Tracking only: no server-side job runner, whose eight pollers (Huey consumers) took ~90 s of CPU
            # over a run of the suite, about 1 s a minute, from tests that never use them.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            start_new_session=True,  # its own process group: MLflow starts the web server as a child
        )
    try:
        up = waits.until(lambda: server.poll() is not None or _healthy(port), timeout_s=120, every_s=0.5)
        assert up and server.poll() is None, f"the MLflow server did not start:\n{log.read_text()[-3000:]}"
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # a test server: nothing to flush that SQLite has not
        server.wait()
