"""``python -m raytrain.launch``: the steps of ``slurm/ray_cluster.sbatch`` that are easier in Python."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from pathlib import Path

import click

from raytrain.errors import UserError
from raytrain.launch import jobdir, node, ready


@click.group()
def cli() -> None:
    """Internal helpers of slurm/ray_cluster.sbatch."""


@cli.command()
@click.argument("job_dir", type=click.Path(path_type=Path))
def token(job_dir: Path) -> None:
    """Create JOB_DIR (0700, ours) holding a fresh Ray auth token (0600), or stop the job (fail closed);
    then remove what jobs of yours that were killed before their teardown left beside it."""
    from raytrain import slurm_env

    job = slurm_env.current()
    cluster = job.cluster_name if job else None
    jobdir.create(job_dir, cluster)
    if cluster and (live := jobdir.live_jobs()) is not None:
        removed = jobdir.sweep(job_dir.parent, own=job_dir.name, cluster=cluster, live=live)
        if removed:
            ids = ", ".join(removed)
            click.echo(f"removed the private directories of ended jobs {ids} (killed before their teardown)")


@cli.command("node")
@click.option("--role", type=click.Choice(["head", "worker"]), required=True)
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--log-dir", type=click.Path(path_type=Path), required=True)
@click.option("--head", default=None, help="ip:port of the head's GCS (workers).")
def start_node(role: str, job_dir: Path, log_dir: Path, head: str | None) -> int:
    """Run this node's Ray until told to stop."""
    env = os.environ
    args = node.NodeArgs(
        role=role, job_dir=job_dir, log_dir=log_dir, head=head,
        ifname=env.get("RAYTRAIN_IFNAME") or None,
        head_ip=env.get("RAYTRAIN_HEAD_IP") or None,
        tmp_root=Path(env.get("RAYTRAIN_TMPDIR") or "/tmp"),
        port_base=int(env.get("RAYTRAIN_PORT_BASE", "20000")),
        port_block=int(env.get("RAYTRAIN_PORT_BLOCK", "500")),
        port_blocks=int(env.get("RAYTRAIN_PORT_BLOCKS", "88")),
        ray_cmd=ray_command(),
    )  # fmt: skip
    return node.run(args)


@cli.command("head-address")
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--watch", "watch", required=True, help="NODE:PID:LOG of the head's step.")
@click.option("--timeout", type=float, default=120)
def head_address(job_dir: Path, watch: str, timeout: float) -> None:
    """Print the head's GCS address once its supervisor has published it."""
    click.echo(ready.head_info(job_dir, ready.Watched.parse(watch), timeout)["gcs_address"])


@cli.command()
@click.option("--address", required=True)
@click.option("--watch", "watch", multiple=True, required=True, help="NODE:PID:LOG, one per Ray step.")
@click.option("--timeout", type=float, default=180)
@click.option("--since", type=float, default=None, help="Unix time the job started, for the report.")
def wait(address: str, watch: tuple[str, ...], timeout: float, since: float | None) -> None:
    """Return once every watched node has joined; fail fast if a step dies, or at the deadline."""
    watched = [ready.Watched.parse(w) for w in watch]
    took = ready.wait_for_nodes(address, watched, timeout, since)
    click.echo(f"cluster: all {len(watched)} nodes joined, {took:.1f} s after the job started")


@cli.command()
@click.option("--address", required=True)
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.argument("nodes", nargs=-1, required=True)
def preempt(address: str, job_dir: Path, nodes: tuple[str, ...]) -> None:
    """Tell the running training to checkpoint now: the job ends soon. NODES: the job's, head first."""
    from raytrain import slurm_env
    from raytrain.launch import preempt as preempt_mod

    job = slurm_env.current()
    deadline = preempt_mod.deadline_for(job.job_id if job else None)
    click.echo(preempt_mod.request(address, job_dir, nodes, ray_command(), deadline))


@cli.command("preempt-flag")
@click.option("--job-dir", type=click.Path(path_type=Path), required=True)
@click.option("--after", type=float, default=15.0, help="Seconds to give Ray's drain first.")
def preempt_flag(job_dir: Path, after: float) -> None:
    """Drop the fallback flag after a grace period, for when Ray's drain does not reach the training
    (say the drained node runs no ranks). The batch script stops this helper when the job ends."""
    import time

    from raytrain.launch.preempt import write_flag

    time.sleep(after)
    with contextlib.suppress(FileNotFoundError):  # the job already ended and removed its directory
        click.echo(f"no checkpoint {after:.0f} s after the drain: wrote {write_flag(job_dir)}")


def ray_command() -> tuple[str, ...]:
    """How to run Ray's CLI: ``RAYTRAIN_RAY_BIN`` (a wrapper, a container) or this interpreter's Ray."""
    custom = os.environ.get("RAYTRAIN_RAY_BIN")
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
