"""The callback raytrain loads into every Ray Train run on its clusters, stock scripts included.

Drivers on a raytrain cluster get ``RAY_TRAIN_CALLBACKS`` naming it, so any ``TorchTrainer`` loads it,
unchanged, with its own callbacks. It runs in the Ray Train controller and gives every run what
``raytrain fit`` has:

- a request the cluster cannot hold fails at once, with what to do, where Ray alone would retry
  ``WorkerGroupStartupTimeoutError`` forever;
- torch's rendezvous port comes from the job's port block (``RAYTRAIN_TORCH_PORTS``), so it cannot
  collide with another job's on a shared node (``raytrain.service.process_group``);
- one driver per run: a script's run directory is locked for the run (``raytrain.service.runlock``; a
  run of raytrain's service is locked by its driver), and every worker checks, just before it uploads a
  checkpoint, that the lock is still the run's driver's, so a driver that lost its run writes nothing;
- every checkpoint Ray registers gets a manifest (its files, sizes and CRC32s, each rank summing the files
  it uploaded), against which a later attempt checks it before resuming from it
  (``raytrain.service.checksums``, ``raytrain.service.checkpoint_index``); a whole checkpoint every rank
  finished, that Ray Train had not collected when a rank died, is registered before the workers restart,
  so they go on from it;
- an elastic run (``ScalingConfig(num_workers=(MIN, MAX))``) in a batch job tells the batch script's
  watcher so while it trains: a lost worker node's Ray then does not end the job, and is started again;
- a run that raytrain's service does not drive (a script's own trainer) gets a line per report in the
  job log, its curves (``raytrain.service.curves``), its reports as Ray metrics and ``result.json`` in
  its run directory, as ``raytrain`` runs do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import posixpath
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from raytrain import __version__, fsio, ray_internals, slurm_env, uri
from raytrain.contracts import env, jobdir, rundir
from raytrain.contracts.result import Placement, Restart, RunResult
from raytrain.errors import UserError
from raytrain.service import admission, checkpoint_index, checksums, outcomes, runlock, runs
from raytrain.service.cluster import mark_elastic
from raytrain.service.curves import Curves
from raytrain.service.events import EndedEarly, Report, post
from raytrain.service.process_group import address_and_port
from raytrain.service.telemetry import ReportGauges
from raytrain.service.wrapper import SETUP, driven_by_service

log = logging.getLogger(__name__)
CANCEL_POLL_S = 1.0  # how often the controller looks for raytrain cancel's request past its deadline


class ClusterTooSmall(UserError):
    """The run asks for more workers than the cluster can ever hold."""


class WorkersNotPlaced(RuntimeError):
    """The run's workers could not be placed, try after try."""


def _num(x: float) -> str:
    return f"{x:g}"


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{_num(v)} {k}" for k, v in sorted(resources.items()) if v)


def check_fits(scaling_config: Any, nodes: list[dict[str, Any]]) -> None:
    """Raise ClusterTooSmall if the cluster's live nodes cannot hold the run's (minimum) worker count."""
    need = {k: v for k, v in ray_internals.worker_resources(scaling_config).items() if v > 0}
    workers = int(scaling_config.min_workers)
    alive = [n for n in nodes if n.get("Alive")]
    held = admission.holds((n.get("Resources", {}) for n in alive), need)
    if workers <= held:
        return
    totals: dict[str, float] = {}
    for n in alive:
        for k in need:
            totals[k] = totals.get(k, 0.0) + float(n.get("Resources", {}).get(k, 0.0))
    raise ClusterTooSmall(
        f"ScalingConfig(num_workers={workers}) needs {_fmt(need)} per worker, but this Ray cluster "
        f"({len(alive)} node(s), {_fmt(totals)} in all) holds {held} such worker(s): ask for "
        f"{held} or fewer, or for a larger Slurm allocation (--nodes, --gpus-per-node, --cpus-per-task)"
    )


