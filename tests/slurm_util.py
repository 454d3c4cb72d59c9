"""Submitting jobs to the Slurm testbed and checking what they leave behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from raytrain import waits
from raytrain.contracts import jobdir
from tests.conftest import REPO, SMALL_MODEL

TESTBED = REPO / "tests/testbed/testbed.py"
STATE = REPO / ".testbed"
SBATCH = REPO / "slurm/ray_cluster.sbatch"
# Slurm job states that are final (a requeued job passes through COMPLETING and REQUEUED to PENDING instead).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
STUCK_RAY = str(REPO / "tests/testbed/ray_that_fails_on.sh")  # RAYTRAIN_RAY_BIN: a Ray that fails on one node
# `raytrain fit` options for testbed runs that check the service: a small model at the digits' 8 px, a CPU a
# worker; FAST_FIT's checkpoints under the testbed's shared work directory.
SMALL_FIT = ("--device", "cpu", "--image-size", "8", "--model", SMALL_MODEL, "--cpus-per-worker", "1")
FAST_FIT = (*SMALL_FIT, "--storage", "runs")
# sbatch options for jobs on whole testbed nodes (4 CPUs, no GPU): all three, or a head and a worker node,
# which show all that a job's nodes do in the tests that need no third.
WHOLE_NODES = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=4")
TWO_NODES = ("--nodes=2", "--gpus-per-node=0", "--cpus-per-task=4")


@dataclass
class Testbed:
    __test__ = False  # a fixture value, not a test class

    env: dict[str, str]
    work: Path  # a directory on the "shared filesystem" (nodes have private /tmp)
    submitted: list[str] = field(default_factory=list)  # every job submit() made, in order

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, cwd=self.work)

    def submit(self, *sbatch_opts: str, fit: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
        """sbatch the batch script; FIT: its arguments (fit options, `--serve`, or `-- COMMAND`).

        A job of K nodes runs on node1..nodeK, as the tests expect, even while the testbed has more nodes idle
        (a node still completing the previous job is waited for, not swapped for another)."""
        nodes = next((o.split("=", 1)[1] for o in sbatch_opts if o.startswith("--nodes=")), None)
        if nodes and not any(o.startswith(("--nodelist", "-w")) for o in sbatch_opts):
            sbatch_opts = (*sbatch_opts, f"--nodelist=node[1-{nodes}]")
        proc = subprocess.run(
            ["sbatch", "--parsable", *sbatch_opts, str(SBATCH), *fit],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            cwd=self.work,
        )
        assert proc.returncode == 0, proc.stderr
        job = proc.stdout.strip().split(";")[0]
        self.submitted.append(job)
        return job

    def job(self, job_id: str, *, check: bool = True) -> dict[str, str]:
        """The job's fields as scontrol shows them; with ``check`` False, none when scontrol fails."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=check).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        def reached() -> dict[str, str] | None:
            info = self.job(job_id)
            return info if info.get("JobState") in states else None

        if (info := waits.until(reached, timeout_s=timeout, every_s=0.5)) is not None:
            return info
        raise AssertionError(
            f"job {job_id} not in {states} after {timeout} s: {self.job(job_id)}\n{self.output(job_id)}"
        )

    def wait_done(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        return self.wait_state(job_id, ENDED, timeout)

    def wait_output(self, job_id: str, pattern: str, timeout: float) -> str:
        """The job's output once it matches PATTERN; an AssertionError at TIMEOUT, or as soon as the job has
        ended without it (a job that failed to start is not waited on for minutes)."""
        path = self.work / f"raytrain-{job_id}.out"
        checks = 0

        def still_running() -> bool:
            nonlocal checks
            checks += 1
            if checks % 10:  # scontrol every 5 s; a busy slurmctld or a job aged out of it: still waited on
                return True
            return self.job(job_id, check=False).get("JobState") not in ENDED

        return wait_text(path, pattern, timeout, still_running)

    def output(self, job_id: str) -> str:
        path = self.work / f"raytrain-{job_id}.out"
        return path.read_text() if path.exists() else ""

    def raytrain(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """`raytrain ARGS` on the login node (the root namespace), as a user types it there."""
        cmd = [sys.executable, "-m", "raytrain", *args]
        full_env = {**self.env, **(env or {})}
        return subprocess.run(cmd, env=full_env, capture_output=True, text=True, cwd=self.work, timeout=timeout)

    def spawn_raytrain(self, *args: str, out: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """`raytrain ARGS` in the background, its stdout and stderr into OUT."""
        with out.open("w") as f:
            return subprocess.Popen(
                [sys.executable, "-m", "raytrain", *args],
                env={**self.env, **(env or {})},
                cwd=self.work,
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
            )

    def log_dir(self, job_id: str, attempt: int = 0) -> Path:
        return self.work / "raytrain-logs" / job_id / f"attempt-{attempt}"


def wait_text(path: Path, pattern: str, timeout: float, going: Callable[[], bool] = lambda: True) -> str:
    """The text of PATH once PATH matches PATTERN (a regex, multi-line), or an AssertionError at TIMEOUT or
    once ``going()`` (asked after each look that found no match) says that what writes PATH has ended."""
    text = ""

    def look() -> str | None:
        nonlocal text
        text = path.read_text() if path.exists() else ""
        if re.search(pattern, text, re.M):
            return "found"
        if not going():
            text = path.read_text() if path.exists() else ""  # what it wrote as it ended
            return "found" if re.search(pattern, text, re.M) else "ended"
        return None

    outcome = waits.until(look, timeout_s=timeout, every_s=0.5)
    if outcome == "found":
        return text
    why = "its writer ended without it" if outcome == "ended" else f"after {timeout} s"
    raise AssertionError(f"{pattern!r} not in {path} ({why}):\n{text}")


def exit_code(info: dict[str, str]) -> int:
    return int(info["ExitCode"].split(":")[0])


def node_roots() -> dict[str, Path]:
    """Each simulated node's filesystem view (its private /tmp) through /proc/<pid>/root."""
    pids = json.loads((STATE / "pids.json").read_text())["daemons"][1:]
    return {f"node{i}": Path(f"/proc/{pid}/root") for i, pid in enumerate(pids, start=1)}


def job_processes(job_id: str) -> list[str]:
    """Live (non-zombie) processes anywhere on the machine that belong to a Slurm job's Ray or driver."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "State:\tZ" in status:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and re.search(r"ray|raytrain|gcs_server|raylet", cmdline):
            found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def leftovers(job_id: str) -> list[str]:
    """What a job left behind: live processes on any node, node-local temp dirs, its token directory."""
    left = job_processes(job_id)
    for node, root in node_roots().items():
        left += [f"{node}:/tmp/{p.name}" for p in (root / "tmp").glob(f"rt{job_id}.*")]
    private = jobdir.job_dir(job_id)
    if private.exists():
        left.append(str(private))
    return left


def assert_cleaned_up(job_id: str, within_s: float = 30) -> None:
    """Nothing of the job left once its teardown is over (Slurm shows CANCELLED before it finishes)."""
    waits.until(lambda: not leftovers(job_id), timeout_s=within_s, every_s=0.5)
    assert not (left := leftovers(job_id)), f"job {job_id} left: {left}"


def boot_testbed() -> Testbed:
    """Boot the testbed (idempotent) and a shared work directory for one test session."""
    subprocess.run([sys.executable, str(TESTBED), "up"], check=True)
    env = dict(os.environ, SLURM_CONF=str(STATE / "slurm.conf"))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.pop("RAY_ADDRESS", None)
    work = STATE / "work" / str(os.getpid())
    work.mkdir(parents=True, exist_ok=True)
    return Testbed(env=env, work=work)
