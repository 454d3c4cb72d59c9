"""A real multi-node Slurm cluster on one machine, for end-to-end tests of slurm/ray_cluster.sbatch.

    python tests/testbed/testbed.py up      # boot (idempotent): munge, slurmctld, N slurmd nodes
    python tests/testbed/testbed.py down    # tear down (idempotent): every process, netns and hosts entry
    python tests/testbed/testbed.py env     # the SLURM_CONF line a shell needs to use it

Each node is its own network namespace (veth on a bridge), hostname, /tmp and /dev/shm, and runs
slurmd; everything else in the filesystem is shared, playing the part of NFS. Nodes have 4 CPUs and
two fake GPUs each (GRES backed by character devices). The root namespace is the login node.
Two unprivileged users, rtalice and rtbob (homes under .testbed/home), submit jobs of their own; for
them the path to this checkout and to its interpreter is made traversable (o+x, never readable).
Requires root and Debian's munge, slurmctld, slurmd, slurm-client and iproute2.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("RAYTRAIN_TESTBED_DIR", REPO / ".testbed"))
CONF = STATE / "slurm.conf"
NODES = int(os.environ.get("RAYTRAIN_TESTBED_NODES", "4"))
SUBNET = os.environ.get("RAYTRAIN_TESTBED_SUBNET", "10.77.0")
BRIDGE = "rtbr0"
CPUS, GPUS = 4, 2
HOSTS_BEGIN, HOSTS_END = "# raytrain-testbed begin", "# raytrain-testbed end"
PIDS = STATE / "pids.json"
USERS = {"rtalice": 7101, "rtbob": 7102}  # unprivileged users of the cluster, uid each (their group: the same id)
HOMES = STATE / "home"


def node_ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def slurm_conf() -> str:
    nodes = "\n".join(
        f"NodeName=node{i} NodeAddr={node_ip(i)} CPUs={CPUS} RealMemory=4000 Gres=gpu:{GPUS} State=UNKNOWN"
        for i in range(1, NODES + 1)
    )
    return f"""ClusterName=rttestbed
