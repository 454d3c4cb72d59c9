"""What a run trains: a Ray Train per-worker function and what it needs, as the service sees it.

``raytrain.train(workload, ...)`` runs any ``Workload`` with the same placement, auth, ports, storage,
resume, preemption, progress and ``result.json``. ``TrainFunction`` wraps a plain
``train_loop_per_worker``; the built-in image classifier (``raytrain.recipe``) is another subclass, and
uses nothing else of the service.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow.fs as pafs

from raytrain import uri
from raytrain.contracts.result import Kind, RunResult
from raytrain.errors import UserError
from raytrain.service import outcomes
from raytrain.service.cluster import ClusterInfo
from raytrain.service.placement import Plan
from raytrain.service.runs import RunDir, Storage

if TYPE_CHECKING:
    from raytrain.service.events import Report
    from raytrain.service.sweep_space import SearchSpace


@dataclass(frozen=True)
class Placed:
    """What a workload learns once the cluster is up and the plan is made."""

    plan: Plan
    cluster: ClusterInfo
    run: RunDir


class Workload:
    """A training function plus the hooks the service calls around it, in this order:

    ``prepare`` (check inputs, before anything starts) -> ``experiment``/``settings`` (recorded in the run
    directory; a resume must repeat the experiment) -> ``describe`` and ``resume_note`` (printed) ->
    ``nothing_to_do`` -> ``check_workers`` and ``check_plan`` (once the plan is known, before the run
    directory is written) -> ``loop_config`` and ``datasets`` -> ``report_line`` per report -> ``finish``
    and ``done_line``.
    """

    kind: ClassVar[Kind] = "train-func"
    # Directories the workload keeps in the run besides Ray Train's checkpoints (never taken for cut-short
    # uploads).
    own_dirs: ClassVar[tuple[str, ...]] = ()
    # Whether ``intact`` checks a checkpoint's contents itself, with or without the service's manifest (so
    # that a whole checkpoint Ray failed to register is told from an upload cut short).
    checks_contents: ClassVar[bool] = False
    # Whether a run of one worker reads each dataset whole, executed in the worker's own process, rather
    # than through Ray Train's default split of one (a coordinator actor, ``trainer.data_config``). Only a
    # workload whose function reads its shards through the public iterator API alone should say so: a
    # function written for Ray Train gets Ray Train's own shards (a ``streaming_split`` iterator, with its
    # ``world_size()``).
    whole_for_one: ClassVar[bool] = False

    def train_func(self) -> Callable[..., Any]:
        raise NotImplementedError

    def prepare(self, storage: Storage) -> Workload:
        """Check inputs before any cluster starts (raise ``UserError``); return the resolved workload."""
        return self

    def experiment(self) -> dict[str, Any]:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        return self.experiment()

    def describe(self) -> list[str]:
        return []

    def intact(self, fs: pafs.FileSystem, checkpoint: str) -> bool:
        """Whether a checkpoint directory holds what the training function needs to resume (the service
        has already checked it against its manifest)."""
        return True

    def resume_note(self, run: RunDir) -> str | None:
        """How the run resumes ("resuming from ..."), or None for a new run."""
        found = run.resume.latest
        return f"resuming from {posixpath.basename(found)}" if found else None

    def nothing_to_do(self, run: RunDir) -> str | None:
        return None

    def check_workers(self, workers: int) -> None:
        """Refuse (``UserError``) a worker count the workload cannot use, e.g. more workers than rows."""

    def check_plan(self, plan: Plan, *, dry_run: bool) -> list[str]:
        """Once the plan is made (after ``check_workers``): refuse (``UserError``) a plan the workload
        cannot run on, such as a model whose state does not fit a GPU. Lines returned are printed with
        the plan (``dry_run``: the plan is only printed; the workload may say more)."""
        return []

    def loop_config(self, placed: Placed) -> object | None:
        """The training function's argument (a Ray Train function's config dict; any picklable object, such
        as the recipe's frozen loop config), or None when it takes no argument."""
        return None

    def datasets(self, placed: Placed) -> dict[str, Any]:
        return {}

    def report_line(self, report: Report, index: int) -> str | None:
        return outcomes.report_line(report.rank0, index)

    def after_report(self, report: Report, run: RunDir) -> str | None:
        """Called for each report after its line is printed, on the driver's report thread; a checkpoint
        the report names is complete in storage (the recipe keeps a copy of the best one). A line
        returned is printed."""
        return None

    def finish(self, result: RunResult, run: RunDir) -> RunResult:
        return result

    # --- sweeps (``raytrain sweep``): each trial is this workload with some parameters set -------------

    def with_params(self, params: Mapping[str, Any]) -> Workload:
        """This workload with a trial's parameters set (a ``UserError`` for a value it cannot take)."""
        raise UserError(f"a {self.kind} workload takes no sweep parameters")

    def check_space(self, space: SearchSpace) -> None:
        """Refuse (``UserError``) a search space the workload cannot take, before any trial starts: by
        default, any setting at the ends of each parameter's range that ``with_params`` refuses."""
        for param, corner in space.corners():
            try:
                self.with_params(corner)
            except UserError as exc:
                raise UserError(f"--param {param}: {exc}") from None

    def streams(self, plan: Plan) -> bool:
        """Whether its data streams through Ray Data on PLAN (whose read and decode tasks then need a whole
        CPU of a node beside the workers): a sweep leaves one a node when it packs trials together."""
        return False

    def metrics(self) -> tuple[str, ...] | None:
        """The metrics its reports carry, when known before it runs (a sweep's --metric must be one)."""
        return None

    def sweep_clock(self) -> tuple[str, int | None]:
        """What early stopping counts progress by (a metric every report carries), and its most (None: not
        known): Ray Tune's count of reports by default."""
        return "training_iteration", None

    def done_line(self, result: RunResult) -> str:
        last = outcomes.values_text(result.final)
        return (
            f"done: {result.reports_this_attempt} report(s), {result.world_size} workers, "
            f"{result.wall_time_s:.0f} s" + (f"; last: {last}" if last else "")
        )


