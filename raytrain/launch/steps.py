"""The Slurm step that runs one node's Ray, and starting it again on a worker node whose Ray was lost.

Every node's Ray runs in a named srun step of its own (``ray-head-<node>``, ``ray-worker-<node>``; the
teardown stops these by name). Under an elastic run (``--workers MIN:MAX``) a worker node whose Ray
exited (killed, out of memory, a crash) does not end the run: the watcher starts the node's step again
after a back-off, and once Ray there has rejoined, Ray Train grows the run back to it at its next resize
check (``ScalingConfig.elastic_resize_monitor_interval_s``). A start that fails (the node is down, or
Slurm took it out of the allocation: ``--no-kill`` drops a failed node) is tried again, less and less
often; a node whose Ray is lost ``MAX_LOSSES`` times once up is left out for the rest of the attempt.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from raytrain import processes, slurm_env
from raytrain.contracts import env
from raytrain.contracts.jobdir import RAY_STEP_PREFIX, ClusterFile
from raytrain.launch import container
from raytrain.launch.container import Container
from raytrain.launch.ready import Watched

MAX_LOSSES = 5  # per worker node and job attempt: a node whose Ray keeps dying once up is left out
# A lost node's Ray is started again after a third of RAYTRAIN_REJOIN_EVERY (10 s by default), the wait
# doubled after each start that failed, up to the setting: a node that is down (or out of the allocation)
# is tried that often.
FIRST_BACKOFF_SHARE = 1 / 3
UP_S = 60.0  # a step that ran this long had joined: its end is a loss, not a failed start
_STOP_S = 15.0  # as the batch script's teardown gives its own steps


def step_argv(
    *, role: str, node: str, job_dir: Path, log_dir: Path, output: Path, head: str | None, rejoin: int = 0
) -> list[str]:
    """srun running ``python -m raytrain.launch node`` on NODE, as its own named step (``--overlap``:
    the driver and other steps share the node; ``--whole``: Ray sees every CPU and GPU Slurm gave the job
    there): inside the job's image when it has one (``raytrain.launch.container``), else under the
    interpreter the batch script uses (``RAYTRAIN_PYTHON``). Its output is appended to OUTPUT, so a node
    started again keeps one log."""
    image = Container.load(job_dir)
    python = [
        image.python if image else env.PYTHON.require(),
        "-m",
        "raytrain.launch",
        "node",
        "--role",
        role,
        "--job-dir",
        str(job_dir),
        "--log-dir",
        str(log_dir),
    ]
    if head:
        python += ["--head", head]
    if rejoin:
        python += ["--rejoin", str(rejoin)]
    name = f"{RAY_STEP_PREFIX}{role}-{node}"
    if image is not None:
        return container.step_argv(image, job_dir, python, node=node, step=name, output=output)
    return slurm_env.srun_step(node=node, name=name, argv=python, output=output)


@dataclass
class _Node:
    log: str
    backoff_s: float  # before its next start
    losses: int = 0
    starts: int = 0  # of its Ray again
    started: float | None = None  # when its current step started (None: the batch script's first one)
    due: float | None = None  # when to start its Ray again


class Rejoins:
    """Starts lost worker nodes' Ray again, each as a new watched step appended to ``steps``."""

    def __init__(self, job_dir: Path, steps: list[Watched]) -> None:
        self.job_dir = job_dir
        self.steps = steps
        self.nodes: dict[str, _Node] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.max_backoff_s = env.REJOIN_EVERY.value()
        self.first_backoff_s = self.max_backoff_s * FIRST_BACKOFF_SHARE

    def lost(self, step: Watched) -> str | None:
        """Plan to start STEP's node again; what to tell the user (None: a start that failed, retried)."""
        node = self.nodes.setdefault(step.node, _Node(log=step.log, backoff_s=self.first_backoff_s))
        now = time.monotonic()
        if node.started is None or now - node.started >= UP_S:
            node.losses += 1
            node.backoff_s = self.first_backoff_s
            said = f"Ray on {step.node} exited; the elastic run goes on with the nodes left"
            if node.losses >= MAX_LOSSES:
                return f"{said}, without {step.node} from now on: its Ray was lost {MAX_LOSSES} times"
            told: str | None = f"{said}; Ray there starts again when the node can take it, and the run grows back"
        else:
            node.backoff_s = min(2 * node.backoff_s, self.max_backoff_s)
            told = None
        node.due = now + node.backoff_s
        return told

    def tick(self) -> None:
        """Reap ended starts (so that their pids read as gone) and make the ones that are due."""
        self.procs = [p for p in self.procs if p.poll() is None]
        now = time.monotonic()
        for name, node in self.nodes.items():
            if node.due is None or node.due > now:
                continue
            try:
                info = ClusterFile.read(self.job_dir)
            except (OSError, ValueError):
                return  # the job is ending
            node.due, node.started = None, now
            node.starts += 1
            argv = step_argv(
                role="worker",
                node=name,
                job_dir=self.job_dir,
                log_dir=Path(info.log_dir),
                output=Path(node.log),
                head=info.gcs_address,
                rejoin=node.starts,
            )
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
            self.procs.append(proc)
            self.steps.append(Watched(node=name, pid=proc.pid, log=node.log))
            print(f"raytrain: starting Ray on {name} again (see {node.log})", file=sys.stderr, flush=True)

    def stop(self) -> None:
        """End the steps started again the way the batch script ends its own (their supervisors stop Ray
        and clean up), bounded; SIGKILL to an srun still running after that."""
        if not self.procs:
            return
        job = slurm_env.current()
        if job is not None:
            names = {f"{RAY_STEP_PREFIX}worker-{name}" for name in self.nodes}
            slurm_env.term_steps(job.job_id, names.__contains__)
        processes.end(processes.of(self.procs), _STOP_S)
