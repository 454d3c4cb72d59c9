"""``raytrain.train``: run a workload on the job's Ray cluster (or a private local one), as a service.

Order matters: every check that can fail on user input (storage, the workload's inputs, the run name,
the worker count) runs before any worker starts, so mistakes cost seconds and never touch existing
checkpoints; the run directory is only created once training starts.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import posixpath
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raytrain import __version__, fsio, slurm_env
from raytrain.contracts import env, jobdir, rundir
from raytrain.contracts import metrics as keys
from raytrain.contracts.result import EXIT_CANCELLED, Resize, Restart, RunResult, Status
from raytrain.service import admission, checkpoint_index, cluster, outcomes, placement, runlock, runs
from raytrain.service.config import RunConfig, ScaleConfig
from raytrain.service.live import LiveProgress, progress_every
from raytrain.service.workload import Placed, Workload

if TYPE_CHECKING:
    import ray.train

    from raytrain.service.events import Report
    from raytrain.service.reports import Events, Reports
    from raytrain.service.tracking import Tracking

Echo = Callable[[str], None]


def train(
    workload: Workload,
    *,
    scale: ScaleConfig,
    run: RunConfig,
    echo: Echo = print,
    dry_run: bool = False,
    command_started: float | None = None,
) -> RunResult | None:
    """Train ``workload`` with one Ray Train worker per GPU (or CPU workers); None for a dry run or when
    the run has nothing left to do. ``result.status`` says how the attempt ended; a preempted attempt
    resumes when the same call is made again (the batch script's requeue does that). A run that yields its
    room to a run of higher priority on a shared cluster queues again here and resumes from its checkpoint
    when room returns.

    Start-up timings (the first step's line, ``result.json``'s ``startup_s``, ``wall_time_s``) count from
    the batch job's start inside one, else from ``command_started`` (UNIX time: the CLI passes its
    process's start, so the interpreter's and the imports' seconds count too), else from this call."""
    started = command_started if command_started is not None else time.time()
    what = "command" if command_started is not None else "call"
    every = progress_every()  # checked before anything starts, as is the storage timeout
    env.STORAGE_TIMEOUT.value()
    env.ELASTIC_CHECK.value()
    # Storage that stalls or fails is said in one line, within RAYTRAIN_STORAGE_TIMEOUT (opening it writes a
    # probe file, which a stalled mount may still take).
    storage = fsio.bounded(lambda: runs.Storage.open(run.storage), f"checking --storage {run.storage}", writes=True)
    wl = workload.prepare(storage)
    experiment = wl.experiment()
    run_dir = fsio.bounded(
        lambda: runs.open_run(
            storage, run, experiment=experiment, intact=wl.intact, checks_contents=wl.checks_contents
        ),
        f"reading run {run.name!r} in {storage.uri}",
    )
    for line in wl.describe():
        echo(line)
    if run_dir.moved_aside:
        echo(f"run: --fresh: the previous run moves to {run_dir.moved_aside}")
    echo(f"run: {run_dir.path}: {wl.resume_note(run_dir) or 'new run'}")
    for said in run_dir.resume.notes():
        echo(f"run: {said}")
    if (done := wl.nothing_to_do(run_dir)) is not None:
        echo(done)
        return None
    if run.tracker is not None and not dry_run:  # reached before the cluster starts: a wrong URI costs seconds
        from raytrain.service.tracking import Tracking

        if not Tracking.tracked_before(run_dir):  # a later attempt goes on untracked rather than not at all
            Tracking.reach(run.tracker, storage.uri)
    local = cluster.expected_local_node()
    if local is not None:  # plan before booting Ray, so a bad request fails in a second
        plan = placement.make_plan([local], scale)
        wl.check_workers(plan.workers)
        notes = wl.check_plan(plan, dry_run=dry_run)
        if dry_run:
            _print_plan(wl, _resolved(scale, plan), run, plan, echo, notes)
            return None
    with cluster.connect(dashboard=True) as info:
        plan = placement.make_plan(info.nodes, scale)
        wl.check_workers(plan.workers)
        notes = wl.check_plan(plan, dry_run=dry_run)
        scale = _resolved(scale, plan)
        if dry_run:
            _print_plan(wl, scale, run, plan, echo, notes)
            return None
        if len(plan.nodes) > 1:
            runs.check_shared(storage, lambda path: cluster.not_seeing(path, plan.nodes))
        echo(plan.render())
        for line in notes:
            echo(line)
        if info.dashboard_url:
            echo(f"dashboard: {info.dashboard_url} (token: {info.token_path})")
        if (note := run_dir.workers_note(plan.workers)) is not None:
            echo(note)
        settings = _settings(wl, scale, run)
        claim = runs.claimed(run_dir, experiment=experiment, settings=settings, workers=plan.workers, echo=echo)
        with claim as (run_dir, lock):
            tracked = _tracking(run, run_dir, settings, echo)
            try:
                while True:
                    live = LiveProgress(echo, every_s=every)
                    placed = Placed(plan=plan, cluster=info, run=run_dir)
                    result = _fit(wl, placed, scale, run, settings, live, started, what, lock, tracked)
                    if result.status == "cancelled":  # said before its ticket goes (the batch script's requeue)
                        jobdir.note_driver_ended(EXIT_CANCELLED)
                    if not _yielded(result):
                        return result
                    # Its ticket waits in its place; the run's lock stays held meanwhile.
                    echo(f"run: {run.name}: queued again, it resumes when room returns")
                    run_dir = fsio.bounded(
                        functools.partial(runs.settled_again, run_dir), f"settling run {run.name!r}", writes=True
                    )
                    echo(f"run: {run_dir.path}: {wl.resume_note(run_dir) or 'new run'}")
            except admission.Cancelled:
                jobdir.note_driver_ended(EXIT_CANCELLED)
                if tracked is not None:
                    tracked.cancelled()
                raise
            finally:
                admission.leave_all(run.name)


def _yielded(result: RunResult) -> bool:
    """Whether the attempt yielded its room to a run of higher priority, to resume here once room returns
    (not when the job itself ends: the batch script's requeue resumes it then)."""
    if result.status != "preempted" or result.preempted_via != jobdir.YIELD:
        return False
    from raytrain.service import preemption

    return not preemption.job_ending()


def _tracking(run: RunConfig, run_dir: runs.RunDir, settings: dict[str, Any], echo: Echo) -> Tracking | None:
    """The run's tracker, reached before any worker starts (a UserError if it cannot be)."""
    if run.tracker is None:
        return None
    from raytrain.service.tracking import Tracking

    tags = {"raytrain.run": run_dir.path, "raytrain.job": slurm_env.job_label()}
    return Tracking.open(run.tracker, run_dir=run_dir, run_name=run.name, settings=settings, tags=tags, echo=echo)


def _resolved(scale: ScaleConfig, plan: placement.Plan) -> ScaleConfig:
    return dataclasses.replace(scale, workers=plan.workers, cpus_per_worker=plan.cpus_per_worker)


def _settings(wl: Workload, scale: ScaleConfig, run: RunConfig) -> dict[str, Any]:
    return {**wl.settings(), "scale": dataclasses.asdict(scale), "run": dataclasses.asdict(run)}


def _print_plan(
    wl: Workload, scale: ScaleConfig, run: RunConfig, plan: placement.Plan, echo: Echo, notes: list[str]
) -> None:
    echo("config: " + json.dumps(_settings(wl, scale, run), indent=2, sort_keys=True))
    echo(plan.render())
    for line in notes:
        echo(line)


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """What the outcome of one attempt is measured against."""

    started: float  # when the command started (its process), or the call
    since: float  # the job's start inside a batch job, else ``started``
    what: str  # "job", "command" or "call"
    resumes_from: str | None  # the checkpoint Ray Train resumes from, if any


def _fit(
    wl: Workload,
    placed: Placed,
    scale: ScaleConfig,
    run: RunConfig,
    settings: dict[str, Any],
    live: LiveProgress,
    started: float,
    what: str,
    lock: runlock.Lock | None,
    tracked: Tracking | None = None,
) -> RunResult:
    import ray.train

    from raytrain.service.curves import Curves
    from raytrain.service.events import WorkersFailed
    from raytrain.service.reports import Elastic, Reports
    from raytrain.service.telemetry import ReportGauges

    job_start = cluster.job_start_time()
    attempt = _Attempt(
        started=started,
        since=job_start or started,
        what="job" if job_start else what,
        resumes_from=placed.run.resume.latest,
    )

    plan = placed.plan
    world = [plan.workers]
    echo = live.echo  # every line of the driver wipes the live progress line first
    curves = Curves(placed.run.fs, placed.run.path, attempt.started, title=f"{run.name} ({wl.kind})")
    gauges = ReportGauges(run.name, slurm_env.job_label())

    def on_report(report: Report) -> None:
        index = len(reports.events.reports)
        gauges.set(report.rank0)
        if lock is not None and not lock.still_held():
            return  # the run is another driver's now: nothing more is written into it
        if (note := curves.add(report.rank0, report.received_at)) is not None:
            echo(note)
        if plan.min_workers is not None and len(report.metrics) != world[0]:
            echo(f"workers: {len(report.metrics)} now, were {world[0]} (elastic: {plan.min_workers} to {plan.workers})")
            world[0] = len(report.metrics)
        startup = report.rank0.get(keys.STARTUP) if index == 1 else None
        if startup and startup.get("first_step_at"):
            workers_at = max((w.started_at for w in reports.events.workers.values()), default=attempt.since)
            echo(
                f"first training step {startup['first_step_at'] - attempt.since:.1f} s after the {attempt.what} "
                f"started (workers running at {workers_at - attempt.since:.1f} s, "
                f"first batch at {startup['first_batch_at'] - attempt.since:.1f} s)"
            )
        if tracked is not None:
            tracked.report(report.rank0, report.received_at)
        if (line := wl.report_line(report, index)) is not None:
            echo(line)
        if (note := wl.after_report(report, placed.run)) is not None:
            echo(note)

    def on_failure(failed: WorkersFailed) -> None:
        count = len(reports.events.failures)
        if failed.fatal:
            then = "not retried: no retry can fix this"
        elif failed.too_few:
            then = f"the nodes left cannot hold {plan.min_workers} workers: the attempt ends"
        elif count <= run.max_failures:
            then = "Ray Train restarts the workers from the newest checkpoint "
            if plan.min_workers is not None:
                then += f"(elastic: as many as the nodes left hold, at least {plan.min_workers}) "
            then += f"(failure {count} of at most {run.max_failures})"
        else:
            then = "no retries left"
        ranks = ", ".join(str(r) for r in failed.ranks)
        echo(f"workers failed (rank {ranks}: {failed.error}); {then}")

    elastic = Elastic(plan.min_workers, plan.resources_per_worker()) if plan.min_workers is not None else None
    reports = Reports(on_report, on_failure, elastic, on_progress=live.show)
    trainer = _trainer(wl, placed, scale, run, reports, lock.guard() if lock else None)
    error: BaseException | None = None
    aborted: BaseException | None = None
    try:
        with reports:
            try:
                trainer.fit()
            except ray.train.TrainingFailedError as exc:
                error = exc
            except ray.exceptions.RayActorError as exc:  # its controller stopped: by raytrain cancel, or lost
                aborted = exc
            except SystemExit as exc:
                # Ray Train's own Ctrl-C handler aborts the run, then ends it with SystemExit(1): make that the
                # interruption it is, so the local cluster is stopped and the CLI says so (exit 130).
                raise KeyboardInterrupt from exc
    finally:
        live.close()
        if (note := curves.close(draw=lock is None or lock.still_held())) is not None:
            echo(note)
    ended = reports.events.ended_early
    if aborted is not None and not reports.events.cancelled:
        raise aborted
    run_dir = placed.run
    if lock is not None:  # a driver that lost its run writes nothing more into it (LockLost: one line)
        fsio.bounded(lock.check, f"checking the lock of run {run.name!r}")
    result = wl.finish(_result(wl, placed, run, settings, reports.events, error, attempt), run_dir)
    where = placed.run.file(rundir.RESULT)
    try:
        fsio.bounded(lambda: runs.write_json(placed.run.fs, where, result.to_json()), f"writing {where}", writes=True)
    except fsio.StorageError as exc:  # the storage itself failed (full, gone, stalled): the outcome still gets said
        where = f"may not have been written ({exc})"
    _announce(wl, result, where, echo, ended.abandoned_save if ended else None)
    if tracked is not None:
        tracked.end(result, result.best_checkpoint or result.last_checkpoint, run_dir.fs)
    whole = wl.intact if wl.checks_contents else None
    try:
        partial = (
            checkpoint_index.cut_short(run_dir.fs, run_dir.path, attempt.started, wl.own_dirs, whole) if error else []
        )
    except fsio.StorageError:
        partial = []  # a note only; the storage's trouble was said with the outcome
    if partial:
        names = ", ".join(posixpath.basename(p) for p in partial)
        echo(f"run: {names}: cut short, never registered as a checkpoint and never resumed from; delete to free space")
    return result


def _trainer(
    wl: Workload, placed: Placed, scale: ScaleConfig, run: RunConfig, reports: Reports, guard: runlock.Guard | None
) -> Any:
    """The TorchTrainer: the workload's function behind the service's wrapper, placed as planned."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain import ray_internals
    from raytrain.service.process_group import ProcessGroup
    from raytrain.service.wrapper import SETUP, WorkerSetup, run_worker

    plan = placed.plan
    setup = WorkerSetup(
        train_func=wl.train_func(),
        config=wl.loop_config(placed),
        events=reports.queue,
        preempt_flag=cluster.preempt_flag_path(),
        cpus_per_worker=plan.cpus_per_worker,
        run_name=run.name,
        job=slurm_env.job_label(),
        lock=guard,
    )
    return ray_internals.trainer_without_idle_datasets(TorchTrainer)(
        run_worker,
        train_loop_config={SETUP: setup},
        scaling_config=ray.train.ScalingConfig(
            num_workers=(plan.min_workers, plan.workers) if plan.min_workers is not None else plan.workers,
            use_gpu=plan.use_gpu,
            resources_per_worker=plan.resources_per_worker(),
            label_selector=plan.label_selectors(),
            # Elastic runs are placed by Ray, not pinned: CPU workers spread over the nodes as planned.
            placement_strategy="SPREAD" if plan.min_workers is not None and not plan.use_gpu else "PACK",
            # Elastic: how often Ray Train looks for nodes that came back, to grow the run onto them (Ray's
            # default is 60 s). A look is one call to Ray's resource coordinator; growing restarts the
            # workers from the newest checkpoint.
            elastic_resize_monitor_interval_s=env.ELASTIC_CHECK.value(),
        ),
        torch_config=ProcessGroup(backend=plan.backend, timeout_s=scale.pg_timeout_s),
        datasets=wl.datasets(placed),
        dataset_config=data_config(plan.workers, whole_for_one=wl.whole_for_one),
        run_config=ray.train.RunConfig(
            name=run.name,
            storage_path=placed.run.storage.root,
            storage_filesystem=placed.run.fs,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=run.keep),
            # A failed worker (killed, out of memory, a lost node, an error) restarts the worker group from
            # the newest checkpoint, up to max_failures times. A preemption ends the run with a checkpoint:
            # the job requeues, rather than Ray rescheduling onto nodes that are going away.
            # Workers that cannot be placed (what the run asks for was taken meanwhile, a node is gone) fail
            # the run after a few tries in a row (the service callback), and after CONTROLLER_FAILURES over
            # the run, where Ray alone retries until the job ends.
            failure_config=ray.train.FailureConfig(
                max_failures=run.max_failures,
                max_preemption_failures=0,
                controller_failure_limit=admission.CONTROLLER_FAILURES,
            ),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            # In a sweep's trial, each report goes on to Ray Tune once the driver has recorded it.
            callbacks=[reports.callback(then=ray_internals.tune_report_callback())],
        ),
    )


def data_config(workers: int, *, whole_for_one: bool) -> ray.train.DataConfig:
    """How Ray Train hands the datasets to ``workers`` workers (an elastic run's most): a shard of each
    dataset to each, by Ray Data's ``streaming_split`` (equal, disjoint; every epoch executed in a split
    coordinator, an actor of its own that every rank's blocks go through), Ray Train's default. With
    ``whole_for_one`` (``Workload.whole_for_one``, the built-in recipe) a run of one worker gets each dataset
    whole instead, every epoch executed in the worker's own process (``Dataset.iterator``): the same rows (an
    equal split into one leaves none out) with no coordinator to start first, a Ray worker process whose
    start held up the first batch (BENCHMARKS.md, "Streamed training end to end"), nor a call to it for each
    block."""
    import ray.train

    return ray.train.DataConfig(datasets_to_split=[] if workers == 1 and whole_for_one else "all")


def _result(
    wl: Workload,
    placed: Placed,
    run: RunConfig,
    settings: dict[str, Any],
    events: Events,
    error: BaseException | None,
    attempt: _Attempt,
) -> RunResult:
    history = [r.rank0 for r in events.reports]
    first = history[0] if history else {}
    lost = outcomes.lost_workers(error) if error else False
    ended = events.ended_early
    status: Status = (
        ("lost" if lost or any(f.too_few for f in events.failures) else "failed")
        if error
        else "cancelled"
        if events.cancelled
        else "preempted"
        if ended
        else "completed"
    )
    broken = events.ended_early.not_whole if events.ended_early else None  # a last save a rank's copy failed
    checkpoints = [r.checkpoint for r in events.reports if r.checkpoint and posixpath.basename(r.checkpoint) != broken]
    resumed = first.get(keys.RESUMED) or ({"checkpoint": attempt.resumes_from} if attempt.resumes_from else None)
    return RunResult(
        name=run.name,
        kind=wl.kind,
        status=status,
        # A full disk can stop Ray Train's controller (its checkpoint index) before any worker fails on it.
        error=(outcomes.no_space(error) if outcomes.out_of_space(error) else outcomes.summary(error))
        if error
        else None,
        preempted_via=jobdir.CANCEL if events.cancelled else events.ended_early.via if events.ended_early else None,
        world_size=len(events.current_workers()) or placed.plan.workers,
        backend=placed.plan.backend,
        placement=[w.placement for w in events.current_workers()] or placed.plan.placements(),
        final=history[-1] if history else {},
        history=history,
        reports_this_attempt=len(history),
        last_checkpoint=checkpoints[-1] if checkpoints else attempt.resumes_from,
        resumed_from=resumed,
        wall_time_s=time.time() - attempt.started,
        startup_s=_startup(first, [w.started_at for w in events.workers.values()], attempt.since),
        restarts=_restarts(events, attempt),
        resizes=_resizes(events, attempt),
        config=settings,
        versions=outcomes.versions(__version__),
        **outcomes.epoch_progress(history),
    )


def _announce(wl: Workload, result: RunResult, where: str, echo: Echo, abandoned: str | None) -> None:
    if result.status in ("preempted", "cancelled"):
        if abandoned:
            echo(abandoned)
        saved = posixpath.basename(result.last_checkpoint) if result.last_checkpoint else "none"
        if result.status == "cancelled":
            echo(f"cancelled: checkpoint {saved} saved; rerun the same command to resume; result: {where}")
        elif result.preempted_via == jobdir.YIELD:
            echo(f"preempted: checkpoint {saved} saved, to yield its room to a run of higher priority")
        else:
            echo(f"preempted: checkpoint {saved} saved; rerun the same command (or let the job requeue) to resume")
    elif result.status in ("failed", "lost"):
        done = result.epochs_completed
        so_far = f"{done} epochs" if done is not None else f"{result.reports_this_attempt} report(s)"
        echo(f"training failed after {so_far}: {result.error}")
        if result.status == "lost":
            echo("workers failed more often than --max-failures allows: resubmit (or let the job requeue) to resume")
        echo(f"result: {where}")
    else:
        echo(f"{wl.done_line(result)}; result: {where}")


def _checkpoint_before(events: Events, at: float) -> Report | None:
    """The newest report with a checkpoint received by ``at``: where a restart at ``at`` went back to."""
    return next((r for r in reversed(events.reports) if r.checkpoint and r.received_at <= at), None)


def _restarts(events: Events, attempt: _Attempt) -> list[Restart]:
    """Each failure of the attempt: what it cost, and where training went back to."""
    out = []
    groups = events.worker_groups()
    for failed in events.failures:
        back_to = _checkpoint_before(events, failed.at)
        restarted = next(([s.started_at for s in g] for g in groups if g[0].started_at > failed.at), [])
        out.append(
            Restart(
                at_s=failed.at - attempt.started,
                ranks=failed.ranks,
                error=failed.error,
                resumed_from=back_to.checkpoint if back_to else attempt.resumes_from,
                lost_s=failed.at - back_to.received_at if back_to else None,
                restart_s=max(restarted) - failed.at if restarted else None,
            )
        )
    return out


def _resizes(events: Events, attempt: _Attempt) -> list[Resize]:
    """Each time an elastic run grew: a new worker group that no failure preceded."""
    out = []
    groups = events.worker_groups()
    for before, group in itertools.pairwise(groups):
        began = group[0].started_at
        if any(before[0].started_at <= f.at <= began for f in events.failures):
            continue  # a restart after a failure: see _restarts
        back_to = _checkpoint_before(events, began)
        out.append(
            Resize(
                at_s=began - attempt.started,
                workers=len(group),
                were=len(before),
                resumed_from=back_to.checkpoint if back_to else attempt.resumes_from,
                cost_s=began - back_to.received_at if back_to else None,
            )
        )
    return out


def _startup(first: dict[str, Any], workers_at: list[float], since: float) -> dict[str, float] | None:
    """Seconds from the start (of the job, else the command) to the workers, first batch and first step."""
    marks = {"worker": max(workers_at) if workers_at else None, **(first.get(keys.STARTUP) or {})}
    marks = {k.removesuffix("_at"): v - since for k, v in marks.items() if v}
    return marks or None