def parse_config(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``k=v`` pairs: v as JSON when it parses (numbers, true/false, lists), else as a string."""
    config: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--config {item!r} is not KEY=VALUE: give e.g. --config lr=0.01")
        try:
            config[key] = json.loads(raw)
        except ValueError:
            config[key] = raw
    return config


def dataset_paths(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--data`` for a train function: ``NAME=PATH`` each, or one ``PATH`` that becomes "train" (and
    "val"/"validation"/"test" too, when it holds those subdirectories of Parquet files)."""
    named: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if sep and name.isidentifier():
            named[name] = uri.canonical(path)
            continue
        path = uri.canonical(item)
        fs, root = uri.resolve(path)
        splits = [s for s in ("train", "val", "validation", "test") if _is_dir(fs, posixpath.join(root, s))]
        if "train" in splits:
            named.update({s: posixpath.join(path, s) for s in splits})
        else:
            named["train"] = path
    return named


def _is_dir(fs: pafs.FileSystem, path: str) -> bool:
    return bool(fs.get_file_info(path).type == pafs.FileType.Directory)


@dataclass(frozen=True)
class TrainFunction(Workload):
    """A user's ``train_loop_per_worker`` under raytrain: ``func(config)`` (or ``func()``) on every worker.

    func: the function (importable on every node); spec: how the user named it (``mypkg.train:fn``),
    recorded in the run; config: its config dict; data: dataset name -> Parquet path or URI, each read
    with ``ray.data.read_parquet`` and sharded by Ray Train (``ray.train.get_dataset_shard(name)``).
    """

    func: Callable[..., Any]
    spec: str
    config: Mapping[str, Any] = field(default_factory=dict)
    data: Mapping[str, str] = field(default_factory=dict)

    def train_func(self) -> Callable[..., Any]:
        return self.func

    def prepare(self, storage: Storage) -> TrainFunction:
        from raytrain.service.wrapper import required_args

        if required_args(self.func) > 1:
            raise UserError(
                f"--train-func {self.spec} takes {required_args(self.func)} arguments: a Ray Train function takes "
                "its config dict, or nothing"
            )
        for name, path in self.data.items():
            fs, root = uri.resolve(path)
            if fs.get_file_info(root).type == pafs.FileType.NotFound:
                raise UserError(f"--data {name}={path} does not exist: give a Parquet file or directory")
        return self

    def experiment(self) -> dict[str, Any]:
        return {"train_func": self.spec, "config": dict(self.config), "data": dict(self.data)}

    def describe(self) -> list[str]:
        data = ", ".join(f"{k}={v}" for k, v in self.data.items())
        return [f"train function: {self.spec}" + (f"; datasets: {data}" if data else "")]

    def check_plan(self, plan: Plan, *, dry_run: bool) -> list[str]:
        """A plan that leaves Ray Data's reads of the datasets no whole CPU is refused, not left to hang."""
        if self.data:
            plan.check_data_cpus("--data hands the function datasets that stream")
        return []

    def loop_config(self, placed: Placed) -> dict[str, Any] | None:
        from raytrain.service.wrapper import required_args

        return dict(self.config) if required_args(self.func) == 1 else None

    def streams(self, plan: Plan) -> bool:
        return bool(self.data)

    def with_params(self, params: Mapping[str, Any]) -> TrainFunction:
        """The function's config with the trial's parameters set, keys added or replaced."""
        return dataclasses.replace(self, config={**self.config, **params})

    def datasets(self, placed: Placed) -> dict[str, Any]:
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        return {name: ray.data.read_parquet(path) for name, path in self.data.items()}
