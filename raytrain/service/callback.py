"""The callback raytrain loads into every Ray Train run on its clusters, stock scripts included.

Drivers on a raytrain cluster get ``RAY_TRAIN_CALLBACKS`` naming it, so any ``TorchTrainer`` loads it,
unchanged, with its own callbacks. It runs in the Ray Train controller and gives every run what
``raytrain fit`` has:

- a request the cluster cannot hold fails at once, with what to do, where Ray alone would retry
  ``WorkerGroupStartupTimeoutError`` forever;
- torch's rendezvous port comes from the job's port block (``RAYTRAIN_TORCH_PORTS``), so it cannot
  collide with another job's on a shared node;
- every checkpoint Ray registers gets a manifest (its files and sizes), against which a later attempt
  checks it before resuming from it (``raytrain.service.checkpoints``);
- an elastic run (``ScalingConfig(num_workers=(MIN, MAX))``) in a batch job tells the batch script's
  watcher so while it trains: a lost worker node's Ray then does not end the job, and is started again;
- a run that raytrain's service does not drive (a script's own trainer) gets a line per report in the
  job log, its curves (``raytrain.service.curves``), its reports as Ray metrics and ``result.json`` in
  its run directory, as ``raytrain`` runs do.
"""

from __future__ import annotations

import logging
import posixpath
import socket
import time
from typing import Any

from raytrain import __version__, ray_internals, slurm_env, uri
from raytrain.contracts import env, rundir
from raytrain.contracts.result import Placement, RunResult
from raytrain.service import checkpoints, results, runs
from raytrain.service.cluster import mark_elastic
from raytrain.service.curves import Curves
from raytrain.service.telemetry import ReportGauges

log = logging.getLogger(__name__)


class ClusterTooSmall(RuntimeError):
    """The run asks for more workers than the cluster can ever hold."""


def address_and_port() -> tuple[str, int]:
    """Run on rank 0: this node's IP and a free port from the job's torch range (else Ray's own choice)."""
    import ray

    spec = env.TORCH_PORTS.get()
    if not spec:
        return ray_internals.ray_address_and_port()
    first, last = (int(p) for p in spec.split("-"))
    for port in range(first, last + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return ray.util.get_node_ip_address(), port
    raise RuntimeError(f"no free port for torch's rendezvous in {env.TORCH_PORTS.name}={spec}: every one is in use")


def _num(x: float) -> str:
    return f"{x:g}"


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{_num(v)} {k}" for k, v in sorted(resources.items()) if v)


def check_fits(scaling_config: Any, nodes: list[dict[str, Any]]) -> None:
    """Raise ClusterTooSmall if the cluster's live nodes cannot hold the run's (minimum) worker count."""
    need = {k: v for k, v in ray_internals.worker_resources(scaling_config).items() if v > 0}
    workers = int(scaling_config.min_workers)
    alive = [n for n in nodes if n.get("Alive")]
    per_node = [min((int(n.get("Resources", {}).get(k, 0.0) // v) for k, v in need.items()), default=0) for n in alive]
    if workers <= sum(per_node):
        return
    totals: dict[str, float] = {}
    for n in alive:
        for k in need:
            totals[k] = totals.get(k, 0.0) + float(n.get("Resources", {}).get(k, 0.0))
    raise ClusterTooSmall(
        f"ScalingConfig(num_workers={workers}) needs {_fmt(need)} per worker, but this Ray cluster "
        f"({len(alive)} node(s), {_fmt(totals)} in all) holds {sum(per_node)} such worker(s): ask for "
        f"{sum(per_node)} or fewer, or for a larger Slurm allocation (--nodes, --gpus-per-node, --cpus-per-task)"
    )


class ServiceCallback(*ray_internals.train_callback_bases()):  # type: ignore[misc]
    """Loaded by Ray Train through ``RAY_TRAIN_CALLBACKS`` (created in the driver, run in the controller)."""

    def __init__(self) -> None:
        self._context: Any = None
        self._started = time.time()
        self._placement: list[dict[str, Any]] = []
        self._history: list[dict[str, Any]] = []
        self._last_checkpoint: str | None = None
        self._job_dir = env.JOB_DIR.get()  # read here, in the driver: the controller's env is Ray's
        self._job = slurm_env.job_label()
        self._curves: Curves | None = None
        self._gauges: ReportGauges | None = None

    # The controller ------------------------------------------------------------------------------------
    def after_controller_start(self, train_run_context: Any) -> None:
        import ray

        self._context = train_run_context
        ray_internals.pin_torch_rendezvous(address_and_port)
        scaling = train_run_context.scaling_config
        check_fits(scaling, ray.nodes())
        mark_elastic(self._job_dir, scaling.min_workers < scaling.max_workers)

    def after_worker_group_start(self, worker_group: Any) -> None:
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
            self._write_manifest(checkpoint, rank0)
        if not self._script():
            return
        self._history.append(dict(rank0))
        if checkpoint is not None:
            self._last_checkpoint = checkpoint.path
        print(f"raytrain: {results.report_line(rank0, len(self._history))}", flush=True)
        if self._gauges is not None:
            self._gauges.set(rank0)
        if self._curves is not None and (note := self._curves.add(rank0, time.time())) is not None:
            print(f"raytrain: {note}", flush=True)

    def after_controller_finish(self, result: Any) -> None:
        mark_elastic(self._job_dir, False)
        if self._curves is not None:
            self._curves.close()
        if not self._script():
            return
        try:
            self._write_result(getattr(result, "error", None))
        except Exception:  # a report of the run must never fail the run
            log.warning("raytrain: could not write result.json", exc_info=True)

    # Not Ray Train hooks ----------------------------------------------------------------------------------
    def _script(self) -> bool:
        """Whether this run is a script's own trainer (raytrain's service records its runs itself)."""
        from raytrain.service.wrapper import driven_by_service

        return self._context is not None and not driven_by_service(self._context.train_loop_config)

    def _write_manifest(self, checkpoint: Any, metrics: dict[str, Any]) -> None:
        """What the registered (fully uploaded) checkpoint holds, written into it."""
        try:
            manifest = checkpoints.manifest_of(checkpoint.filesystem, checkpoint.path, metrics, time.time())
            with checkpoint.filesystem.open_output_stream(posixpath.join(checkpoint.path, rundir.MANIFEST)) as out:
                out.write(manifest.to_bytes())
        except Exception:  # without it the checkpoint is checked less closely; training goes on
            log.warning("raytrain: could not write the manifest of %s", checkpoint.path, exc_info=True)

    def _run_dir(self) -> tuple[Any, str]:
        run_config = self._context.run_config
        fs, root = (
            (run_config.storage_filesystem, run_config.storage_path)
            if run_config.storage_filesystem is not None
            else uri.resolve(run_config.storage_path)
        )
        return fs, posixpath.join(root, run_config.name)

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
            error=results.summary(error) if error else None,
            world_size=int(scaling.max_workers),
            backend=str(backend),
            placement=placement,
            final=self._history[-1] if self._history else {},
            history=self._history,
            reports_this_attempt=len(self._history),
            last_checkpoint=self._last_checkpoint,
            wall_time_s=time.time() - self._started,
            versions=results.versions(__version__),
            **results.epoch_progress(self._history),
        )
        fs.create_dir(run_dir, recursive=True)
        runs.write_json(fs, posixpath.join(run_dir, rundir.RESULT), result.to_json())
