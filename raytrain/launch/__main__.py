"""``python -m raytrain.launch``: the steps of ``slurm/ray_cluster.sbatch`` that are easier in Python.

Settings come from the environment through click's ``envvar=`` (names and defaults: ``raytrain.contracts.env``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from raytrain import slurm_env
from raytrain.contracts import env, jobdir
from raytrain.contracts.result import EXIT_CANCELLED, EXIT_LOST, EXIT_PREEMPTED
from raytrain.errors import UserError
from raytrain.launch import node, ready

F = TypeVar("F", bound=Callable[..., Any])


def _env_option(var: env.Var, *decls: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option read from ``var`` when not given, with the table's default."""
    return click.option(*decls, envvar=var.name, default=var.default, show_envvar=True, **kwargs)


@click.group()
def cli() -> None:
    """Internal helpers of slurm/ray_cluster.sbatch."""


SETUP_LINES = 5  # what `setup` prints last, and the batch script reads (a wrapper may print before)


@cli.command()
@_env_option(env.LOG_DIR, "--log-root", help="Logs go to <this>/<job id>/attempt-<n>/.")
@click.option("--serve", is_flag=True, help="The job serves drivers from `raytrain submit`.")
def setup(log_root: str | None, serve: bool) -> None:
    """Check the settings and the time limit; make the job's private directory (0700, ours) holding a
    fresh Ray token (0600), or stop the job (fail closed), and its private log directory; print both, then
    the exit statuses the batch script goes by (preempted: requeue and resume; lost: the cluster failed
    under the driver; written once, in ``raytrain.contracts.result``), then the allocation's nodes, head
    first: one a line, SETUP_LINES in all. Then remove what jobs of yours that were killed before their
    teardown left beside it."""
    from raytrain import private_dirs
    from raytrain.launch import ports, state_dirs

    job = slurm_env.current()
    if job is None:
        raise UserError("python -m raytrain.launch setup runs inside a Slurm job (slurm/ray_cluster.sbatch)")
    env.check_settings()
    port_warning = ports.check_layout(
        int(env.PORT_BASE.value()), int(env.PORT_BLOCK.value()), int(env.PORT_BLOCKS.value())
    )
    if port_warning:
        click.echo(f"raytrain: warning: {port_warning}", err=True)
    slurm_env.check_time_limit(slurm_env.time_limit_s(job.job_id), int(env.SIGNAL_LEAD.value()))
    nodes = slurm_env.allocated_nodes(job)
    root = Path(log_root) if log_root else Path(job.submit_dir or Path.cwd()) / "raytrain-logs"
    fix = f"set {env.LOG_DIR.name} to a directory of yours, on storage every node sees"
    logs = root / job.job_id / f"attempt-{job.restart_count}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        private_dirs.ensure(root / job.job_id, "the job's log directory", fix)
        logs.mkdir(exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot make the job's log directory {logs} ({exc.strerror or exc}): {fix}") from None
    directory = jobdir.job_dir(job.job_id)
    state_dirs.create(directory, job.cluster_name, serving=serve)
    if env.CONTAINER.get():
        from raytrain.launch import container

        # The batch script learns of the job directory only from what this prints last: should the check
        # (which can take minutes to pull an image) fail or be cancelled, nothing of it may stay behind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            image = container.settle(nodes, directory, root / job.job_id, Path(job.submit_dir or Path.cwd()))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        click.echo(f"raytrain: every Ray process and driver runs in {image.image} ({image.runtime})", err=True)
    lines = (directory, logs, EXIT_PREEMPTED, EXIT_LOST, " ".join(nodes))
    assert len(lines) == SETUP_LINES
    for line in lines:
        click.echo(line)
    if job.cluster_name and (live := slurm_env.live_jobs()) is not None:
        removed = state_dirs.sweep(directory.parent, own=directory.name, cluster=job.cluster_name, live=live)
        if removed:
            ids = ", ".join(removed)
            click.echo(f"removed the private directories of ended jobs {ids} (killed before their teardown)", err=True)


@cli.command("node")
@click.option("--role", type=click.Choice(["head", "worker"]), required=True)
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--log-dir", type=click.Path(path_type=Path), required=True)
@click.option("--head", default=None, help="ip:port of the head's GCS (workers).")
@click.option(
    "--rejoin", type=int, default=0, help="The how-manieth start of a lost worker node's Ray again (0: the first)."
)
@_env_option(env.IFNAME, "--ifname")
@_env_option(env.HEAD_IP, "--head-ip")
@_env_option(env.TMPDIR, "--tmp-root", type=click.Path(path_type=Path))
@_env_option(env.PORT_BASE, "--port-base", type=int)
@_env_option(env.PORT_BLOCK, "--port-block", type=int)
@_env_option(env.PORT_BLOCKS, "--port-blocks", type=int)
def start_node(role: str, job_dir: Path, log_dir: Path, head: str | None, **o: object) -> int:
    """Run this node's Ray until told to stop."""
    args = node.NodeArgs(role=role, job_dir=job_dir, log_dir=log_dir, head=head, ray_cmd=ray_command(), **o)  # type: ignore[arg-type]
    return node.run(args)


@cli.command("step")
@click.option("--role", type=click.Choice(["head", "worker"]), required=True)
@click.option("--node", required=True, help="The Slurm node to run it on.")
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--log-dir", type=click.Path(path_type=Path), required=True)
@click.option("--output", type=click.Path(path_type=Path), required=True, help="The step's log.")
@click.option("--head", default=None, help="ip:port of the head's GCS (workers).")
def step(role: str, node: str, job_dir: Path, log_dir: Path, output: Path, head: str | None) -> None:
    """Become the srun step that runs NODE's Ray (``node``, supervised), under its step name."""
    from raytrain.launch.steps import step_argv

    argv = step_argv(role=role, node=node, job_dir=job_dir, log_dir=log_dir, output=output, head=head)
    os.execvp(argv[0], argv)


SWEEP_TIMEOUT_S = 15.0  # a node that is gone must not hold up the teardown


@cli.command("sweep-nodes")
@click.option("--log-dir", type=click.Path(path_type=Path), required=True)
@click.argument("nodes", nargs=-1, required=True)
def sweep_nodes(log_dir: Path, nodes: tuple[str, ...]) -> None:
    """Run ``sweep-node`` on NODES, whose Ray steps ended early, in one step (bounded: a node that is gone
    is passed over)."""
    python = [env.PYTHON.require(), "-m", "raytrain.launch", "sweep-node", "--log-dir", str(log_dir)]
    argv = slurm_env.srun_on_each(nodes, name="raytrain-sweep", argv=python)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(argv, timeout=SWEEP_TIMEOUT_S, check=False)


@cli.command("sweep-node")
@click.option("--log-dir", type=click.Path(path_type=Path), required=True)
@_env_option(env.TMPDIR, "--tmp-root", type=click.Path(path_type=Path))
def sweep_node(log_dir: Path, tmp_root: Path) -> None:
    """On a node whose Ray step ended early (killed with its supervisor), or of a job in a container:
    remove this job's containers left there, then its temp dirs, keeping Ray's logs in the job's log
    directory."""
    from raytrain.launch import container

    job = slurm_env.current()
    for name in container.remove_left(job.job_id) if job and env.CONTAINER.get() else []:
        node.say(f"removed container {name} on {slurm_env.node_name()} (its podman run was killed)")
    for temp_dir in node.sweep(tmp_root, log_dir):
        node.say(f"swept {temp_dir} on {slurm_env.node_name()} (its Ray ended early)")


@cli.command("in-image", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--step", required=True, help="The Slurm step this runs as: ray-<role>-<node>.")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def in_image(job_dir: Path, step: str, argv: tuple[str, ...]) -> None:
    """Become ARGV inside the job's image on this node (Apptainer, Podman): what a node's Ray step runs,
    so that the container gets this node's GPUs. A container of the same step left by a killed start
    before is removed first (Podman)."""
    from raytrain.launch import container

    image = container.Container.load(job_dir)
    if image is None:
        raise UserError(f"no container in {job_dir}: the job has ended, or it runs on the host")
    here = slurm_env.node_name()
    role = step.removesuffix(f"-{here}")
    job_id, attempt = container.job_attempt()
    for name in container.remove_left(job_id, prefix=f"raytrain-{attempt}-{role}-{here}-"):
        node.say(f"removed container {name} on {here}, left by this node's Ray before")
    cmd = container.here(image, argv, step=role)
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


@cli.command("container-check")
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--timeout", type=float, required=True, help="Seconds the image may take to start and answer.")
def container_check(job_dir: Path, timeout: float) -> None:
    """On one node: remove what containers an earlier attempt of the job left (Podman), start the job's
    image and print what it has (raytrain, Ray, torch), or why it did not start, as one line that ``setup``
    reads back."""
    from raytrain.launch import container

    image = container.Container.load(job_dir)
    if image is None:
        raise UserError(f"no container in {job_dir}")
    job = slurm_env.current()
    for name in container.remove_left(job.job_id) if job and image.runtime == "podman" else []:
        node.say(f"removed container {name} on {slurm_env.node_name()}, left by an earlier attempt of this job")
    click.echo(container.answer_line(container.check_here(image, timeout)))


@cli.command("head-address")
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--watch", "watch", required=True, help="NODE:PID:LOG of the head's step.")
@_env_option(env.JOIN_TIMEOUT, "--timeout", type=float)
def head_address(job_dir: Path, watch: str, timeout: float) -> None:
    """Print the head's GCS address once its supervisor has published it."""
    click.echo(ready.head_info(job_dir, ready.Watched.parse(watch), timeout).gcs_address)


@cli.command()
@click.option("--address", required=True)
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--watch", "watch", multiple=True, required=True, help="NODE:PID:LOG, one per Ray step.")
@_env_option(env.JOIN_TIMEOUT, "--timeout", type=float)
@click.option("--since", type=float, default=None, help="Unix time the job started, for the report.")
def wait(address: str, job_dir: Path, watch: tuple[str, ...], timeout: float, since: float | None) -> None:
    """Return once every watched node has joined (and mark the job ready for drivers); fail fast if a
    step dies, or at the deadline."""
    watched = [ready.Watched.parse(w) for w in watch]
    took = ready.wait_for_nodes(address, watched, timeout, since)
    (job_dir / jobdir.READY).touch(mode=0o600)
    click.echo(f"cluster: all {len(watched)} nodes joined, {took:.1f} s after the job started")


@cli.command()
@click.option("--watch", "watch", multiple=True, required=True, help="NODE:PID:LOG, one per Ray step.")
@click.option("--driver", type=int, default=None, help="The driver's pid: stopped (SIGTERM) when a node is lost.")
@click.option(
    "--job-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The job's private directory: while the driver's run is elastic, losing a worker node does not stop it.",
)
def watch(watch: tuple[str, ...], driver: int | None, job_dir: Path | None) -> int:
    """Block while every Ray step runs (the head's first); once one ends, say which, stop the driver, and
    exit with EXIT_LOST (the batch script then requeues the job, which resumes from the newest checkpoint).
    A worker node lost under an elastic run is only said, and its Ray started again after a back-off: Ray
    Train goes on with the nodes left and grows back once the node has rejoined."""
    from raytrain.contracts.result import EXIT_LOST
    from raytrain.launch.steps import Rejoins

    steps = [ready.Watched.parse(w) for w in watch]
    head = steps[0]
    rejoins = Rejoins(job_dir, steps) if driver is not None and job_dir is not None else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the batch script's teardown: see `finally`
    first = set(steps)  # the batch script's steps; the others are lost worker nodes' Ray started again
    try:
        while True:
            lost = ready.watch_steps(steps, tick=rejoins.tick if rejoins else None)
            steps.remove(lost)
            if lost is head or rejoins is None:
                break
            if (rejoins.job_dir / jobdir.ELASTIC).exists():
                if (told := rejoins.lost(lost)) is not None:
                    click.echo(f"raytrain: {told}", err=True)
            elif lost in first:
                break  # the training is not elastic (or has ended): the cluster is broken
        click.echo(f"raytrain: error: {ready.lost_node_message(lost)}", err=True)
        if driver is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(driver, signal.SIGTERM)
        return EXIT_LOST
    finally:
        if rejoins is not None:
            rejoins.stop()


@cli.command("ended-on-request")
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--status", type=int, required=True)
def ended_on_request(job_dir: Path, status: int) -> None:
    """Exit 0 if the batch script's driver ended on request (``raytrain cancel``) with STATUS, else 1."""
    sys.exit(0 if jobdir.driver_ended(job_dir, status) else 1)


@cli.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def exec_(job_dir: Path, argv: tuple[str, ...]) -> None:
    """Become the driver ARGV (``fit ...`` or any command) on the job's cluster, with its address and
    token auth set."""
    from raytrain.launch.driver import exec_driver

    _into_image(job_dir, ["exec", "--job-dir", str(job_dir), "--", *argv], step=jobdir.DRIVER_STEP)
    exec_driver(job_dir, argv)


@cli.command()
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
def status(job_dir: Path) -> None:
    """The cluster's nodes, resources in use and drivers (run on the head by ``raytrain status``)."""
    from raytrain.launch.status import report

    _into_image(job_dir, ["status", "--job-dir", str(job_dir)], step="raytrain-status")
    click.echo(report(job_dir))


_SIGNALLED_AT = click.option(
    "--signalled-at", type=float, default=None, help="UNIX time Slurm's warning came (default: now)."
)


def _deadline(signalled_at: float | None) -> float:
    from raytrain.launch import preempt as preempt_mod

    job = slurm_env.current()
    lead = int(env.SIGNAL_LEAD.value())
    return preempt_mod.deadline_for(job.job_id if job else None, lead, signalled_at or time.time())


@cli.command()
@click.option("--address", required=True)
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@_SIGNALLED_AT
@click.argument("nodes", nargs=-1, required=True)
def preempt(address: str, job_dir: Path, signalled_at: float | None, nodes: tuple[str, ...]) -> None:
    """Tell the running training to checkpoint now: the job ends soon. NODES: the job's, head first."""
    from raytrain.launch import preempt as preempt_mod

    deadline = _deadline(signalled_at)
    with contextlib.suppress(FileNotFoundError):  # the job already ended and removed its directory
        click.echo(preempt_mod.request(address, job_dir, nodes, ray_command(), deadline))


@cli.command()
@click.option("--on", "when", type=click.Choice(["term", "exit"]), required=True, help="What ends the attempt.")
@click.option("--driver-status", type=int, default=None, help="The driver's exit status, when it ended.")
@click.option("--warned", is_flag=True, help="Slurm's time-limit warning (SIGUSR2) came.")
@click.option("--stopping", is_flag=True, help="`raytrain stop` asked the job to end.")
@click.option("--serving", is_flag=True, help="The job serves drivers from `raytrain submit`.")
@click.option("--cancelled", is_flag=True, help="The driver's run was cancelled (`raytrain cancel`).")
def requeue(when: str, driver_status: int | None, warned: bool, stopping: bool, serving: bool, cancelled: bool) -> int:
    """Requeue the job if what ended this attempt calls for it (``raytrain.launch.requeue``): exit 0 if
    it was requeued, 1 if not."""
    from raytrain.launch import requeue as policy

    job = slurm_env.current()
    if job is None:
        raise UserError("python -m raytrain.launch requeue runs inside a Slurm job")
    # A SIGTERM (the time limit) that finds the driver's cancelled run still checkpointing, or the driver
    # ending after it, before the batch script has its status: the job ends too.
    directory = jobdir.job_dir(job.job_id)
    still_cancelling = (
        when == "term"
        and driver_status is None
        and (jobdir.batch_run_cancelled(directory) or jobdir.driver_ended(directory, EXIT_CANCELLED))
    )
    ending = policy.Ending(
        on_term=when == "term",
        driver_status=driver_status,
        warned=warned,
        stopping=stopping,
        serving=serving,
        cancelled=cancelled or still_cancelling,
    )
    # A requeue SIGTERMs every process of the job, this one (and scontrol, which inherits the setting)
    # included, as soon as Slurm takes it: the line that says what happened must still be written. The
    # Slurm calls are bounded, and Slurm's SIGKILL after KillWait still ends whatever is left.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requeued, lines = policy.run(job, ending, int(env.MAX_REQUEUES.value()))
    for line in lines:
        node.say(f"raytrain: {line}", err=line.startswith("error: "))
    return 0 if requeued else 1


@cli.command("stop-steps")
def stop_steps() -> None:
    """SIGTERM this job's Ray steps and submitted drivers (``scancel --signal=TERM`` by step, bounded in
    time), and nothing else of the job's."""
    job = slurm_env.current()
    if job is None:
        raise UserError("python -m raytrain.launch stop-steps runs inside a Slurm job")
    slurm_env.term_steps(job.job_id, lambda name: name.startswith(jobdir.RAY_STEP_PREFIX) or name == jobdir.DRIVER_STEP)


@cli.command("preempt-flag")
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--after", type=float, default=15.0, help="Seconds to give Ray's drain first.")
@_SIGNALLED_AT
def preempt_flag(job_dir: Path, after: float, signalled_at: float | None) -> None:
    """Drop the fallback flag after a grace period, for when Ray's drain does not reach the training
    (say the drained node runs no ranks). The batch script stops this helper when the job ends."""
    from raytrain.launch import preempt as preempt_mod

    deadline = _deadline(signalled_at)
    time.sleep(after)
    with contextlib.suppress(FileNotFoundError):  # the job already ended and removed its directory
        click.echo(f"no checkpoint {after:.0f} s after the drain: wrote {preempt_mod.write_flag(job_dir, deadline)}")


def _into_image(job_dir: Path, args: list[str], *, step: str) -> None:
    """Become ``python -m raytrain.launch ARGS`` inside the job's image, if it has one and this process is
    not inside it already (Pyxis: as a step named STEP on this node)."""
    from raytrain.launch import container

    image = container.Container.load(job_dir) if job_dir.is_dir() else None
    if image is None or container.inside():
        return
    argv = container.here(image, [image.python, "-m", "raytrain.launch", *args], step=step)
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def ray_command() -> tuple[str, ...]:
    """How to run Ray's CLI: ``RAYTRAIN_RAY_BIN`` (a wrapper) or this interpreter's Ray. In a job with a
    container, each node's supervisor runs it inside the image, and the head's preemption drain on the host."""
    custom = env.RAY_BIN.get()
    return tuple(shlex.split(custom)) if custom else (sys.executable, "-m", "ray.scripts.scripts")


def main() -> None:
    try:
        rc = cli.main(prog_name="python -m raytrain.launch", standalone_mode=False)
    except UserError as exc:
        click.echo(f"raytrain: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"raytrain: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