SlurmctldHost=slurmctl({SUBNET}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire before it starts again (default 120 s; at least 5): the tests that
# requeue wait less. A step's credential lives as long, ample for a launch on one host.
AuthInfo=cred_expire=10
StateSaveLocation={STATE}/ctld
SlurmdSpoolDir={STATE}/spool/%n
SlurmctldPidFile={STATE}/slurmctld.pid
SlurmdPidFile={STATE}/slurmd-%n.pid
SlurmctldLogFile={STATE}/log/slurmctld.log
SlurmdLogFile={STATE}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
# SIGKILL 15 s after a step's SIGTERM (Slurm's default: 30 s). 5 s was less than a busy 2-core testbed needs
# to stop a head's Ray and keep its logs, which left the job's temp dir to the next job's sweep.
KillWait=15
MinJobAge=600
ReturnToService=2
MailProg=/bin/true
SchedulerParameters=bf_interval=1,sched_interval=1
{nodes}
PartitionName=debug Nodes=node[1-{NODES}] Default=YES MaxTime=INFINITE State=UP
"""


def gres_conf() -> str:
    files = ",".join(f"/dev/rtfakegpu{g}" for g in range(GPUS))
    return f"AutoDetect=off\nNodeName=node[1-{NODES}] Name=gpu File={files}\n"


def set_hosts(entries: list[str]) -> None:
    """Rewrite the marked block of /etc/hosts in place (it may be a bind mount: never replace the file)."""
    lines = Path("/etc/hosts").read_text().splitlines()
    if HOSTS_BEGIN in lines:
        start, end = lines.index(HOSTS_BEGIN), lines.index(HOSTS_END)
        lines = lines[:start] + lines[end + 1 :]
    if entries:
        lines += [HOSTS_BEGIN, *entries, HOSTS_END]
    with open("/etc/hosts", "w") as f:
        f.write("\n".join(lines) + "\n")


def node_namespaces() -> set[str]:
    """The testbed node namespaces that exist now, whatever node count booted them."""
    return set(re.findall(r"^(rtn\d+)\b", sh("ip", "netns", "list").stdout, re.M))


def network_up() -> None:
    if sh("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    existing = node_namespaces()
    for i in range(1, NODES + 1):
        ns = f"rtn{i}"
        if ns not in existing:
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", f"rtv{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", f"rtv{i}", "master", BRIDGE, "up")
            sh("ip", "-n", ns, "addr", "add", f"{node_ip(i)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    set_hosts([f"{SUBNET}.1 slurmctl"] + [f"{node_ip(i)} node{i}" for i in range(1, NODES + 1)])


def network_down() -> None:
    # Every node's namespace and veth that exists, not just NODES': a testbed booted with another
    # RAYTRAIN_TESTBED_NODES (the benchmarks boot 6 or 8) is taken down whole.
    for ns in node_namespaces():
        sh("ip", "netns", "delete", ns, check=False)
    for link in re.findall(r"^\d+: (rtv\d+)[@:]", sh("ip", "-o", "link", "show").stdout, re.M):
        sh("ip", "link", "delete", link, check=False)
    sh("ip", "link", "delete", BRIDGE, check=False)
    set_hosts([])


def spawn(cmd: list[str], log: Path) -> int:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "SLURM_CONF": str(CONF)},
        )
    return proc.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def munge_up() -> int | None:
    """Start munged unless one already answers; returns the pid only if this testbed started it."""
    if sh("munge", "-n", check=False).returncode == 0:
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        sh("mungekey", "--create", "--force")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    sh("runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force")
    deadline = time.monotonic() + 10
    while sh("munge", "-n", check=False).returncode != 0:
        if time.monotonic() > deadline:
            sys.exit("testbed: munged did not start")
        time.sleep(0.1)
    return int(Path("/run/munge/munged.pid").read_text())


def traversable(path: Path) -> None:
    """Let every user reach PATH: o+x on each directory above it that lacks it (not read: listing stays
    closed), as on a cluster where software lives on a shared filesystem."""
    for parent in reversed(path.parents):
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)
            print(f"testbed: o+x on {parent} so that the test users reach {path}")


def users_up() -> None:
    """The test users (idempotent), with private homes on the shared filesystem."""
    for name, uid in USERS.items():
        if sh("id", "-u", name, check=False).returncode != 0:
            sh("groupadd", "--gid", str(uid), name)
            sh("useradd", "--uid", str(uid), "--gid", str(uid), "--home-dir", str(HOMES / name), "-s", "/bin/sh", name)
        home = HOMES / name
        home.mkdir(parents=True, exist_ok=True)
        os.chown(home, uid, uid)
        home.chmod(0o700)
    traversable(HOMES / "x")
    traversable(REPO / "x")
    traversable(Path(sys.executable).resolve())


def wait_idle(deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        out = sh("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        if len(states) == NODES and all(s == "idle" for s in states.values()):
            return
        time.sleep(0.2)
    log = (STATE / "log/slurmctld.log").read_text()[-2000:] if (STATE / "log/slurmctld.log").exists() else ""
    sys.exit(f"testbed: nodes not idle after {deadline_s:.0f} s: {states}\n{log}")


def up() -> None:
    if CONF.exists() and f"Nodes=node[1-{NODES}] " not in CONF.read_text():
        print(f"testbed: up with another node count; rebooting it with {NODES} nodes")
        down(quiet=True)
    if PIDS.exists() and all(alive(p) for p in json.loads(PIDS.read_text())["daemons"]):
        os.environ["SLURM_CONF"] = str(CONF)
        users_up()
        wait_idle(30)
        print(f"testbed: already up ({NODES} nodes); export SLURM_CONF={CONF}")
        return
    down(quiet=True)
    for d in ("ctld", "log", "spool"):
        (STATE / d).mkdir(parents=True, exist_ok=True)
    CONF.write_text(slurm_conf())
    (STATE / "gres.conf").write_text(gres_conf())
    (STATE / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
    for g in range(GPUS):
        dev = Path(f"/dev/rtfakegpu{g}")
        if not dev.exists():
            os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
    network_up()
    users_up()
    munged = munge_up()
    start = time.monotonic()
    daemons = [
        spawn(
            ["unshare", "--uts", "sh", "-c", f"hostname slurmctl && exec slurmctld -D -f {CONF}"],
            STATE / "log/slurmctld.out",
        )
    ]
    keep = str(REPO) if str(REPO).startswith("/tmp/") else ""
    init = str(Path(__file__).with_name("node-init.sh"))
    for i in range(1, NODES + 1):
        cmd = [
            "nsenter",
            f"--net=/run/netns/rtn{i}",
            "unshare",
            "--uts",
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",  # `down` kills this unshare; the node's PID 1, and with it the node, dies too
            "--mount-proc",
            init,
            f"node{i}",
            str(CONF),
            keep,
        ]
        daemons.append(spawn(cmd, STATE / f"log/node{i}.out"))
    PIDS.write_text(json.dumps({"daemons": daemons, "munged": munged}))
    os.environ["SLURM_CONF"] = str(CONF)
    wait_idle(60)
    print(f"testbed: {NODES} nodes idle in {time.monotonic() - start:.1f} s; export SLURM_CONF={CONF}")


def down(quiet: bool = False) -> None:
    if PIDS.exists():
        state = json.loads(PIDS.read_text())
        # Killing a node's unshare kills its PID 1 (--kill-child), and with it every process in its PID
        # namespace: slurmd, steps, Ray.
        for pid in [*state["daemons"], *([state["munged"]] if state.get("munged") else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in state["daemons"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        PIDS.unlink()
    network_down()
    for sub in ("ctld", "spool"):
        shutil.rmtree(STATE / sub, ignore_errors=True)
    if not quiet:
        print("testbed: down")


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("testbed: needs root (network namespaces, mounts, slurmd)")
    for tool in ("slurmctld", "slurmd", "munged", "sinfo", "ip", "nsenter", "useradd", "runuser"):
        if shutil.which(tool) is None:
            sys.exit(f"testbed: {tool} not found: apt-get install munge slurmctld slurmd slurm-client iproute2")
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "up":
        up()
    elif command == "down":
        down()
    elif command == "env":
        print(f"export SLURM_CONF={CONF}")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
