"""The ``raytrain`` command line: the only place that reads flags and builds the config."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, TypeVar

import click
from click.core import ParameterSource

import raytrain
from raytrain import uri
from raytrain.contracts import env
from raytrain.contracts.jobdir import PRIORITIES, Priority
from raytrain.contracts.result import EXIT_OK, EXIT_STATUS
from raytrain.errors import UserError
from raytrain.recipe.config import OPTIONS
from raytrain.service.sweep_space import SCHEDULERS


def _default_name(stem: str) -> str:
    """``stem`` as a run name: the same for every submission of the same command, so a resubmitted job
    (after a failure, a cancel, a requeue) goes on with the same run; the run lock keeps two at once apart."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem)


class WorkerCount(NamedTuple):
    """``--workers``: N (``low`` None), or MIN:MAX (elastic); ``str`` gives it back as typed."""

    low: int | None
    high: int

    def __str__(self) -> str:
        return f"{self.low}:{self.high}" if self.low is not None else str(self.high)


class _Workers(click.ParamType[Any]):
    name = "N|MIN:MAX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, WorkerCount):
            return value
        low, sep, high = str(value).partition(":")
        try:
            return WorkerCount(int(low), int(high)) if sep else WorkerCount(None, int(low))
        except ValueError:
            self.fail(f"{value!r} is not a worker count: give N or MIN:MAX, e.g. 16 or 8:16", param, ctx)


WORKERS = _Workers()


FC = TypeVar("FC", bound=Callable[..., Any])


def _storage_option(text: str) -> Callable[[FC], FC]:
    return click.option(
        "--storage",
        envvar=env.STORAGE.name,
        default=env.STORAGE.default,
        show_default=True,
        show_envvar=True,
        metavar="PATH|URI",
        help=text,
    )


def _recipe_options(f: FC) -> FC:
    """The built-in recipe's options, generated from its config (``raytrain.recipe.config``), where each is
    defined once: name, type, default, choices, help and validation."""
    for o in reversed(OPTIONS):
        shown = o.default is not None and o.default is not False
        kind: Any = click.Choice(o.how.choices) if o.how.choices else o.type
        decls = [f"{o.flag}/--no-{o.flag[2:]}" if o.how.negatable else o.flag, o.param]
        f = click.option(
            *decls,
            type=None if o.type is bool else kind,
            is_flag=o.type is bool,
            default=o.default,
            show_default=shown,
            metavar=o.how.metavar,
            help=o.how.help or None,
        )(f)
    return f


def _print_version(ctx: click.Context) -> None:
    click.echo(f"raytrain, version {raytrain.__version__}")  # from the package's metadata, looked up only here
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, _, given: _print_version(ctx) if given and not ctx.resilient_parsing else None,
    help="Show the version and exit.",
)
def cli() -> None:
    """Train PyTorch models across a Slurm allocation (or this machine) with Ray Train."""


