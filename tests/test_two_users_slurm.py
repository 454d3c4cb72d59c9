"""Two real unprivileged users, rtalice and rtbob (tests/testbed), train at once on the same two nodes.
While they train, neither can read the other's token, run directory, logs, Ray temp dirs or /dev/shm
objects on any node, join the other's cluster, or block it with directories planted by the names raytrain
uses, and every endpoint of alice's job refuses requests without its token. Bob's scancel ends his job
and leaves alice's training; `raytrain cancel` ends hers, checkpointed. A run directory planted in a shared
scratch, or another user's, is refused in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from raytrain.contracts import env
from raytrain.contracts.result import EXIT_CANCELLED, RunResult
from tests.conftest import REPO
from tests.lockdown import assert_dashboard_hint, assert_locked_down, ray_default_token_mtime
from tests.slurm_util import SBATCH, SMALL_FIT, STATE, Testbed, assert_cleaned_up, exit_code, node_roots, wait_text

pytestmark = pytest.mark.slurm
HALF_NODES = ("--nodes=2", "--nodelist=node[1-2]", "--gpus-per-node=0", "--cpus-per-task=2")
# Both jobs train until their users cancel them, once the other user has probed them.
UNTIL_CANCELLED = (*SMALL_FIT, "--epochs", "100000")
NODES = ("node1", "node2")  # a head and a worker node each, of both jobs

# Run as the other user inside a node's mount namespace: every file and directory of UID under /tmp and
# /dev/shm this user can see, and those it can also read (a file) or list (a directory).
PROBE = """
import json, os, sys
uid = int(sys.argv[1]); seen, opened = [], []
for top in sys.argv[2:]:
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_uid != uid:
                continue
            seen.append(path)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.listdir(path)
                else:
                    open(path, "rb").read(1)
                opened.append(path)
            except OSError:
                pass