def _run_dir_of(run_config: Any) -> tuple[Any, str]:
    """The filesystem and path of a run's directory, as Ray Train makes it: ``storage_path/name``."""
    fs, root = (
        (run_config.storage_filesystem, run_config.storage_path)
        if run_config.storage_filesystem is not None
        else uri.resolve(run_config.storage_path)
    )
    return fs, posixpath.join(root, run_config.name)


def _settle_script_run(run_config: Any) -> None:
    """In the driver, before Ray Train's controller reads a script's run index: the run resumes from its
    newest checkpoint that verifies against its manifest (a file missing, cut short or overwritten makes
    it not whole, named as such), a damaged or stale index is repaired and whole checkpoints Ray Train did
    not collect are recovered, as ``raytrain fit`` settles its own runs (``checkpoint_index.settle``).
    On a POSIX filesystem this is done under the run's lock (released again before the controller takes
    it for the run), and a run another driver holds, or not the user's, is left to the controller, which
    refuses it; an object store has no lock, as for raytrain's own runs. Nothing verifying: a UserError,
    the run left as it is."""
    if run_config.name is None:
        return  # a name Ray Train makes up: a new run
    fs, run_dir = _run_dir_of(run_config)

    def settle() -> checkpoint_index.ResumePoint | None:
        if fs.get_file_info(run_dir).type != pafs.FileType.Directory:
            return None
        point = checkpoint_index.settle(fs, run_dir, intact=lambda _fs, _path: True)
        checkpoint_index.apply(fs, run_dir, point)
        return point

    def echo(line: str) -> None:
        print(f"raytrain: {line}", flush=True)

    doing = f"checking run {run_config.name!r} in {posixpath.dirname(run_dir)}"
    if isinstance(fs, pafs.LocalFileSystem):
        path = Path(run_dir)
        if not path.is_dir():
            return  # a new run
        try:
            runs.check_owned(path)
            runlock.check_free(path, run_config.name)
        except UserError:
            return
        with runlock.held(path, run_config.name, echo):
            point = fsio.bounded(settle, doing, writes=True)
    else:
        point = fsio.bounded(settle, doing, writes=True)
    for note in point.notes() if point is not None else []:
        echo(note)