def _workload_options(name_help: str) -> Callable[[FC], FC]:
    """The options that say what trains, on what, and where it lives: ``fit``'s, which ``sweep`` shares
    (NAME_HELP: what ``--name`` names)."""
    options: list[Callable[[Any], Any]] = [
        click.option(
            "--workers",
            type=WORKERS,
            default=None,
            help="Training workers, or MIN:MAX to go on with fewer (at least MIN) when a node is lost, and grow "
            "back when it returns. "
            "Default: every GPU of the cluster, else one CPU worker per node.",
        ),
        click.option(
            "--device",
            type=click.Choice(["auto", "gpu", "cpu"]),
            default="auto",
            show_default=True,
            help="gpu: one GPU per worker over NCCL; cpu: gloo; auto: gpu when the cluster has GPUs.",
        ),
        click.option(
            "--train-func",
            default=None,
            metavar="MODULE:FUNCTION",
            help="Train your own Ray Train function (train_loop_per_worker) instead of the built-in classifier.",
        ),
        click.option(
            "--config",
            "config_items",
            multiple=True,
            metavar="KEY=VALUE",
            help="With --train-func: its config dict, one key each (VALUE as JSON when it parses, else a string).",
        ),
        click.option(
            "--data",
            multiple=True,
            metavar="PATH|URI",
            help="Parquet file or directory (local path or pyarrow URI) with encoded images and labels (class ids "
            "or names), its splits named by directories or file names (train/ val/, or train-*.parquet "
            "validation-*.parquet as Hugging Face writes them). Default: the embedded handwritten-digits set. With "
            "--train-func: [NAME=]PATH, repeatable, handed to it as Ray Data datasets (a PATH with train/ and val/ "
            "gives both).",
        ),
        _storage_option("Checkpoint root, on storage every node sees."),
        click.option("--name", default=None, help=name_help),
        _recipe_options,
        click.option("--cpus-per-worker", type=float, default=None, help="CPUs reserved per worker. Default: planned."),
        click.option(
            "--pg-timeout",
            type=int,
            default=300,
            show_default=True,
            help="Seconds a collective may block before the run fails (Ray's default is 1800).",
        ),
        click.option("--keep", type=int, default=3, show_default=True, help="Checkpoints kept per run."),
        click.option(
            "--max-failures",
            type=int,
            default=3,
            show_default=True,
            help="Worker failures (a killed process, a lost node, an error) to restart from the newest checkpoint "
            "after; 0 fails the run at the first.",
        ),
        click.option("--fresh", is_flag=True, help="Start over under this name; the old run is moved aside."),
        click.option(
            "--tracker",
            default=None,
            metavar="mlflow[=URI]",
            help="Log parameters, metrics at every report and the best checkpoint to MLflow (pip install "
            "'raytrain[mlflow]'): at URI, else MLFLOW_TRACKING_URI, else a file store in <storage>/mlruns.",
        ),
    ]

    def apply(f: FC) -> FC:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


class _Fit(click.Command):
    """``fit``, which keeps its arguments as typed so that ``fit --slurm`` forwards them unchanged (a value
    printed back from its parsed form may differ: ``--lr 0.00012345678``)."""

    ARGV = "raytrain.fit.argv"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[self.ARGV] = list(args)
        return super().parse_args(ctx, args)


@cli.command(cls=_Fit, context_settings={"ignore_unknown_options": False})
@_workload_options("Run name under --storage; the same name resumes. Default: <data>-<model> (or the function's name).")
@click.option(
    "--share-group",
    default=None,
    metavar="GROUP",
    help="Share the run with a Unix group: its members may resume and read it (umask 007 lets them rotate its "
    "checkpoints too). Without it a run directory is yours alone.",
)
@click.option("--dry-run", is_flag=True, help="Print the resolved config and placement plan; do not train.")
@click.option(
    "--slurm",
    is_flag=True,
    help="From a login node: size an allocation from sinfo, submit slurm/ray_cluster.sbatch with these "
    "options, and follow its log to the first epoch. Arguments after -- go to sbatch.",
)
@click.option(
    "--container",
    metavar="IMAGE",
    default=None,
    help="With --slurm: run every Ray process and the driver inside this image (an Apptainer .sif or "
    "sandbox, a Pyxis/enroot image, a Podman image); the image needs this raytrain. See README: Containers.",
)
@click.option(
    "--container-runtime",
    type=click.Choice(env.CONTAINER_RUNTIMES),
    default=None,
    help="With --container: the runtime to use. Default: one found on the head node, by the image's form.",
)
@click.argument("sbatch_args", nargs=-1, metavar="[-- SBATCH_OPTIONS]")
@click.pass_context
def fit(ctx: click.Context, /, **o: Any) -> int:
    """Train with one Ray Train worker per GPU (or CPU workers), resuming where a run stopped: the built-in
    image classifier, or your own function with --train-func."""

    sbatch_args = o.pop("sbatch_args")
    if sbatch_args and not o["slurm"]:
        raise UserError(f"unexpected arguments {' '.join(sbatch_args)}: sbatch options go after --slurm --")
    scale = _scale(o)
    image = {env.CONTAINER.name: o["container"], env.CONTAINER_RUNTIME.name: o["container_runtime"]}
    if o["container_runtime"] and not o["container"]:
        raise UserError("--container-runtime picks the runtime for --container IMAGE: give the image too")
    if o["container"] and not o["slurm"]:
        raise UserError(
            f"--container runs a Slurm job in IMAGE: add --slurm (or export {env.CONTAINER.name} and sbatch "
            "slurm/ray_cluster.sbatch); outside Slurm, run raytrain fit inside the container yourself"
        )
    if o["slurm"]:
        from raytrain.service import slurm_submit

        image = {name: value for name, value in image.items() if value}
        return slurm_submit.submit(_forwarded(ctx), list(sbatch_args), scale, click.echo, image)
    workload, stem = _workload(ctx, o)
    run = raytrain.RunConfig(
        storage=uri.canonical(o["storage"]),
        name=o["name"] or _default_name(stem),
        fresh=o["fresh"],
        keep=o["keep"],
        max_failures=o["max_failures"],
        share_group=o["share_group"],
        tracker=_tracker(o),
    )
    # Start-up is timed from this process's start, as the user's clock (or time(1)) sees it.
    result = raytrain.train(
        workload, scale=scale, run=run, echo=click.echo, dry_run=o["dry_run"], command_started=_process_start()
    )
    if result is None:
        return EXIT_OK
    return EXIT_STATUS[result.status]  # a cancelled run's end is noted for the batch script by raytrain.train