print(json.dumps({"seen": seen, "opened": opened}))
"""


# Run as alice: a job directory as a job killed before its teardown leaves it, on the named Slurm cluster.
PLANT_JOB_DIR = """
import os, sys
os.umask(0o077)
os.makedirs(sys.argv[1], exist_ok=True)
open(os.path.join(sys.argv[1], "token"), "w").write("0" * 64)
open(os.path.join(sys.argv[1], "slurm-cluster"), "w").write(sys.argv[2] + "\\n")
"""


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    home: Path
    work: Path  # where the user submits from (theirs, private)
    conf: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "SLURM_CONF": self.conf,
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(REPO),  # the probes' helpers (tests.lockdown)
        }

    def cmd(
        self, *argv: str, netns: str | None = None, node_pid: int | None = None, extra: dict[str, str] | None = None
    ) -> list[str]:
        """ARGV as this user, with a clean environment of theirs, plus EXTRA (inside a node's namespaces, if given)."""
        environ = {**self.env, **(extra or {})}
        inner = ["runuser", "-u", self.name, "--", "env", "-i", *[f"{k}={v}" for k, v in environ.items()], *argv]
        if node_pid is None:
            return inner
        return ["nsenter", f"--mount=/proc/{node_pid}/ns/mnt", f"--net=/run/netns/{netns}", *inner]

    def run(self, *argv: str, **where: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.cmd(*argv, **where),
            cwd=self.work,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def submit(self, *fit: str) -> str:
        proc = self.run("sbatch", "--parsable", *HALF_NODES, str(SBATCH), *fit)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def output(self, job: str) -> Path:
        return self.work / f"raytrain-{job}.out"


def user(testbed: Testbed, name: str, uid: int) -> User:
    work = testbed.work / name
    work.mkdir(exist_ok=True)
    os.chown(work, uid, uid)
    work.chmod(0o700)
    return User(name, uid, STATE / "home" / name, work, testbed.env["SLURM_CONF"])


def node_pids() -> dict[str, int]:
    return {node: int(root.parent.name) for node, root in node_roots().items()}


def probe(reader: User, owner: User, node: str, pid: int) -> dict[str, list[str]]:
    out = reader.run(
        sys.executable, "-c", PROBE, str(owner.uid), "/tmp", "/dev/shm", netns=f"rtn{node[-1]}", node_pid=pid
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def worker_environs(job: str) -> list[dict[str, str]]:
    """The environment of each Ray Train worker process of JOB, on any node."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                raw = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
                environ = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
                if environ.get("SLURM_JOB_ID") == job:
                    found.append(environ)
        except OSError:
            continue
    return found


def cannot_read(reader: User, path: Path) -> bool:
    """Whether READER is refused PATH (a file to read, a directory to list)."""
    code = "import os, sys; p = sys.argv[1]; os.listdir(p) if os.path.isdir(p) else open(p).read(1)"
    out = reader.run(sys.executable, "-c", code, str(path))
    return out.returncode != 0 and "PermissionError" in out.stderr


def test_two_users_share_the_nodes_and_neither_can_reach_the_other(testbed: Testbed) -> None:
    alice, bob = user(testbed, "rtalice", 7101), user(testbed, "rtbob", 7102)
    scratch = testbed.work / "scratch"  # a shared scratch filesystem, as /scratch is: everyone's, sticky
    scratch.mkdir(exist_ok=True)
    scratch.chmod(0o1777)
    pids = node_pids()

    # Before alice's job: bob takes the names raytrain would use on node1 for alice's port locks and
    # torch's default compile cache, and plants a run in the scratch, open to all, with an index of his.
    planted_locks, planted_cache = f"/tmp/raytrain-ports-{alice.uid}", "/tmp/torchinductor_rtalice"
    for path in (planted_locks, planted_cache):
        made = bob.run("mkdir", "-m", "777", "-p", path, netns="rtn1", node_pid=pids["node1"])
        assert made.returncode == 0, made.stderr
    assert bob.run("mkdir", "-m", "777", str(scratch / "planted")).returncode == 0
    # What alice's jobs SIGKILLed before their teardown leave: her next job removes this cluster's, and only those.
    states = alice.home / ".raytrain/jobs"
    stale, foreign = states / "990001", states / "990002"
    for path, cluster in ((stale, "rttestbed"), (foreign, "another-cluster")):
        assert alice.run(sys.executable, "-c", PLANT_JOB_DIR, str(path), cluster).returncode == 0
    ray_token = ray_default_token_mtime(alice.home)

    jobs = {
        u.name: u.submit(*UNTIL_CANCELLED, "--storage", str(scratch), "--name", f"exp-{u.name}") for u in (alice, bob)
    }
    try:
        for u in (alice, bob):
            wait_text(u.output(jobs[u.name]), r"^epoch +1/100000 ", timeout=400)  # Ray and torch run on every node
        info = {
            u.name: json.loads((u.home / ".raytrain/jobs" / jobs[u.name] / "cluster.json").read_text())
            for u in (alice, bob)
        }
        a, b = testbed.job(jobs["rtalice"]), testbed.job(jobs["rtbob"])
        assert a["JobState"] == b["JobState"] == "RUNNING" and a["NodeList"] == b["NodeList"] == "node[1-2]"
        assert not stale.exists() and (foreign / "token").exists()
        hers = alice.output(jobs["rtalice"]).read_text()
        assert f"removed the private directories of ended jobs {stale.name} " in hers, hers
        assert_locked_down(testbed, jobs["rtalice"], states / jobs["rtalice"], trainers_expected=2)
        hint = alice.run(sys.executable, "-m", "raytrain", "dashboard", jobs["rtalice"])
        assert_dashboard_hint(hint.stdout, hers, states / jobs["rtalice"])
        for reader, owner in ((bob, alice), (alice, bob)):
            job, cluster = jobs[owner.name], info[owner.name]
            token = owner.home / ".raytrain/jobs" / job / "token"
            # The token, the run, the logs: refused on the shared filesystem.
            for path in (token, token.parent, scratch / f"exp-{owner.name}", owner.work, Path(cluster["log_dir"])):
                assert cannot_read(reader, path), path
            # Ray's temp dirs, caches and shared memory on every node: seen at most, opened never.
            for node, pid in pids.items():
                if node not in NODES:
                    continue
                found = probe(reader, owner, node, pid)
                opened = [p for p in found["opened"] if p not in (planted_locks, planted_cache)]  # bob's, left open
                assert opened == [], (node, opened)
                assert any(re.search(rf"/tmp/rt{job}\.0\.", p) for p in found["seen"]), (node, found["seen"])
                assert not any(p.startswith(planted_cache + "/") for p in found["seen"]), found["seen"]
            # The other's cluster: no token, no entry.
            code = "from tests.lockdown import gcs_call; import sys; print(gcs_call(sys.argv[1], None))"
            joined = reader.run(
                sys.executable, "-c", code, cluster["gcs_address"], netns="rtn1", node_pid=pids["node1"]
            )
            assert joined.stdout.strip() == "UNAUTHENTICATED", joined.stdout + joined.stderr
        # Alice's training workers write their temp files and torch's and Triton's caches into her private dirs,
        # not into the /tmp/torchinductor_rtalice bob planted.
        workers = worker_environs(jobs["rtalice"])
        assert len(workers) == 2, workers
        for environ in workers:
            assert re.fullmatch(rf"/tmp/rt{jobs['rtalice']}\.0\.\w+/tmp", environ["TMPDIR"]), environ["TMPDIR"]
            assert environ["TORCHINDUCTOR_CACHE_DIR"] == f"/tmp/raytrain-cache-{alice.uid}/torchinductor"
            assert environ["TRITON_CACHE_DIR"] == f"/tmp/raytrain-cache-{alice.uid}/triton"
        # The planted lock directory did not block alice: her job claimed a block by probing, elsewhere than bob's.
        head_log = Path(info["rtalice"]["log_dir"]) / "head-node1.log"
        assert f"{planted_locks} is not a private directory of yours (owner uid 7102 (rtbob)" in head_log.read_text()
        blocks = [range(c["ports"]["gcs"], c["ports"]["max_worker"] + 1) for c in info.values()]
        assert not set(blocks[0]) & set(blocks[1])

        # Bob's scancel ends his job, cleanly and with his token in none of its output and logs; alice's trains on.
        bob_token = (bob.home / ".raytrain/jobs" / jobs["rtbob"] / "token").read_text().strip()
        assert bob.run("scancel", jobs["rtbob"]).returncode == 0
        assert testbed.wait_done(jobs["rtbob"], timeout=60)["JobState"] == "CANCELLED"
        assert_cleaned_up(jobs["rtbob"])
        out = bob.output(jobs["rtbob"]).read_text()
        assert "SIGTERM: the job was cancelled" in out, out
        assert "SIGTERM received" not in out and "Traceback" not in out  # no stack dumps from Ray or raytrain
        assert bob_token not in out
        for path in Path(info["rtbob"]["log_dir"]).rglob("*"):
            if path.is_file() and path.stat().st_size < 20_000_000:
                assert bob_token.encode() not in path.read_bytes(), path
        assert not (bob.home / ".raytrain/jobs" / jobs["rtbob"]).exists()  # his token went with the job
        trained = len(re.findall(r"^epoch +\d+/", alice.output(jobs["rtalice"]).read_text(), re.M))
        hers = wait_text(alice.output(jobs["rtalice"]), rf"^epoch +{trained + 1}/100000 ", timeout=120)
        assert "workers failed" not in hers, hers  # her run went on untouched, not restarted

        # Bob cannot end alice's run, even pointed at her jobs' directory; she ends her own: it checkpoints
        # and her job ends with the driver's status.
        cancel = (sys.executable, "-m", "raytrain", "cancel")
        refused = bob.run(*cancel, jobs["rtalice"], "exp-rtalice", extra={env.STATE_DIR.name: str(states)})
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
            f"raytrain: error: job {jobs['rtalice']} is rtalice's, not yours: raytrain reaches the clusters of your "
            "own jobs only (squeue --me lists them)"
        ], refused.stdout + refused.stderr
        ended = alice.run(*cancel, jobs["rtalice"], "exp-rtalice")
        assert ended.returncode == 0 and "run 'exp-rtalice': ended" in ended.stdout, ended.stdout + ended.stderr
        done = testbed.wait_done(jobs["rtalice"], timeout=120)
        out = alice.output(jobs["rtalice"]).read_text()
        assert exit_code(done) == EXIT_CANCELLED and done["Restarts"] == "0", out  # ended, not requeued
        assert "the driver's run was cancelled (raytrain cancel); the job ends" in out, out
        assert re.search(r"cluster: all 2 nodes joined, [\d.]+ s after the job started", out), out
        result = RunResult.from_json(json.loads((scratch / "exp-rtalice" / "result.json").read_text()))
        assert result.status == "cancelled" and result.epochs_completed >= 1, result
        assert (Path(result.last_checkpoint or "") / "state.pt").is_file(), result
        assert result.world_size == 2 and {p.hostname for p in result.placement} == set(NODES), result
        logs = Path(info["rtalice"]["log_dir"])
        assert {p.name for p in logs.glob("*.log")} == {"head-node1.log", "worker-node2.log"}
        assert (logs / "ray-head-node1").is_dir()  # Ray's own logs, kept from the node-local temp dir
    finally:
        for job in jobs.values():
            testbed.run("scancel", job, check=False)
        for planted in (stale, foreign):
            shutil.rmtree(planted, ignore_errors=True)
    for job in jobs.values():
        assert_cleaned_up(job)
    assert ray_default_token_mtime(alice.home) == ray_token  # her jobs never wrote Ray's shared token

    # Subverting a run: a planted one is refused, and so is another user's, even once opened to all.
    fit = (sys.executable, "-m", "raytrain", "fit", "--dry-run", "--storage", str(scratch))
    planted = alice.run(*fit, "--name", "planted")
    assert planted.returncode == 2 and "belongs to uid 7102 (rtbob), not to you" in planted.stderr, planted.stderr
    assert alice.run("chmod", "-R", "a+rwX", str(scratch / "exp-rtalice")).returncode == 0
    theirs = bob.run(*fit, "--name", "exp-rtalice")
    assert theirs.returncode == 2 and "belongs to uid 7101 (rtalice), not to you" in theirs.stderr, theirs.stderr
    own = alice.run(*fit, "--name", "exp-rtalice")
    assert own.returncode == 2 and "is writable by other users (mode 777)" in own.stderr, own.stderr
    assert len([ln for ln in theirs.stderr.splitlines() if ln.strip()]) == 1