class ServiceCallback(*ray_internals.train_callback_bases()):  # type: ignore[misc]
    """Loaded by Ray Train through ``RAY_TRAIN_CALLBACKS`` (created in the driver, run in the controller)."""

    def __init__(self) -> None:
        self._context: Any = None
        self._started = time.time()
        self._placement: list[dict[str, Any]] = []
        self._history: list[dict[str, Any]] = []
        self._last_checkpoint: str | None = None
        self._checkpointed_at: float | None = None  # when the last checkpoint's report came
        self._restarts: list[Restart] = []  # a script's worker failures Ray Train restarted from
        self._failed_at: float | None = None  # the failure whose restart is under way
        self._job_dir = env.JOB_DIR.get()  # read here, in the driver: the controller's env is Ray's
        self._job = slurm_env.job_label()
        self._curves: Curves | None = None
        self._gauges: ReportGauges | None = None
        self._lock: runlock.Lock | None = None  # a script's run, held by the controller
        self._guard: runlock.Guard | None = None  # checked on every worker before it writes a checkpoint
        self._writes_result = False  # a script's run is this driver's to write result.json into
        self._place: admission.Place | None = None  # its ticket in the job's queue, for as long as it runs
        self._priority = admission.priority()  # read here, in the driver
        self._watching: threading.Event | None = None  # set to stop the watch for raytrain cancel
        self._reschedules = 0  # worker-group starts in a row that timed out
        trainer = ray_internals.trainer_being_fit()  # in the driver, just before the run's controller starts
        if trainer is not None and not driven_by_service(trainer.train_loop_config):
            try:
                _settle_script_run(trainer.run_config)
            except UserError:
                raise  # nothing verifies: the run stops, saying what to do
            except Exception:  # the run then starts from what Ray Train's index says, as without raytrain
                log.warning("raytrain: could not check the run's checkpoints before it starts", exc_info=True)
        self._wait_for_room(trainer)

    def __getstate__(self) -> dict[str, Any]:
        """Ray pickles this callback twice: from the driver to the controller, then from the controller to
        every worker of a worker group (for ``on_checkpoint_transfer``). What the controller holds while
        it runs (the lock's heartbeat, the curves and gauges) stays there."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_curves", "_gauges", "_watching")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._curves, self._gauges, self._watching = None, None, None, None

    # The workers ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def on_checkpoint_transfer(self) -> Iterator[None]:
        """Around each worker's checkpoint upload: none once the run's lock is another driver's; once it is
        done, the rank's part of the checkpoint's record (its files, sizes and CRC32s)."""
        check = self._guard.check if self._guard is not None else None
        if check is not None:
            check()
        upload = ray_internals.upload_under_way()
        # Again before its part is written, by Ray Train's copy here or by an upload function of raytrain's
        # own (sharded saves): an upload can take long, and a whole set of parts makes it recoverable.
        with checksums.guarded(check):
            yield
            if upload is not None:
                checksums.record_upload(upload)

    # The controller ------------------------------------------------------------------------------------
    def after_controller_start(self, train_run_context: Any) -> None:
        import ray

        self._context = train_run_context
        ray_internals.pin_torch_rendezvous(address_and_port)  # a script's own TorchConfig
        scaling = train_run_context.scaling_config
        if self._script():
            self._lock_script_run()  # first: a run held by another driver gets nothing written, not even a result
        else:
            self._guard = train_run_context.train_loop_config[SETUP].lock
        check_fits(scaling, ray.nodes())
        if self._job_dir and self._place is None:  # not queued in the driver (Ray moved where it makes us)
            self._place = self._queued(scaling, train_run_context.run_config.name, train_run_context.train_loop_config)
        mark_elastic(self._job_dir, scaling.min_workers < scaling.max_workers)
        if self._place is not None:
            self._watching = threading.Event()
            threading.Thread(target=self._watch_cancel, args=(self._watching,), daemon=True).start()

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        """A run whose workers cannot be placed ``PLACEMENT_TRIES`` times in a row fails, with what to do,
        where Ray Train alone retries until the job ends. A script's restart after a worker failure goes
        into its result.json as the service's runs have it."""
        if type(current_state).__name__ == "RestartingState" and self._script():
            self._failed(getattr(current_state, "training_failed_error", None))
        if type(current_state).__name__ != "ReschedulingState":
            return
        self._reschedules += 1
        tries = admission.PLACEMENT_TRIES
        if self._reschedules >= tries:
            raise WorkersNotPlaced(
                f"the workers of run {self._context.run_config.name!r} could not be placed in {tries} "
                "tries (Ray Train's worker group start timed out each time): what the run asks for was not free, "
                "or a node is gone; see raytrain status, and resubmit"
            )

    def before_controller_execute_resize_decision(self, resize_decision: Any) -> None:
        """A (re)start of the worker group: nobody is admitted until it has placed again. Said here, before
        Ray Train shuts the old group down and frees its resources, so that no waiting run sees them free
        while this run still reads as running."""
        if self._place is not None:
            self._place.set_phase("placing")

    def before_worker_group_start(self, worker_group_context: Any) -> None:
        if self._place is not None:
            self._place.set_phase("placing")  # already so, unless Ray Train started a group another way

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        """Just before Ray Train hands the workers the checkpoint to start from: whole checkpoints of the
        reports after the last one Ray collected (every rank uploaded them, and a rank died before the
        controller polled their reports; asynchronous saves can leave several) are registered first, in
        report order, so the run goes on from the latest and not from the one before."""
        manager = ray_internals.checkpoint_manager_handing_out()
        if manager is None or self._context is None:
            return {}
        try:
            fs, run_dir = self._run_dir()
            index = ray_internals.reports_collected(manager) + 1
            latest = ray_internals.latest_registered(manager)

            def look() -> list[checkpoint_index.Uncollected]:
                since = checkpoint_index.registered_at(fs, latest) if latest else float("-inf")
                return checkpoint_index.uncollected(fs, run_dir, index, since)

            lost = fsio.bounded(look, "looking for checkpoints Ray did not collect")
        except Exception:  # the run then goes on from the checkpoint Ray Train has
            log.warning("raytrain: could not look for a checkpoint Ray Train did not collect", exc_info=True)
            return {}
        for found in lost:
            name = posixpath.basename(found.path)
            if found.damage is not None:
                print(
                    f"raytrain: checkpoint {name} was not collected by Ray Train and is not whole ({found.damage}): "
                    "the run goes on from the one before",
                    flush=True,
                )
                break
            try:
                if self._guard is not None:
                    self._guard.check()  # a driver that lost its run registers nothing in it
                ray_internals.register_checkpoint(manager, fs, found.path, found.metrics)
            except Exception:
                log.warning("raytrain: could not register checkpoint %s", name, exc_info=True)
                break
            self._write_manifest(fs, found.path, found.metrics, recovered=True)
            self._recovered(found)
            print(
                f"raytrain: checkpoint {name} was saved by every rank but not collected by Ray Train before a "
                "worker failed: recovered",
                flush=True,
            )
        return {}

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._reschedules = 0
        if self._failed_at is not None and self._restarts:
            self._restarts[-1] = dataclasses.replace(self._restarts[-1], restart_s=time.time() - self._failed_at)
            self._failed_at = None
        if self._place is not None:
            self._place.set_phase("running")  # its workers hold their resources now: the next run may go
        if self._script():
            self._placement = ray_internals.worker_placement(worker_group)
            if self._curves is None:
                fs, run_dir = self._run_dir()
                name = self._context.run_config.name
                self._curves = Curves(fs, run_dir, self._started, title=f"{name} (script)")
                self._gauges = ReportGauges(name, self._job)

    def after_report(self, training_report: Any, metrics: list[dict[str, Any]]) -> None:
        rank0 = metrics[0] if metrics else {}
        checkpoint = getattr(training_report, "checkpoint", None)
        if checkpoint is not None:
            self._write_manifest(checkpoint.filesystem, checkpoint.path, rank0)
        if not self._script() or (self._lock is not None and not self._lock.still_held()):
            return  # not a script's run, or one another driver has taken over: nothing more written into it
        self._history.append(dict(rank0))
        if checkpoint is not None:
            self._last_checkpoint, self._checkpointed_at = checkpoint.path, time.time()
        print(f"raytrain: {outcomes.report_line(rank0, len(self._history))}", flush=True)
        if self._gauges is not None:
            self._gauges.set(rank0)
        if self._curves is not None and (note := self._curves.add(rank0, time.time())) is not None:
            print(f"raytrain: {note}", flush=True)

    def _recovered(self, found: checkpoint_index.Uncollected) -> None:
        """A recovered checkpoint's report counts as the run's, as if Ray Train had collected it: in a
        script's history, or posted to raytrain's driver."""
        if self._script():
            self._history.append(dict(found.metrics))
            self._last_checkpoint, self._checkpointed_at = found.path, found.at
            if self._failed_at is not None and self._restarts:  # the restart goes back to it, not further
                lost = self._failed_at - found.at
                self._restarts[-1] = dataclasses.replace(self._restarts[-1], resumed_from=found.path, lost_s=lost)
            print(f"raytrain: {outcomes.report_line(found.metrics, len(self._history))}", flush=True)
            if self._curves is not None:
                self._curves.add(found.metrics, found.at)
        else:
            setup = self._context.train_loop_config[SETUP]
            ranks = [found.metrics] * max(1, found.world_size)  # rank 0's stand for all: a report is rank 0's
            post(setup.events, Report(metrics=ranks, checkpoint=found.path, received_at=found.at))

    def after_controller_finish(self, result: Any) -> None:
        self._stop_watching()
        if self._place is not None and not self._script() and self._place.request() is not None:
            # Asked to end (to yield its room, or cancelled): raytrain's driver takes the run up again from
            # its ticket, waiting in its place, or ends it and drops the ticket.
            self._place.requeue()
            self._place = None
        self._leave_queue()
        mark_elastic(self._job_dir, False)
        try:
            if self._curves is not None:
                held = self._lock is None or self._lock.still_held()
                if (note := self._curves.close(draw=held)) is not None:
                    print(f"raytrain: {note}", flush=True)
            if not self._script() or not self._writes_result:
                return
            if self._lock is not None:
                self._lock.check()
            self._write_result(getattr(result, "error", None))
        except runlock.LockLost as exc:
            print(f"raytrain: {exc}", flush=True)
        except Exception:  # a report of the run must never fail the run
            log.warning("raytrain: could not write result.json", exc_info=True)
        finally:
            self._release()

    def before_controller_abort(self) -> None:
        self._stop_watching()
        self._leave_queue()
        self._release()

    # Not Ray Train hooks ----------------------------------------------------------------------------------
    def _script(self) -> bool:
        """Whether this run is a script's own trainer (raytrain's service records its runs itself)."""
        return self._context is not None and not driven_by_service(self._context.train_loop_config)

    def _lock_script_run(self) -> None:
        """Hold a script's run directory for the run, as raytrain's driver holds its own (a shared POSIX
        filesystem; an object store has no lock): a second driver of the same run fails at once."""
        fs, run_dir = self._run_dir()
        if not isinstance(fs, pafs.LocalFileSystem):
            self._writes_result = True
            return
        path = Path(run_dir)
        runs.check_owned(path)  # not another user's, nor one others can write
        if not path.exists():
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o700)
        self._lock = runlock.acquire(path, self._context.run_config.name, lambda line: print(f"raytrain: {line}"))
        self._lock.start()
        self._guard = self._lock.guard()
        self._writes_result = True

    def _wait_for_room(self, trainer: Any) -> None:
        """On a job's cluster, in the driver (Ray Train makes this callback there just before it starts the
        run's controller): wait for the run's turn, interruptible by Ctrl-C, with a line saying for what."""
        if trainer is not None and self._job_dir:
            self._place = self._queued(trainer.scaling_config, trainer.run_config.name, trainer.train_loop_config)

    def _queued(self, scaling: Any, run: str, loop_config: dict[str, Any] | None) -> admission.Place:
        """The run's ticket in the job's queue, once it may place its workers (``raytrain.service.admission``)."""
        import ray

        assert self._job_dir is not None
        check_fits(scaling, ray.nodes())  # a run no state of the cluster could hold does not wait for one
        context = ray.get_runtime_context()
        place = admission.Place.take(
            Path(self._job_dir),
            run=run,
            cluster=context.gcs_address,
            ray_job=context.get_job_id(),
            workers=int(scaling.min_workers),
            per_worker=ray_internals.worker_resources(scaling),
            actor=context.get_actor_id(),  # a sweep's trial: its actor, which Tune may stop
            priority=self._priority,
            yields=driven_by_service(loop_config),  # raytrain's driver resumes a run that yielded its room
        )
        prefix = "run: " if driven_by_service(loop_config) else "raytrain: "
        cluster = admission.Cluster(
            address=context.gcs_address,
            free=ray_internals.free_per_node,
            totals=ray.cluster_resources,
            live=ray_internals.live_ray_jobs,
            dead=ray_internals.actor_dead,
        )
        try:
            place.wait(lambda line: print(f"{prefix}{line}", flush=True), cluster)
        except BaseException:  # Ctrl-C while it waits: its place goes with it
            place.leave()
            raise
        return place

    def _failed(self, error: BaseException | None) -> None:
        """Workers of a script's run failed and Ray Train restarts them from the newest checkpoint."""
        failures = getattr(error, "worker_failures", None) or {}
        errors = {int(r): ray_internals.user_exception(e) for r, e in failures.items()}
        cause = outcomes.cause(errors)[1] if errors else error
        self._failed_at = time.time()
        self._restarts.append(
            Restart(
                at_s=self._failed_at - self._started,
                ranks=sorted(errors),
                error=outcomes.brief(cause) if cause is not None else "unknown",
                resumed_from=self._last_checkpoint,
                lost_s=self._failed_at - self._checkpointed_at if self._checkpointed_at is not None else None,
                restart_s=None,
            )
        )

    def _watch_cancel(self, stop: threading.Event) -> None:
        """In the controller, for the run's life: a run that ``raytrain cancel`` asked to end and whose
        training has not (it never calls ``raytrain.ending_soon()``, or a step outlasts the grace) is stopped
        once the request's deadline passes: its controller aborts, as Ray Train's Ctrl-C handler does."""
        import ray

        while not stop.wait(CANCEL_POLL_S):
            place = self._place
            asked = place.request() if place is not None else None
            if asked is None or asked.why != jobdir.CANCEL or time.time() < asked.deadline:
                continue
            if stop.is_set():
                return  # the run ended meanwhile, by itself
            name = self._context.run_config.name
            print(
                f"raytrain: {name}: cancelled by {asked.by}; its training did not end in time: stopping it", flush=True
            )
            if not self._script():  # raytrain's driver records the run as cancelled
                post(self._context.train_loop_config[SETUP].events, EndedEarly(via=jobdir.CANCEL))
            ray.get_runtime_context().current_actor.abort.remote()
            return

    def _stop_watching(self) -> None:
        if self._watching is not None:
            self._watching.set()
            self._watching = None

    def _leave_queue(self) -> None:
        if self._place is not None:
            self._place.leave()
            self._place = None

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _write_manifest(self, fs: Any, directory: str, metrics: dict[str, Any], recovered: bool = False) -> None:
        """What the registered (fully uploaded) checkpoint holds, written into it."""
        try:
            checkpoint_index.write_manifest(fs, directory, metrics, time.time(), recovered)
        except Exception:  # without it the checkpoint is checked less closely; training goes on
            log.warning("raytrain: could not write the manifest of %s", directory, exc_info=True)

    def _run_dir(self) -> tuple[Any, str]:
        return _run_dir_of(self._context.run_config)

    def _write_result(self, error: BaseException | None) -> None:
        ctx = self._context
        run_config, scaling = ctx.run_config, ctx.scaling_config
        fs, run_dir = self._run_dir()
        backend = getattr(ctx.backend_config, "backend", None) or ("nccl" if scaling.use_gpu else "gloo")
        placement = [
            Placement(
                rank=p["rank"],
                hostname=p["hostname"],
                ip=p["ip"],
                device=f"cuda:{p['gpu_ids'][0]}" if p["gpu_ids"] else "cpu",
            )
            for p in self._placement
        ]
        result = RunResult(
            name=run_config.name,
            kind="script",
            status="failed" if error else "completed",
            error=outcomes.summary(error) if error else None,
            world_size=int(scaling.max_workers),
            backend=str(backend),
            placement=placement,
            final=self._history[-1] if self._history else {},
            history=self._history,
            reports_this_attempt=len(self._history),
            last_checkpoint=self._last_checkpoint,
            restarts=self._restarts,
            wall_time_s=time.time() - self._started,
            versions=outcomes.versions(__version__),
            **outcomes.epoch_progress(self._history),
        )
        fs.create_dir(run_dir, recursive=True)
        runs.write_json(fs, posixpath.join(run_dir, rundir.RESULT), result.to_json())