def _scale(o: dict[str, Any], default_workers: int | None = None) -> raytrain.ScaleConfig:
    count: WorkerCount | None = o["workers"]
    return raytrain.ScaleConfig(
        workers=count.high if count else default_workers,
        min_workers=count.low if count else None,
        device=o["device"],
        cpus_per_worker=o["cpus_per_worker"],
        pg_timeout_s=o["pg_timeout"],
    )


def _workload(ctx: click.Context, o: dict[str, Any]) -> tuple[Any, str]:
    """The workload the options name (the built-in classifier, or --train-func) and a stem for its name."""
    return _train_function(ctx, o) if o["train_func"] else _recipe(o)


@cli.command("sweep")
@_workload_options(
    "Sweep name under --storage (each trial is a run under it); the same name resumes the sweep. Default: "
    "<data>-<model>-sweep (or the function's name)."
)
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="NAME=KIND:ARGS",
    help="A parameter to sweep, repeatable: loguniform:LO:HI, uniform:LO:HI, int:LO:HI, choice:A,B,... or grid:A,B,... "
    "NAME: a fit option without dashes (lr, batch_size, model, ...), or with --train-func a key of its config.",
)
@click.option(
    "--params-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="YAML or JSON: NAME: KIND:ARGS (or NAME: {KIND: [ARGS]}) per parameter; --param adds to it.",
)
@click.option(
    "--trials",
    type=int,
    default=None,
    help="Trials to draw; each repeats the grid. Default: 1 with only grid parameters, else 10.",
)
@click.option(
    "--concurrent",
    type=int,
    default=None,
    help="Trials at once. Default: as many as the cluster holds at the trial's workers (checked before any starts).",
)
@click.option(
    "--metric",
    default=None,
    help="The reported metric to optimise. Default: val_acc (built-in classifier); with --train-func, name one it "
    "reports.",
)
@click.option("--mode", type=click.Choice(["max", "min"]), default=None, help="Default: min for a loss, else max.")
@click.option(
    "--scheduler",
    type=click.Choice(SCHEDULERS),
    default="asha",
    show_default=True,
    help="Early stopping of the trials that trail: ASHA, the median stopping rule, or none (Ray Tune's).",
)
@click.option(
    "--grace",
    type=int,
    default=1,
    show_default=True,
    help="Epochs (reports, for --train-func) a trial runs before early stopping may stop it.",
)
@click.pass_context
def sweep(ctx: click.Context, /, **o: Any) -> int:
    """Train many trials of the built-in classifier (or --train-func) over a search space, packed into the
    cluster (or this machine), stopping the ones that trail. Each trial is a raytrain run under the sweep;
    `raytrain report SWEEP` ranks them, and evaluate/predict/export SWEEP use the best."""
    from raytrain.service.sweep_space import SearchSpace
    from raytrain.service.sweeps import SweepConfig, sweep

    if o["workers"] is not None and o["workers"].low is not None:
        raise UserError("--workers MIN:MAX is for one elastic run: a sweep's trials take --workers N each")
    space = SearchSpace.of(o["params"], o["params_file"])
    workload, stem = _workload(ctx, o)
    metric = o["metric"] or (None if o["train_func"] else "val_acc")
    if metric is None:
        raise UserError("--train-func sweeps need --metric: name a metric your function reports (ray.train.report)")
    cfg = SweepConfig(
        name=o["name"] or _default_name(f"{stem}-sweep"),
        storage=uri.canonical(o["storage"]),
        space=space,
        trials=o["trials"] or (1 if all(p.kind == "grid" for p in space.params) else 10),
        concurrent=o["concurrent"],
        metric=metric,
        mode=o["mode"] or ("min" if "loss" in metric else "max"),
        scheduler=o["scheduler"],
        grace=o["grace"],
        fresh=o["fresh"],
        workload=workload,
        scale=_scale(o, default_workers=1),
        keep=o["keep"],
        max_failures=o["max_failures"],
        tracker=_tracker(o),
    )
    return sweep(cfg, echo=click.echo)


