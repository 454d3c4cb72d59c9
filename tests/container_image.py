"""The testbed's container image, built from Debian's own packages and run by Debian's Podman.

A minimal Debian 12 system with Debian's python3 (``mmdebstrap``), imported with ``podman import``. This
checkout's virtualenv (torch, Ray, raytrain) is bound in at run time (``RAYTRAIN_CONTAINER_MOUNTS``) and
made importable by the image's own python3 through a ``.pth`` file baked into the image, so the image's
interpreter, not the host's, runs every process. Built once per checkout (its tag names the virtualenv's
path and what the image holds) and reused by later runs, which keeps CI within its time.
"""

from __future__ import annotations

import hashlib
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

from raytrain import waits
from tests.conftest import REPO

PACKAGES = ("python3", "libstdc++6", "libgomp1", "procps")
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
PTH = "/usr/lib/python3/dist-packages/raytrain-testbed.pth"


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def tag() -> str:
    recipe = f"{site_packages()} {sys.version_info[:2]} {SUITE} {' '.join(PACKAGES)}"
    return f"localhost/raytrain-testbed:{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def containers_conf(path: Path) -> Path:
    """Podman's settings for the testbed's machine (``CONTAINERS_CONF``): runc, since crun refuses this
    machine's hybrid cgroups, and the rlimits the caller holds (root here lacks CAP_SYS_RESOURCE, so
    Podman's default of raising them fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    path.write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
    )
    return path


def ensure(conf: Path) -> str:
    """The image's tag, building and importing it first if Podman does not have it yet."""
    podman = shutil.which("podman")
    assert podman and shutil.which("mmdebstrap"), "the container tests need: apt-get install podman mmdebstrap runc"
    env = {"CONTAINERS_CONF": str(conf), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    name = tag()
    if subprocess.run([podman, "image", "exists", name], env=env).returncode == 0:
        return name
    pth = f"import site; site.addsitedir({site_packages()!r})"
    build = [
        "mmdebstrap",
        "--quiet",
        "--variant=essential",
        f"--include={','.join(PACKAGES)}",
        f'--customize-hook=echo {pth!r} > "$1{PTH}"',
        SUITE,
        "-",
        MIRROR,
    ]
    strap = subprocess.Popen(build, stdout=subprocess.PIPE)
    imported = subprocess.run([podman, "import", "--quiet", "-", name], stdin=strap.stdout, env=env)
    assert strap.wait() == 0 and imported.returncode == 0, "building the testbed's image failed (see above)"
    return name


def mounts() -> str:
    """What the image needs bound in: this checkout, virtualenv included."""
    return str(REPO)


def ensure_with_settings() -> tuple[str, dict[str, str]]:
    """The image's tag, and the settings that run a testbed job in it with Podman."""
    conf = containers_conf(REPO / ".testbed" / "containers.conf")
    settings = {
        "RAYTRAIN_CONTAINER_RUNTIME": "podman",
        "RAYTRAIN_CONTAINER_MOUNTS": mounts(),
        "CONTAINERS_CONF": str(conf),
        "PYTHONPATH": str(REPO),  # where tests.user_code lives (shared filesystem), inside the image too
    }
    return ensure(conf), settings


def podman(settings: dict[str, str], *args: str) -> list[str]:
    """``podman ARGS`` as the jobs run it (their configuration): its output's words."""
    out = subprocess.run(
        ["podman", *args], env={"PATH": "/usr/bin:/bin", **settings}, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


class Started(NamedTuple):
    """One container a job started, as raytrain names it: raytrain-<job>.<attempt>-<role>-<node>-<pid>."""

    attempt: int
    role: str  # check, ray-head, ray-worker, raytrain-driver, raytrain-status
    node: str


def started(settings: dict[str, str], job: str, since: float) -> list[Started]:
    """The containers JOB started, from Podman's own event log, since SINCE (a Unix time: a testbed booted
    again numbers its jobs from 1, and the log keeps the jobs of earlier boots)."""
    label, start = f"label=raytrain.job={job}", "event=start"
    filters = ("--filter", label, "--filter", start, f"--since={int(since)}")
    names = podman(settings, "events", "--stream=false", *filters, "--format={{.Name}}")
    parsed = [re.fullmatch(rf"raytrain-{job}\.(\d+)-(.+)-(node\d+)-\d+", n) for n in names]
    assert all(parsed), f"containers not named as raytrain names them: {names}"
    return [Started(int(m[1]), m[2], m[3]) for m in parsed if m]


def left(settings: dict[str, str], job: str, within_s: float = 30) -> list[str]:
    """The containers of JOB that still exist, running or not, once WITHIN_S has passed with some left. A
    ``podman run --rm`` that Slurm killed (KillWait after its SIGTERM) leaves the removal to conmon, which
    starts ``podman container cleanup --rm`` once the container's process has ended: a few seconds after
    the job's last process is gone on a loaded machine, so a container may still be there at that moment."""

    def listed() -> list[str]:
        return podman(settings, "ps", "--all", "--filter", f"label=raytrain.job={job}", "--format={{.Names}}")

    waits.until(lambda: not listed(), timeout_s=within_s, every_s=0.5)
    return listed()
