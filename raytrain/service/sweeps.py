"""``raytrain sweep``: many runs of one workload over a search space, packed into the cluster, with Ray Tune.

Each trial is a raytrain run of its own (``raytrain.train`` in a Ray Tune trial, on the cluster the sweep's
driver joined or started): its run directory under the sweep's, its placement, checkpoints, curves,
``result.json`` and the same preemption channel. Rank 0's reports reach Tune (``ray_internals``), whose
scheduler stops the trials that trail (ASHA by default). Trials hold no CPU themselves (Tune's actor for a
trial asks for a byte of memory), so how many run at once is what their workers need against what the
cluster has (a CPU a node left to Ray Data when the data streams): settled here, before anything starts.

The sweep's own record is its directory, not Tune's experiment state (saved every few seconds in the
background, so stale after a kill, and restored with the settings of the first start). Every attempt
starts a new Tune experiment whose search is seeded from the sweep's definition, so trial N draws the same
parameters every time, and each trial first replays its run's history to Tune (so that early stopping
judges it as before): a trial that ended in an earlier attempt (completed, stopped or failed) ends there;
the others train, a preempted one resuming from its checkpoint. A trial whose run is preempted (or about
to start as the job ends) raises, and the sweep exits 75: the job requeues and the same command resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow.fs as pafs
from ray import tune
from ray.tune.result import AUTO_RESULT_KEYS
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule
from ray.tune.search.basic_variant import BasicVariantGenerator

from raytrain import fsio, uri
from raytrain.contracts import env, sweepdir
from raytrain.contracts.metrics import EPOCH
from raytrain.contracts.result import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, RunResult
from raytrain.contracts.rundir import RESULT, HistoryEntry
from raytrain.contracts.sweepdir import SweepMeta, TrialRecord
from raytrain.errors import UserError
from raytrain.service import admission, cluster, curves, placement, preemption, runlock, runs, sweep_report, tracking
from raytrain.service.config import RunConfig, ScaleConfig, Tracker, fingerprint
from raytrain.service.sweep_space import SCHEDULERS, SearchSpace
from raytrain.service.workload import Workload

Echo = Callable[[str], None]
Mode = Literal["max", "min"]
# A result.json older than its trial's start in this attempt by more than this is an earlier attempt's.
STALE_S = 30.0
TRIAL_RESOURCES = {"memory": 1}  # Tune refuses a trial that asks for nothing; its workers hold the CPUs
# The process environment a trial needs from the driver's (a trial runs in a Ray worker, whose environment
# is its raylet's): where the job's directory, token and dashboard are, and the service callback. Not the
# batch driver's mark: the job ends with the sweep's driver, not with a trial.
PASSED = tuple(v.name for v in env.TABLE if v is not env.BATCH_DRIVER)


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """A sweep as the CLI built it. ``workload`` is the base every trial starts from (its parameters set
    by ``with_params``); ``scale`` is one trial's."""

    name: str
    storage: str
    space: SearchSpace
    trials: int  # samples Ray Tune draws; each repeats the grid, when the space has one
    concurrent: int | None  # trials at once (None: as many as the cluster holds)
    metric: str
    mode: Mode
    scheduler: str  # one of sweep_space.SCHEDULERS
    grace: int  # early stopping leaves a trial alone until it has reported this far (epochs, or reports)
    fresh: bool
    workload: Workload
    scale: ScaleConfig
    keep: int
    max_failures: int
    tracker: Tracker | None = None  # each trial logs into the sweep's experiment (unless it names another)

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise UserError(f"--trials {self.trials} is below 1: run at least one trial")
        if self.concurrent is not None and self.concurrent < 1:
            raise UserError(f"--concurrent {self.concurrent} is below 1: run at least one trial at a time")
        if self.scheduler not in SCHEDULERS:
            raise UserError(f"--scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        if self.grace < 1:
            raise UserError(f"--grace {self.grace} is below 1: let a trial report at least once before stopping it")
        RunConfig(storage=self.storage, name=self.name)  # the same rules as a run's name

    def trial_tracker(self) -> Tracker | None:
        """Where each trial logs: the sweep's tracker, in the sweep's own experiment unless one is named."""
        if self.tracker is None or self.tracker.experiment or env.MLFLOW_EXPERIMENT.get():
            return self.tracker
        return dataclasses.replace(self.tracker, experiment=self.name)

    @property
    def total(self) -> int:
        return self.trials * self.space.grid_size

    def meta(self) -> SweepMeta:
        experiment = {k: v for k, v in self.workload.experiment().items() if k not in self.space.names}
        what = {"space": self.space.to_json(), "metric": self.metric, "mode": self.mode, "experiment": experiment}
        return SweepMeta(
            name=self.name,
            space=self.space.to_json(),
            metric=self.metric,
            mode=self.mode,
            trials=self.trials,
            scheduler=self.scheduler,
            experiment=experiment,
            fingerprint=fingerprint(what),
        )


def check(cfg: SweepConfig) -> None:
    """What can be checked before anything starts: the space against the workload, and the metric."""
    cfg.workload.check_space(cfg.space)
    known = cfg.workload.metrics()
    if known is not None and cfg.metric not in known:
        raise UserError(f"--metric {cfg.metric}: the workload never reports it: use one of {', '.join(known)}")


def capacity(nodes: tuple[cluster.NodeInfo, ...], scale: ScaleConfig, workload: Workload) -> tuple[placement.Plan, int]:
    """One trial's plan on the cluster, and how many such trials the cluster holds at once, each worker on
    one node: a CPU of every node is left to Ray Data's tasks when the workload's data streams (a read or
    decode task takes a whole one, and waits for ever where there is none)."""
    plan = placement.make_plan(nodes, scale)
    spare = 1.0 if workload.streams(plan) else 0.0
    per_node = [{"CPU": max(0.0, n.cpus - spare), "GPU": float(n.gpus)} for n in nodes]
    return plan, max(1, admission.holds(per_node, plan.resources_per_worker()) // plan.workers)


def _trial_scale(scale: ScaleConfig) -> ScaleConfig:
    """A trial's scale: a CPU per worker unless told (one run's default, the node's CPUs shared among its
    ranks, would leave no room for a second trial), its workers placed by Ray where the others left room."""
    return dataclasses.replace(scale, cpus_per_worker=scale.cpus_per_worker or 1.0, pinned=False)


def sweep(cfg: SweepConfig, *, echo: Echo = print) -> int:
    """Run (or resume) the sweep; its exit status: 0 when every trial ended (completed, stopped early or
    failed, at least one not failed), 75 when one was preempted (the job's requeue resumes the sweep), 1
    when every trial failed."""
    check(cfg)
    storage = fsio.bounded(lambda: runs.Storage.open(cfg.storage), f"checking --storage {cfg.storage}", writes=True)
    workload = cfg.workload.prepare(storage)  # the data and the model, checked once before any trial
    if (tracker := cfg.trial_tracker()) is not None:  # answering, with the trials' experiment made once
        tracking.Tracking.reach(tracker, cfg.storage, experiment=tracking.experiment(tracker))
    root = posixpath.join(storage.root, cfg.name)
    meta = cfg.meta()
    resuming = _settle(storage.fs, root, meta, fresh=cfg.fresh, echo=echo)
    if resuming:
        before = _statuses({r.name: r.status for r in sweep_report.records(storage.fs, root)}, cfg.total)
        if before <= set(sweepdir.ENDED):  # no cluster, no Tune, for a sweep that is done
            echo("sweep: every trial has ended: nothing to run")
            _echo_ranking(storage.fs, root, echo)
            return _ended_status(before)
    scale = _trial_scale(cfg.scale)
    if (local := cluster.expected_local_node()) is not None:
        _at_once(cfg, workload, (local,), scale)  # before Ray starts: a sweep that cannot fit fails in a second
    storage.fs.create_dir(root, recursive=True)
    if not resuming:  # with the directory: a start that fails after this leaves a sweep the same command resumes
        runs.write_json(storage.fs, posixpath.join(root, sweepdir.SWEEP_META), meta.to_json())
    local_fs = isinstance(storage.fs, pafs.LocalFileSystem)
    held = runlock.held(Path(root), cfg.name, echo) if local_fs else contextlib.nullcontext()
    with held, cluster.connect(dashboard=True) as info:  # one driver a sweep, as a run has
        plan, at_once = _at_once(cfg, workload, info.nodes, scale)
        clock, most = cfg.workload.sweep_clock()
        echo(
            f"sweep: {cfg.total} trial(s) of {cfg.space.describe()}; {at_once} at once, each {_demand(plan)}; "
            f"{cfg.mode}imising {cfg.metric}; early stopping: {_scheduler_text(cfg, clock)}"
        )
        if info.dashboard_url:
            echo(f"dashboard: {info.dashboard_url} (token: {info.token_path})")
        check_metric = _MetricCheck(cfg.metric) if cfg.workload.metrics() is None else None
        progress = Progress(cfg, storage.fs, root, clock, echo)
        _tuner(cfg, storage, root, at_once, clock, most, progress, check_metric, meta).fit()
    if check_metric is not None and check_metric.missing is not None:
        raise UserError(
            f"--metric {cfg.metric}: the trials do not report it (a report had: {', '.join(check_metric.missing)}): "
            f"give one they report, and add --fresh to start the sweep over"
        )
    _echo_ranking(storage.fs, root, echo)
    statuses = _statuses({name: r.status for name, r in progress.records.items()}, cfg.total)
    if statuses & {"preempted", "pending", "running"}:
        echo("sweep: not finished; run the same command again (or let the job requeue) to resume it")
        return EXIT_PREEMPTED
    return _ended_status(statuses)


def _statuses(records: Mapping[str, str], total: int) -> set[str]:
    """The status of every trial of the sweep, by name: one Tune never started (it stopped early, or the
    sweep has not yet run) is still to run, "pending"."""
    return {records.get(sweepdir.trial_name(i), "pending") for i in range(total)}


def _ended_status(statuses: set[str]) -> int:
    """A sweep whose every trial ended: 0, unless every one of them failed."""
    return EXIT_OK if statuses - {"failed"} else EXIT_FAILED


def _echo_ranking(fs: pafs.FileSystem, root: str, echo: Echo) -> None:
    for line in sweep_report.table(sweep_report.ranked(fs, root)):
        echo(line)


def _settle(fs: pafs.FileSystem, root: str, meta: SweepMeta, *, fresh: bool, echo: Echo) -> bool:
    """Whether the sweep resumes: its directory holds this same sweep. Another sweep there is refused,
    unless --fresh, which moves it aside."""
    meta_path = posixpath.join(root, sweepdir.SWEEP_META)
    found = fs.get_file_info(root).type == pafs.FileType.Directory
    if found and fresh:
        runs.refuse_move(fs, root, f"--fresh: sweep {meta.name!r}")
        if isinstance(fs, pafs.LocalFileSystem):
            runlock.check_free(Path(root), meta.name)  # a sweep still running is not moved from under it
        moved = runs.aside(root)
        runs.move_aside(fs, root, moved, f"--fresh: sweep {meta.name!r}")
        echo(f"sweep: --fresh: the previous sweep moves to {moved}")
        return False
    if not found:
        return False
    if fs.get_file_info(meta_path).type != pafs.FileType.File:
        raise UserError(f"{root} exists but is not a raytrain sweep: pick another --name or --storage")
    old = SweepMeta.from_json(runs.read_json(fs, meta_path))
    if old.fingerprint != meta.fingerprint:
        changed = runs.diff(
            {"space": old.space, "metric": old.metric, "mode": old.mode, **old.experiment},
            {"space": meta.space, "metric": meta.metric, "mode": meta.mode, **meta.experiment},
        )
        raise UserError(
            f"sweep {meta.name!r} in {posixpath.dirname(root)} was started with other settings ({changed}): repeat "
            "them to resume it, pick another --name, or add --fresh to start over (the old sweep is moved aside)"
        )
    echo(f"sweep: {root}: resuming (finished trials kept, stopped ones stay stopped)")
    return True


def _at_once(
    cfg: SweepConfig, workload: Workload, nodes: tuple[cluster.NodeInfo, ...], scale: ScaleConfig
) -> tuple[placement.Plan, int]:
    """A trial's plan, and how many trials run at once: --concurrent if the cluster holds that many, else
    as many as it holds (never more than the sweep has)."""
    plan, fits = capacity(nodes, scale, workload)
    if cfg.concurrent is not None and cfg.concurrent > fits:
        cpus = sum(n.cpus for n in nodes)
        gpus = sum(n.gpus for n in nodes)
        raise UserError(
            f"--concurrent {cfg.concurrent}: a trial takes {_demand(plan)}, and the cluster ({len(nodes)} node(s), "
            f"{cpus:g} CPUs{f', {gpus} GPUs' if gpus else ''}) holds {fits} at once: use --concurrent {fits} or "
            "fewer, fewer --workers or --cpus-per-worker, or a larger allocation"
        )
    return plan, min(cfg.concurrent or fits, cfg.total)


def _demand(plan: placement.Plan) -> str:
    gpus = f" and {plan.workers} GPU(s)" if plan.use_gpu else ""
    return f"{plan.workers} worker(s) x {plan.cpus_per_worker:g} CPU{gpus}"


def _scheduler_name(cfg: SweepConfig) -> str:
    return {"asha": "ASHA", "median": "the median stopping rule"}.get(cfg.scheduler, cfg.scheduler)


def _scheduler_text(cfg: SweepConfig, clock: str) -> str:
    if cfg.scheduler == "none":
        return "none (every trial runs to its end)"
    return f"{_scheduler_name(cfg)} by {clock} (no trial stopped before {clock} {cfg.grace})"


class _Asha(ASHAScheduler):  # type: ignore[misc]
    """ASHA that lets a trial at its last epoch finish, so that its run ends as a run does (result.json, its
    best checkpoint kept): stopping it there saves no training. Its value still counts, when it completes."""

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        if self._max_t and result.get(self._time_attr, 0) >= self._max_t:
            return str(self.CONTINUE)
        return str(super().on_trial_result(tune_controller, trial, result))


def _scheduler(cfg: SweepConfig, clock: str, most: int | None) -> Any:
    if cfg.scheduler == "asha":
        return _Asha(time_attr=clock, max_t=most or 10**9, grace_period=cfg.grace, reduction_factor=3)
    if cfg.scheduler == "median":
        return MedianStoppingRule(time_attr=clock, grace_period=cfg.grace, min_samples_required=3)
    return FIFOScheduler()


def _tuner(
    cfg: SweepConfig,
    storage: runs.Storage,
    root: str,
    at_once: int,
    clock: str,
    most: int | None,
    progress: Progress,
    check_metric: _MetricCheck | None,
    meta: SweepMeta,
) -> Any:
    """A new Tune experiment for this attempt (under ``tune/<time>``), its search seeded from the sweep's
    definition: trial N draws the same parameters in every attempt."""
    environ = {k: v for k in PASSED if (v := os.environ.get(k)) is not None}
    env.apply_ray_defaults(os.environ, tune=True)  # Tune's tables and tracebacks: a line per event instead
    runs_uri = f"{cfg.storage.rstrip('/')}/{cfg.name}/{sweepdir.RUNS}"
    trainable = tune.with_resources(
        tune.with_parameters(_trial, sweep=cfg, runs_uri=runs_uri, environ=environ, clock=clock), TRIAL_RESOURCES
    )
    seed = int(meta.fingerprint[:8], 16)
    return tune.Tuner(
        trainable,
        param_space=cfg.space.to_tune(),
        tune_config=tune.TuneConfig(
            metric=cfg.metric,
            mode=cfg.mode,
            num_samples=cfg.trials,
            search_alg=BasicVariantGenerator(max_concurrent=at_once, random_state=seed),
            scheduler=_scheduler(cfg, clock, most),
            reuse_actors=False,
        ),
        run_config=tune.RunConfig(
            name=runs.now(),
            storage_path=posixpath.join(root, sweepdir.TUNE),
            storage_filesystem=storage.fs,
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=0),
            stop=check_metric,
            callbacks=[progress, *([check_metric] if check_metric else [])],
        ),
    )


class _MetricCheck(tune.Stopper, tune.Callback):  # type: ignore[misc]
    """For a workload whose metrics are not known before it runs: the sweep ends once a trial has ended
    without ever reporting the metric, rather than ranking and stopping trials on nothing; ``missing`` then
    names what its last report had."""

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.reported: set[str] = set()  # the trials that reported it
        self.last: dict[str, list[str]] = {}  # each trial's last report's keys
        self.missing: list[str] | None = None

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if self.metric in result:
            self.reported.add(trial_id)
        own = (*AUTO_RESULT_KEYS, "done", "trial_id", sweepdir.REPLAYED)
        if keys := sorted(k for k in result if k not in own):  # Tune's own last result of a trial has none
            self.last[trial_id] = keys
        return False

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        """A trial that reported and never the metric (one that never reported, as a run that failed first,
        says nothing of it)."""
        if trial.trial_id not in self.reported and self.last.get(trial.trial_id) and self.missing is None:
            self.missing = self.last[trial.trial_id]

    def stop_all(self) -> bool:
        return self.missing is not None


class TrialEnded(Exception):
    """A trial's run stopped early and resumes with the sweep (the job ends soon, or the cluster failed
    under it): Tune records the trial as errored, and the sweep's next attempt runs it again."""


def _trial(
    params: dict[str, Any], *, sweep: SweepConfig, runs_uri: str, environ: Mapping[str, str], clock: str
) -> None:
    """One trial, in Ray Tune's actor for it: a raytrain run named after the trial's number. Its run's
    history goes to Tune first; a trial that ended in an earlier attempt ends there."""
    from raytrain.service.trainer import train

    os.environ.update(environ)
    name = _named(tune.get_context().get_trial_id())
    fs, runs_root = uri.resolve(runs_uri)
    for metrics in _replayed(curves.read_history(fs, posixpath.join(runs_root, name)), clock):
        tune.report({**metrics, sweepdir.REPLAYED: True})
    before = {r.name: r for r in sweep_report.records(fs, posixpath.dirname(runs_root))}.get(name)
    if (before is not None and before.status in sweepdir.ENDED) or _completed(fs, posixpath.join(runs_root, name)):
        return  # (a run that completed while its driver died, before trials.json said so, counts too)
    if preemption.job_ending():  # a trial that would start as the job ends starts with its next attempt
        raise TrialEnded("not started: the job ends soon")
    run = RunConfig(
        storage=runs_uri, name=name, keep=sweep.keep, max_failures=sweep.max_failures, tracker=sweep.trial_tracker()
    )

    def echo(line: str) -> None:  # the trial's lines go to its Ray worker's log, each marked
        print(f"{name}: {line}", flush=True)

    result = train(sweep.workload.with_params(params), scale=_trial_scale(sweep.scale), run=run, echo=echo)
    if result is not None and result.status in ("preempted", "lost", "cancelled"):
        raise TrialEnded(f"its run ended {result.status}" + (f": {result.error}" if result.error else ""))


def _replayed(entries: list[HistoryEntry], clock: str) -> list[dict[str, Any]]:
    """What a trial reported before, as Tune is to hear it again: by the clock, or else the epoch, when the
    reports carry it (the newest report of each: an epoch a preemption cut short and the resume finished
    counts once), else every report in turn."""
    by = next((k for k in (clock, EPOCH) if any(k in e.metrics for e in entries)), None)
    if by is not None:  # a resumed run's reports after its checkpoint, redone, count once
        latest = {e.metrics[by]: e.metrics for e in entries if isinstance(e.metrics.get(by), int | float)}
        return [dict(m) for _, m in sorted(latest.items())]
    return [dict(e.metrics) for e in entries]


def _run_result(fs: pafs.FileSystem, run_path: str) -> RunResult | None:
    """The run's result.json (its last attempt's outcome), if it has a readable one."""
    try:
        return RunResult.from_json(runs.read_json(fs, posixpath.join(run_path, RESULT)))
    except (FileNotFoundError, OSError, ValueError, KeyError):
        return None


def _completed(fs: pafs.FileSystem, run_path: str) -> bool:
    """Whether the run's last attempt completed it."""
    result = _run_result(fs, run_path)
    return result is not None and result.status == "completed"


class Progress(tune.Callback):  # type: ignore[misc]
    """The sweep's driver side: a line per trial event, and the trial table (``trials.json``) kept current,
    by trial name (the same trial in every attempt)."""

    def __init__(self, cfg: SweepConfig, fs: pafs.FileSystem, root: str, clock: str, echo: Echo) -> None:
        self.cfg, self.fs, self.root, self.clock, self.echo = cfg, fs, root, clock, echo
        self.records = {r.name: r for r in sweep_report.records(fs, root)}
        self.started: dict[str, float] = {}  # when each started in this attempt

    def _save(self, trial: Any, status: sweepdir.TrialStatus, error: str | None = None) -> TrialRecord:
        name = _name(trial)
        params = {k: trial.config[k] for k in self.cfg.space.names if k in trial.config}
        record = TrialRecord(name=name, trial_id=trial.trial_id, params=params, status=status, error=error)
        self.records[name] = record
        path = posixpath.join(self.root, sweepdir.TRIALS)
        runs.write_json(self.fs, path, [r.to_json() for r in sorted(self.records.values(), key=lambda r: r.name)])
        return record

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        before = self.records.get(_name(trial))
        self.started[_name(trial)] = time.time()
        if before is not None and before.status in sweepdir.ENDED:
            return  # it replays its history to Tune, and ends as it did
        record = self._save(trial, "running")
        resumes = " (resuming)" if before is not None and before.status == "preempted" else ""
        self.echo(f"sweep: {record.name} started{resumes}: {sweep_report.params_text(record.params)}")

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        value, name = result.get(self.cfg.metric), _name(trial)
        record, replayed = self.records.get(name), result.get(sweepdir.REPLAYED)
        said = record is not None and record.status == "running" and not replayed
        if said and sweep_report.number(value) and self.clock in result:
            self.echo(f"sweep: {name} {self.clock} {result[self.clock]}  {self.cfg.metric} {value:.4g}")

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        before = self.records.get(_name(trial))
        if before is not None and before.status in sweepdir.ENDED:
            return  # ended in an earlier attempt, and replayed
        ended = self._outcome(trial)
        if ended is not None and ended.status in ("completed", "failed"):
            record = self._save(trial, ended.status, ended.error)
            self.echo(f"sweep: {record.name} {ended.status}" + (f": {ended.error}" if ended.error else ""))
            return
        record = self._save(trial, "stopped")
        self._settle(trial, "stopped")
        last = trial.last_result or {}
        at = f" at {self.clock} {last[self.clock]}" if self.clock in last else ""
        self.echo(f"sweep: {record.name} stopped early by {_scheduler_name(self.cfg)}{at}")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        before = self.records.get(_name(trial))
        if before is not None and before.status in sweepdir.ENDED:
            return  # ended in an earlier attempt: an error while it replayed (its node lost) changes nothing
        ended = self._outcome(trial)
        # Its run ended early (the job ends soon, the cluster failed under it), or it never started because
        # the job is ending: the sweep's next attempt resumes it. A run its user cancelled stays ended.
        cancelled = ended is not None and ended.status == "cancelled"
        resumable = (ended is not None and ended.status in ("preempted", "lost")) or (
            preemption.job_ending() and not cancelled
        )
        if resumable:
            why = "not started: the job ends soon"
            if ended is not None and ended.status == "preempted":
                why = "stopped with a checkpoint, as the job ends soon"
            elif ended is not None and ended.status == "lost":
                why = f"the cluster failed under it ({ended.error})"
            record = self._save(trial, "preempted", why)
            self.echo(f"sweep: {record.name} preempted: {why}; it resumes with the sweep")
        else:
            record = self._save(trial, "failed", (ended.error if ended is not None else None) or _error_line(trial))
            self._settle(trial, "failed")
            self.echo(f"sweep: {record.name} failed: {record.error}; the sweep goes on without it")

    def _settle(self, trial: Any, status: str) -> None:
        """The trial's tracked run ends too, when its own driver could not say so (Tune stopped its actor)."""
        if self.cfg.tracker is not None:
            tracking.settle(self.fs, posixpath.join(self.root, sweepdir.RUNS, _name(trial)), status, self.echo)

    def _outcome(self, trial: Any) -> RunResult | None:
        """What the trial's run wrote in its result.json in this attempt (one from an earlier attempt says
        nothing of this one)."""
        run_path = posixpath.join(self.root, sweepdir.RUNS, _name(trial))
        if (result := _run_result(self.fs, run_path)) is None:
            return None
        info = self.fs.get_file_info(posixpath.join(run_path, RESULT))
        # Written in this attempt (the file server's clock may differ from this host's by seconds; attempts
        # are minutes apart), or a completed run, which stays completed.
        fresh = info.mtime is not None and info.mtime.timestamp() >= self.started.get(_name(trial), 0.0) - STALE_S
        return result if fresh or result.status == "completed" else None


def _named(trial_id: str) -> str:
    """A trial's run name, from Tune's trial id (<experiment>_<number>): its number is the same in every
    attempt, as are its parameters (the search is seeded)."""
    return sweepdir.trial_name(int(trial_id.rsplit("_", 1)[1]))


def _name(trial: Any) -> str:
    return _named(trial.trial_id)


def _error_line(trial: Any) -> str:
    """The last line of a trial's error as Tune wrote it (the exception, its type's module left out)."""
    try:
        with open(trial.error_file) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except (OSError, TypeError):
        lines = []
    return re.sub(r"^[\w.]+(Error|Ended|Exception): ", "", lines[-1]) if lines else "no error message"