def _tracker(o: dict[str, Any]) -> raytrain.Tracker | None:
    return raytrain.Tracker.parse(o["tracker"]) if o["tracker"] else None


def _process_start() -> float:
    """This process's start as UNIX time, to the kernel's clock tick: psutil counts it from the boot time in
    whole seconds, the boot time is read here to the microsecond (CLOCK_BOOTTIME is the clock the kernel
    counts a process's start on)."""
    import time

    import psutil

    since_boot = float(psutil.Process().create_time() - psutil.boot_time())
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + since_boot


def _recipe(o: dict[str, Any]) -> tuple[Any, str]:
    from raytrain.recipe.config import EMBEDDED_DATA, FitConfig
    from raytrain.recipe.fit import ImageClassifier

    if o["config_items"]:
        raise UserError("--config is for --train-func: the built-in classifier takes its own options (raytrain fit -h)")
    if len(o["data"]) > 1:
        raise UserError("the built-in classifier reads one --data (a file, or a directory with train/ and val/)")
    data = uri.canonical(o["data"][0]) if o["data"] else EMBEDDED_DATA
    stem = "digits" if data == EMBEDDED_DATA else Path(data.rstrip("/")).name.split(".")[0] or "data"
    cfg = FitConfig.from_options(o, data)
    return ImageClassifier(cfg=cfg), f"{stem}-{o['model'].split(':')[-1]}"


def _train_function(ctx: click.Context, o: dict[str, Any]) -> tuple[Any, str]:
    from raytrain.callables import import_callable
    from raytrain.service.workload import dataset_paths, parse_config

    given = [o.flag for o in OPTIONS if ctx.get_parameter_source(o.param) == ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join(given)
        raise UserError(f"{flags} set the built-in classifier; give your function its settings with --config KEY=VALUE")
    spec = o["train_func"]
    func = import_callable(spec, "--train-func")
    workload = raytrain.TrainFunction(
        func=func, spec=spec, config=parse_config(o["config_items"]), data=dataset_paths(o["data"])
    )
    return workload, spec.replace(":", "-")


_LAUNCH_ONLY = {"slurm", "container", "container_runtime"}  # fit options for the submission, not the job's fit


def _forwarded(ctx: click.Context) -> list[str]:
    """``fit``'s own options as the user typed them (see :class:`_Fit`), less the submission's own
    (``--slurm``, ``--container`` and ``--container-runtime``, which go to the job's environment): the job's
    ``fit`` gets exactly these tokens. The sbatch options after ``--`` are not among them; a ``--`` that
    is an option's value (``--name --``) is, and so is a value that reads like a flag (``--name --slurm``)."""
    typed: list[str] = ctx.meta[_Fit.ARGV]
    options = {name: p for p in ctx.command.params if isinstance(p, click.Option) for name in p.opts + p.secondary_opts}
    own: list[str] = []
    tokens = iter(typed)
    for token in tokens:
        if token == "--":
            break
        if token.startswith("--") and "=" in token:  # --option=value: one token
            if (joined := options.get(token.split("=", 1)[0])) is None or joined.name not in _LAUNCH_ONLY:
                own.append(token)
            continue
        option = options.get(token)
        if option is None and not token.startswith("-"):
            raise UserError(f"unexpected argument {token!r}: fit takes options; sbatch options go after --slurm --")
        if option is not None and option.name in _LAUNCH_ONLY:
            if not option.is_flag:
                next(tokens, "")  # its value goes to the job's environment, not to its fit
            continue
        own.append(token)
        if option is not None and not option.is_flag:
            own.append(next(tokens, ""))  # its value, whatever it looks like
    return own


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
    from raytrain.recipe.data.prepare import prepare as run_prepare

    summary = run_prepare(source, out, echo=click.echo, **o)
    click.echo(
        f"wrote {summary.out} ({len(summary.classes)} classes); train on it with: raytrain fit --data {summary.out}"
    )


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--no-wait", is_flag=True, help="Fail at once if the job is still pending or starting its cluster.")
@click.option(
    "--priority",
    type=click.Choice(PRIORITIES),
    default="normal",
    show_default=True,
    envvar=env.PRIORITY.name,
    show_envvar=True,
    help="Runs of higher priority go first; one that does not fit asks running runs of lower priority to "
    "checkpoint and make room (they resume after).",
)
@click.argument("job_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- fit [OPTIONS] | -- COMMAND")
def submit(no_wait: bool, priority: Priority, job_id: str, command: tuple[str, ...]) -> int:
    """Run a driver on the Ray cluster of Slurm job JOB_ID (started with `slurm/ray_cluster.sbatch --serve`):
    `fit ...`, `sweep ...` or any command (`python train.py`). It runs on the job's head node through Slurm,
    with the cluster's address and token set; its output streams here and its exit status is this
    command's. A job still pending or starting is waited for, with a line; on a cluster that other runs
    fill, the run waits its turn, with a line."""
    from raytrain.service import jobs

    argv = command[1:] if command[:1] == ("--",) else command
    return jobs.submit(job_id, argv, wait=not no_wait, priority=priority, echo=click.echo)


@cli.command()
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds the run's training has to checkpoint and end before its workers are stopped.",
)
@click.argument("job_id")
@click.argument("run", metavar="RUN")
def cancel(grace: float, job_id: str, run: str) -> None:
    """End the run named RUN on the cluster of Slurm job JOB_ID, leaving the job and its other runs be: a
    run that waits its turn ends at once; a running one checkpoints at its next `raytrain.ending_soon()`
    check and ends (its driver exits 143), and is stopped once --grace has passed if it has not. Returns
    once it has ended. `raytrain status JOB_ID` lists the runs."""
    from raytrain.service import jobs

    jobs.cancel(job_id, run, grace_s=grace, echo=click.echo)


