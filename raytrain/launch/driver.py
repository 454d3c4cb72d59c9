"""Starting a driver on a job's cluster: any command, with the cluster's address and token auth set.

The batch script runs its driver (``raytrain fit``, a user's script) through this, and so does
``raytrain submit`` (in a Slurm step on the head), so both get the same environment: ``RAY_ADDRESS``,
token auth, the job's directory, raytrain's Ray Train callback. A stock ``ray.init()`` joins the cluster
with no change. Each driver registers itself in the job directory, for ``raytrain status``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from raytrain import processes
from raytrain.contracts import env
from raytrain.contracts.jobdir import DRIVERS, ClusterFile
from raytrain.errors import UserError
from raytrain.launch import container


def driver_env(job_dir: Path, info: ClusterFile, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus what a driver on the job's cluster needs (the token by file path only)."""
    out = dict(base)
    out.update(
        {
            env.RAY_ADDRESS.name: info.gcs_address,
            env.RAY_AUTH_MODE.name: "token",
            env.RAY_AUTH_TOKEN_PATH.name: info.token_path,
            env.JOB_DIR.name: str(job_dir),
            env.DASHBOARD_URL.name: info.dashboard_url,
            env.USAGE_STATS.name: env.USAGE_STATS.require({}),
            "PYTHONUNBUFFERED": "1",  # a driver's output is a log: lines as they come
        }
    )
    out.pop(env.RAY_AUTH_TOKEN.name, None)
    env.apply_ray_defaults(out)
    env.add_service_callback(out)
    env.never_dedup_report_lines(out)
    return out


def command(argv: Sequence[str]) -> list[str]:
    """The command to run: ``fit ...`` and ``sweep ...`` are raytrain's own, with this interpreter; anything
    else as is."""
    if not argv:
        raise UserError("no command to run: give one after --, e.g. -- python train.py, or -- fit --epochs 5")
    if argv[0] in ("fit", "sweep"):
        return [sys.executable, "-m", "raytrain", *argv]
    return list(argv)


def register(job_dir: Path, argv: Sequence[str]) -> None:
    """Note this process (about to exec the driver) in the job directory."""
    drivers = job_dir / DRIVERS
    drivers.mkdir(mode=0o700, exist_ok=True)
    entry = {"pid": os.getpid(), "host": socket.gethostname(), "command": list(argv), "started": time.time()}
    (drivers / f"{socket.gethostname()}-{os.getpid()}.json").write_text(json.dumps(entry))


def exec_driver(job_dir: Path, argv: Sequence[str]) -> None:
    """Replace this process with the driver (same pid, so signals and exit status are the driver's)."""
    try:
        info = ClusterFile.read(job_dir)
    except FileNotFoundError:
        raise UserError(
            f"no running raytrain cluster in {job_dir}: the job has ended, or its head has not started yet"
        ) from None
    cmd = command(argv)
    environ = driver_env(job_dir, info, os.environ)
    if cmd[:3] != [sys.executable, "-m", "raytrain"]:
        # A script: its own Ray Tune trials (or other actors) may start trainers, which need raytrain's
        # callback as the driver's own do (raytrain's fit and sweep hand their trials what they need).
        env.pass_to_actors(environ)
    register(job_dir, cmd)
    sys.stdout.flush()
    if (podman_run := container.anchor()) is not None:  # tied to it: see raytrain.launch.container.anchor
        sys.exit(processes.run_tied(cmd, environ, podman_run, env.STOP_GRACE.value()))
    try:
        os.execvpe(cmd[0], cmd, environ)
    except OSError as exc:
        raise UserError(f"cannot run {cmd[0]!r} on {socket.gethostname()}: {exc.strerror or exc}") from None
