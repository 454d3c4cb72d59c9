"""The ``raytrain`` command line: the only place that reads flags and builds the config."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import click

from raytrain import __version__, slurm_env
from raytrain.config import EMBEDDED_DATA, DataConfig, FitConfig, ModelConfig, OptimConfig, RunConfig, ScaleConfig
from raytrain.errors import UserError


def _default_name(data: str, model: str) -> str:
    """``<data>-<model>``, plus the Slurm job (stable across requeues) when inside one."""
    stem = "digits" if data == EMBEDDED_DATA else Path(data.rstrip("/")).name.split(".")[0] or "data"
    name = f"{stem}-{model.split(':')[-1]}"
    job = slurm_env.current()
    if job is not None:
        name += f"-job{job.key}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="raytrain")
def cli() -> None:
    """Train PyTorch models across a Slurm allocation (or this machine) with Ray Train."""


@cli.command()
@click.option(
    "--workers",
    type=int,
    default=None,
    help="Training workers. Default: every GPU of the cluster, else one CPU worker per node.",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "gpu", "cpu"]),
    default="auto",
    show_default=True,
    help="gpu: one GPU per worker over NCCL; cpu: gloo; auto: gpu when the cluster has GPUs.",
)
@click.option(
    "--data",
    default=None,
    metavar="PATH|URI",
    help="Parquet file or directory (local path or pyarrow URI) with 'image' bytes and 'label'. "
    "Default: the embedded handwritten-digits set.",
)
@click.option(
    "--storage",
    default=lambda: os.environ.get("RAYTRAIN_STORAGE", "runs"),
    show_default="runs",
    metavar="PATH|URI",
    help="Checkpoint root, on storage every node sees ($RAYTRAIN_STORAGE).",
)
@click.option(
    "--name",
    default=None,
    help="Run name under --storage; the same name resumes. Default: <data>-<model>[-job<slurm id>].",
)
@click.option(
    "--model",
    default="resnet18",
    show_default=True,
    metavar="NAME|MODULE:FACTORY",
    help="torchvision classification model, or your factory(num_classes=K) -> nn.Module.",
)
@click.option("--epochs", type=int, default=10, show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True, help="Per worker.")
@click.option("--lr", type=float, default=0.02, show_default=True, help="Peak SGD learning rate (cosine decay).")
@click.option("--amp/--no-amp", default=True, show_default=True, help="bf16 autocast on GPU (no effect on CPU).")
@click.option("--image-size", type=int, default=None, help="Resize images to this square. Default: the data's.")
@click.option(
    "--val-fraction", type=float, default=0.2, show_default=True, help="Held-out share when the data has no val/ split."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--synthetic-data",
    is_flag=True,
    help="Train on one pre-built batch (the model's speed without input; for benchmarks).",
)
@click.option("--cpus-per-worker", type=float, default=None, help="CPUs reserved per worker. Default: planned.")
@click.option(
    "--pg-timeout",
    type=int,
    default=300,
    show_default=True,
    help="Seconds a collective may block before the run fails (Ray's default is 1800).",
)
@click.option("--keep", type=int, default=3, show_default=True, help="Checkpoints kept per run.")
@click.option("--fresh", is_flag=True, help="Start over under this name; the old run is moved aside.")
@click.option("--dry-run", is_flag=True, help="Print the resolved config and placement plan; do not train.")
def fit(**o: Any) -> int:
    """Train a classifier with one Ray Train worker per GPU (or CPU workers), resuming where a run stopped."""
    from raytrain import fit as fit_mod
    from raytrain.data.source import canonical_uri

    data = canonical_uri(o["data"]) if o["data"] else EMBEDDED_DATA
    cfg = FitConfig(
        data=DataConfig(
            uri=data, image_size=o["image_size"], val_fraction=o["val_fraction"], synthetic=o["synthetic_data"]
        ),
        model=ModelConfig(name=o["model"]),
        optim=OptimConfig(epochs=o["epochs"], batch_size=o["batch_size"], lr=o["lr"], amp=o["amp"], seed=o["seed"]),
        scale=ScaleConfig(
            workers=o["workers"], device=o["device"], cpus_per_worker=o["cpus_per_worker"], pg_timeout_s=o["pg_timeout"]
        ),
        run=RunConfig(
            storage=canonical_uri(o["storage"]),
            name=o["name"] or _default_name(data, o["model"]),
            fresh=o["fresh"],
            keep=o["keep"],
        ),
        dry_run=o["dry_run"],
    )
    return fit_mod.run(cfg, click.echo)


@cli.command()
@click.argument("source", metavar="SOURCE")
@click.argument("out", metavar="OUT")
@click.option(
    "--val-fraction",
    type=float,
    default=0.1,
    show_default=True,
    help="Share of an unsplit image folder written to OUT/val (0: none; fit then holds out by hash).",
)
@click.option("--image-size", type=int, default=None, help="Resize to this square and store JPEG. Default: keep bytes.")
@click.option("--rows-per-file", type=click.IntRange(min=1), default=5000, show_default=True)
@click.option("--root", default="data", show_default=True, help="Where a torchvision dataset lives on disk.")
@click.option("--download", is_flag=True, help="Let torchvision download the dataset into --root (internet).")
def prepare(source: str, out: str, **o: Any) -> None:
    """Write an image folder (SOURCE/<class>/*.jpg) or torchvision:NAME as Parquet shards in OUT.

    Examples: `raytrain prepare ~/photos data/photos`, `raytrain prepare torchvision:CIFAR10 --root ~/data
    data/cifar10`. OUT gets train/ and val/ shards with 'image' bytes and 'label' columns.
    """
    from raytrain.data.prepare import prepare as run_prepare

    summary = run_prepare(source, out, echo=click.echo, **o)
    click.echo(
        f"wrote {summary.out} ({len(summary.classes)} classes); train on it with: raytrain fit --data {summary.out}"
    )


@cli.command()
@click.argument("job_id")
def dashboard(job_id: str) -> None:
    """How to open the Ray dashboard of a running Slurm job JOB_ID (ssh tunnel and token file)."""
    from raytrain.dashboard import hint

    click.echo(hint(job_id))


@cli.command("models")
def list_models() -> None:
    """List the torchvision classification models --model accepts by name."""
    from raytrain.models import classification_models

    click.echo("\n".join(classification_models()))


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors for user mistakes, tracebacks only for bugs."""
    try:
        rc = cli.main(args=argv, prog_name="raytrain", standalone_mode=False)
    except UserError as exc:
        click.echo(f"raytrain: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(0)
    except click.ClickException as exc:
        click.echo(f"raytrain: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        from raytrain.cluster import stopped_by_sigterm

        if stopped_by_sigterm():
            click.echo(
                "raytrain: stopped by SIGTERM; the local Ray cluster is shut down. Rerun the same command to "
                "go on from the last checkpoint",
                err=True,
            )
            sys.exit(143)
        click.echo("raytrain: interrupted", err=True)
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)