@cli.command()
@click.argument("job_id")
def status(job_id: str) -> int:
    """The Ray cluster of Slurm job JOB_ID: its nodes, the CPUs and GPUs in use and free, and its drivers."""
    from raytrain.service import jobs

    return jobs.status(job_id)


@cli.command()
@click.argument("job_id")
def stop(job_id: str) -> None:
    """End the Ray cluster of Slurm job JOB_ID cleanly: its drivers and every Ray process of the job stop."""
    from raytrain.service import jobs

    click.echo(f"job {job_id}: {jobs.stop(job_id)}")


@cli.command()
@click.argument("job_id")
def dashboard(job_id: str) -> None:
    """How to open the Ray dashboard of a running Slurm job JOB_ID (ssh tunnel and token file)."""
    from raytrain.service.dashboard import hint

    click.echo(hint(job_id))


def _run_option(f: Any) -> Any:
    f = _storage_option("Where a RUN given by name lives.")(f)
    f = click.option(
        "--checkpoint",
        "which",
        type=click.Choice(["best", "last"]),
        default="best",
        show_default=True,
        help="The run's best checkpoint by validation accuracy, or its newest.",
    )(f)
    return click.argument("run", metavar="RUN")(f)


def _run_at(run: str, storage: str) -> str:
    """RUN as a path (a run or checkpoint directory), else as a run name under --storage."""
    from pyarrow.fs import FileType

    fs, path = uri.resolve(run)
    if fs.get_file_info(path).type == FileType.NotFound and "/" not in run:
        return f"{storage.rstrip('/')}/{run}"
    return run


def _best_of_sweep(run: str) -> str:
    """RUN, or the run of its best trial when RUN is a sweep."""
    from raytrain.service import sweep_report

    fs, path = uri.resolve(run)
    if not sweep_report.is_sweep(fs, path):
        return run
    best = sweep_report.best(fs, path)
    click.echo(f"sweep {run}: its best trial, {best}")
    return best


def _trained(run: str, storage: str, which: str) -> Any:
    from raytrain.recipe import inference

    return inference.load(_best_of_sweep(_run_at(run, storage)), which)


@cli.command()
@_storage_option("Where a RUN given by name lives.")
@click.argument("run", metavar="RUN")
def report(run: str, storage: str) -> None:
    """The history of any raytrain run (RUN: its directory, or its name under --storage) as a table, how
    its last attempt ended, and where its curves are: curves.png, TensorBoard events, history.jsonl. For a
    sweep: its trials ranked, and sweep.png with the best ones' curves."""
    from raytrain.service import curves, sweep_report

    fs, path = uri.resolve(_run_at(run, storage))
    shown = sweep_report.report(fs, path) if sweep_report.is_sweep(fs, path) else curves.report(fs, path)
    click.echo("\n".join(shown))


@cli.command()
@_run_option
@click.option("--data", default=None, metavar="PATH|URI", help="Evaluate on this data. Default: the run's own.")
@click.option(
    "--out",
    default=None,
    metavar="DIR",
    help="Where evaluation.json and confusion.png go. Default: RUN/eval/CHECKPOINT.",
)
def evaluate(run: str, storage: str, which: str, data: str | None, out: str | None) -> None:
    """Accuracy, per-class accuracy and the confusion matrix of a trained run on its validation data (or
    --data), as text, evaluation.json and confusion.png."""
    import json
    import posixpath

    from raytrain.recipe import inference

    trained = _trained(run, storage, which)
    ev = inference.evaluate(trained, uri.canonical(data) if data else None)
    click.echo("\n".join(inference.report(ev)))
    out = out or posixpath.join(trained.run_dir, "eval", posixpath.basename(trained.checkpoint))
    inference.write(posixpath.join(out, "evaluation.json"), json.dumps(ev.to_json(), indent=1).encode())
    inference.confusion_png(ev, posixpath.join(out, "confusion.png"))
    click.echo(f"wrote {out}/evaluation.json and confusion.png")


@cli.command()
@_run_option
@click.argument("images", nargs=-1, required=True, metavar="IMAGE...")
@click.option("--top-k", type=int, default=3, show_default=True)
def predict(run: str, storage: str, which: str, images: tuple[str, ...], top_k: int) -> None:
    """The top classes of each IMAGE file, with their probabilities, by a trained run."""
    from raytrain.recipe import inference

    trained = _trained(run, storage, which)
    for path, top in zip(images, inference.predict(trained, images, top_k), strict=True):
        click.echo(f"{path}: " + ", ".join(f"{name} {p:.3f}" for name, p in top))


@cli.command()
@_run_option
@click.option(
    "--format", "fmt", type=click.Choice(["torchscript", "safetensors"]), default="torchscript", show_default=True
)
@click.option("--out", default=None, metavar="DIR", help="Default: RUN/export.")
def export(run: str, storage: str, which: str, fmt: str, out: str | None) -> None:
    """Write a trained run's model as TorchScript or safetensors, with model.json beside it (class names,
    image size, normalisation)."""
    import posixpath

    from raytrain.recipe import inference

    trained = _trained(run, storage, which)
    out = out or posixpath.join(trained.run_dir, "export")
    for path in inference.export(trained, fmt, out):
        click.echo(f"wrote {path}")
    click.echo(f"from {trained.checkpoint}")


@cli.command("models")
def list_models() -> None:
    """List the torchvision classification models --model accepts by name."""
    from raytrain.recipe.models import classification_models

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
        _stopped()
    except Exception as exc:
        if not _interrupted(exc):
            raise
        _stopped()
    sys.exit(rc if isinstance(rc, int) else 0)


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` came of a Ctrl-C or a SIGTERM: Python wraps a KeyboardInterrupt that lands in some
    places in another exception (one during a class's ``__set_name__``, as a lazy import defines a
    dataclass, becomes a RuntimeError caused by it)."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, KeyboardInterrupt):
            return True
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return False


def _stopped() -> NoReturn:
    """The run was stopped by a signal: say which, and exit as a shell reports that signal."""
    from raytrain.service.cluster import stopped_by_sigterm

    if stopped_by_sigterm():
        click.echo(
            "raytrain: stopped by SIGTERM; the local Ray cluster is shut down. Rerun the same command to "
            "go on from the last checkpoint",
            err=True,
        )
        sys.exit(143)
    click.echo("raytrain: interrupted", err=True)
    sys.exit(130)
