"""Every use of Ray's private modules, in one place to revisit on each Ray upgrade (pinned: 2.60).

raytrain otherwise uses Ray's public API. Each function below says what it needs from Ray's internals
and why the public API does not do it; each has a fallback or fails loudly if the internals moved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def reset_auth_cache() -> None:
    """Make a process that already imported Ray re-read ``RAY_AUTH_*`` (a second local cluster, with a new
    token, in one process). Ray caches its config when first imported and the token when first read;
    ``Config.initialize`` and ``reset_cache`` are what Ray itself calls for this."""
    import sys

    if "ray._raylet" not in sys.modules:
        return  # nothing cached yet
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def filter_driver_log_lines(drop: Callable[[list[str]], bool]) -> None:
    """Drop batches of worker log lines that ``drop`` rejects before Ray prints them on the driver.

    Ray has no filter hook for the lines it forwards from workers (``log_to_driver``); this wraps the
    function it prints them with. Idempotent.
    """
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_raytrain_filtered", False):
        return

    def print_to_stdstream(data: dict[str, object], ignore_prefix: bool) -> None:
        lines = data.get("lines")
        if isinstance(lines, list) and lines and drop([str(ln) for ln in lines]):
            return
        original(data, ignore_prefix)

    print_to_stdstream._raytrain_filtered = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


def dashboard_unavailable() -> str | None:
    """Why Ray's dashboard cannot start in this environment (its packages, ``ray[default]``, missing or
    broken), or None. Ray checks the same before starting it, but only raises a bare exception after
    logging; ``get_dashboard_dependency_error`` is what it calls."""
    try:
        from ray._private.utils import get_dashboard_dependency_error
    except ImportError:
        return None  # moved: Ray's own check still runs when it starts the dashboard
    error = get_dashboard_dependency_error()
    return str(error) if error else None


class GcsGone(ConnectionError):
    """The GCS does not accept connections (not up yet, or its head is gone), or did not answer a read."""


READ_TIMEOUT_S = 10.0  # one GCS read; Ray's own client would retry a GCS that died under it for a minute


class GcsReader:
    """Reads the GCS tables (nodes, drivers, resources) without registering a driver.

    A driver (``ray.init``) costs about a second of CPU and shows up as a job of the cluster; a bare GCS
    client is what ``ray.cluster_utils`` uses for the same reads. Falls back to ``ray.init`` (node table
    only) if those internals are not there. Reads are bounded: one to a GCS that does not accept
    connections, or does not answer within READ_TIMEOUT_S (it died under the read), raises GcsGone. Ray's
    client would retry for a minute and then end the whole process, hiding why; a read it leaves behind
    blocks a daemon thread (Ray releases the GIL meanwhile), and Ray is told not to end the process for it.
    """

    def __init__(self, address: str) -> None:
        import os

        from raytrain.contracts import env

        os.environ.setdefault(env.GCS_RECONNECT.name, env.GCS_RECONNECT.require({}))  # before Ray reads its config
        import ray

        self._address = address
        self._check()
        self._ray = ray
        self._driver = False
        self._state: Any = None
        try:
            from ray._private.state import GlobalState
            from ray._raylet import GcsClientOptions  # type: ignore[attr-defined]

            state = GlobalState()
            state._initialize_global_state(
                GcsClientOptions.create(address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False)
            )
            self._state = state
        except (ImportError, AttributeError, TypeError):
            log.warning("Ray's GCS client internals moved; reading the cluster through a driver instead")
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            self._driver = True

    def _check(self) -> None:
        import socket

        host, port = self._address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
        except OSError as exc:
            raise GcsGone(f"Ray's GCS at {self._address} does not answer ({exc.strerror or exc})") from None

    def _read(self, read: Callable[[], Any]) -> Any:
        """READ's result, or GcsGone when the GCS does not take connections or does not answer in time."""
        import threading

        self._check()
        box: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                box.append((True, read()))
            except BaseException as exc:  # handed to the caller's thread
                box.append((False, exc))

        thread = threading.Thread(target=run, name="raytrain-gcs-read", daemon=True)
        thread.start()
        thread.join(READ_TIMEOUT_S)
        if not box:
            raise GcsGone(f"Ray's GCS at {self._address} did not answer within {READ_TIMEOUT_S:.0f} s")
        ok, value = box[0]
        if ok:
            return value
        if isinstance(value, self._ray.exceptions.RayError | ConnectionError):  # refused, failed to connect, auth
            from raytrain.uri import first_line  # (uri loads pyarrow: only on this path)

            raise GcsGone(f"Ray's GCS at {self._address} failed the read ({first_line(value)})") from None
        raise value

    def nodes(self) -> list[dict[str, Any]]:
        """The node table, as ``ray.nodes()`` returns it."""
        table = self._read(self._ray.nodes if self._driver else self._state.node_table)
        return list(table)

    def alive(self) -> list[dict[str, Any]]:
        return [n for n in self.nodes() if n.get("Alive")]

    def available_per_node(self) -> dict[str, dict[str, float]]:
        """Node id (hex) -> resources not in use now."""
        if self._driver:
            return {}
        return dict(self._read(self._state.available_resources_per_node))

    def drivers(self) -> list[dict[str, Any]]:
        """Live drivers connected to the cluster: JobID, DriverIPAddress, DriverPid, StartTime, Entrypoint."""
        if self._driver:
            return []
        return [j for j in self._read(self._state.job_table) if not j.get("IsDead")]

    def close(self) -> None:
        if self._driver:
            self._ray.shutdown()
        elif self._state is not None:
            self._state.disconnect()


def free_per_node() -> dict[str, dict[str, float]]:
    """Node id (hex) -> resources not in use now, for a process connected to the cluster (a driver, Ray
    Train's controller). ``ray.available_resources()`` (public) sums the nodes, and a worker needs its
    resources on one node; the per-node view is Ray's DeveloperAPI in ``ray._private.state``."""
    import ray._private.state

    return {k: dict(v) for k, v in ray._private.state.available_resources_per_node().items()}


def actor_dead(actor_id: str) -> bool:
    """Whether the Ray actor ACTOR_ID (hex) has died (or is unknown to the GCS), for a process connected
    to the cluster: a sweep's trial that Ray Tune stopped, whose run's ticket is then left in the job's
    queue. Ray's ``GlobalState`` actor table, private."""
    import ray._private.state

    return bool(ray._private.state.actors(actor_id=actor_id).get("State", "DEAD") == "DEAD")


def draining_nodes() -> dict[str, int]:
    """Node id (hex) -> the deadline (ms; 0: none) of each node being drained (the batch script drains one
    when the job ends soon), for a process connected to the cluster. Ray's ``GlobalState``, private."""
    import ray._private.state

    return {str(k): int(v) for k, v in ray._private.state.state.get_draining_nodes().items()}


def _caller(function: str, owner: type, depth: int) -> Any | None:
    """The frame of the nearest call of ``owner.function`` up this thread's stack (within ``depth`` frames),
    or None."""
    import inspect

    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if frame.f_code.co_name == function and isinstance(candidate, owner):
                return frame
        return None
    finally:
        del frame


def trainer_being_fit() -> Any | None:
    """The Ray Train trainer whose ``fit()`` is creating this process's environment callbacks
    (``RAY_TRAIN_CALLBACKS``), found up the call stack: Ray Train 2.60 makes them in
    ``DataParallelTrainer._create_default_callbacks``, in the driver, just before it starts the run's
    controller, and that is the one moment a callback can act in the driver with the run's scaling known.
    None when called otherwise, or when Ray moved that."""
    try:
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    except ImportError:
        return None
    frame = _caller("_create_default_callbacks", DataParallelTrainer, 8)
    return None if frame is None else frame.f_locals["self"]


@dataclass(frozen=True)
class Upload:
    """A worker's checkpoint upload under way: the rank's own checkpoint directory, and where in the run's
    storage Ray Train copies it."""

    rank: int
    world_size: int
    report_index: int  # the how-many-th report of the run this is (Ray Train's count, from 1)
    group: str  # the worker group's own id (its synchronization actor's): one per start of the workers
    metrics: dict[str, Any]  # the rank's metrics of the report
    source_fs: Any  # pyarrow.fs.FileSystem of the rank's checkpoint (mostly local)
    source: str
    fs: Any  # pyarrow.fs.FileSystem of the run's storage
    destination: str


def reports_made() -> int | None:
    """How many ``ray.train.report`` calls this worker has made that Ray Train went through with (its
    ``TrainContext.report_call_index``: a report skipped because a worker failed is not counted); None
    if Ray moved it."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return int(get_train_context().report_call_index)
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return None


def upload_under_way(own_copy: bool = False) -> Upload | None:
    """Called in a ``TrainContextCallback.on_checkpoint_transfer``: the upload it surrounds. Ray Train 2.60
    enters those callbacks in ``TrainContext._upload_checkpoint(checkpoint_dir_name, metrics, checkpoint,
    delete_local_checkpoint_after_upload, checkpoint_upload_fn, ...)`` and hands them nothing, so the call
    is found up the stack. None when called otherwise, when the upload is the user's own function (it may
    write anywhere), or when Ray moved that (the controller then records the checkpoint alone).
    ``own_copy``: called from raytrain's own upload function (``raytrain.service.sharded``), which copies
    as Ray Train does and records the part itself."""
    try:
        from ray.train.v2._internal.execution.context import TrainContext
    except ImportError:
        return None
    frame = _caller("_upload_checkpoint", TrainContext, 12)
    if frame is None:
        return None
    try:
        local = frame.f_locals
        if (local.get("checkpoint_upload_fn") is not None) is not own_copy or local.get("checkpoint") is None:
            return None
        context, checkpoint = local["self"], local["checkpoint"]
        storage = context.storage_context
        # The report's own index, from its caller (report, or the ASYNC upload thread's function): the
        # training thread's count has moved on by the time a queued ASYNC upload runs.
        index, caller = context.report_call_index, frame.f_back
        for _ in range(3):  # past Ray's retry decorator
            if caller is None or "report_call_index" in caller.f_locals:
                index = caller.f_locals["report_call_index"] if caller is not None else index
                break
            caller = caller.f_back
        return Upload(
            rank=int(context.get_world_rank()),
            world_size=int(context.get_world_size()),
            report_index=int(index),
            group=context.get_synchronization_actor()._actor_id.hex(),
            metrics=dict(local.get("metrics") or {}),
            source_fs=checkpoint.filesystem,
            source=str(checkpoint.path),
            fs=storage.storage_filesystem,
            destination=storage.build_checkpoint_path_from_name(local["checkpoint_dir_name"]),
        )
    except (AttributeError, KeyError, TypeError):
        log.warning("raytrain: Ray Train's checkpoint upload moved; checkpoints are recorded by the controller")
        return None
    finally:
        del frame


def checkpoint_manager_handing_out() -> Any | None:
    """Called in a ``WorkerGroupCallback.before_init_train_context``: Ray Train's CheckpointManager of the
    run, which hands the workers their checkpoint right after (2.60 calls the callbacks in order from
    ``WorkerGroup._init_train_context``, the CheckpointManager last). None when called otherwise or when
    Ray moved that."""
    try:
        from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
        from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
    except ImportError:
        return None
    frame = _caller("_init_train_context", WorkerGroup, 6)
    if frame is None:
        return None
    try:
        callbacks = getattr(frame.f_locals["self"], "_execution_group_callbacks", [])
        return next((c for c in callbacks if isinstance(c, CheckpointManager)), None)
    finally:
        del frame


def reports_collected(manager: Any) -> int:
    """How many reports of the run Ray Train's controller has collected from every rank (the next one a
    worker makes is this + 1)."""
    return int(manager._current_report_index)


def latest_registered(manager: Any) -> str | None:
    """The path of the newest checkpoint Ray Train's CheckpointManager has registered (the one the workers
    start from), or None."""
    latest = manager.latest_checkpoint_result
    return None if latest is None else str(latest.checkpoint.path)


def register_checkpoint(manager: Any, fs: Any, path: str, metrics: dict[str, Any]) -> None:
    """Register a whole checkpoint Ray Train never collected, as its controller registers a collected one
    (its index written, ``--keep``'s rotation done); the workers then start from it."""
    import ray.train
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    checkpoint = ray.train.Checkpoint(path=path, filesystem=fs)
    manager.register_checkpoint(_TrainingReport(checkpoint=checkpoint, metrics=metrics, validation=False))


def live_ray_jobs() -> set[str]:
    """The ids (hex) of the Ray jobs, one per driver, that are alive on the cluster (``ray._private.state``'s
    job table; the public job API covers jobs submitted through the dashboard only)."""
    import ray._private.state

    return {str(j["JobID"]) for j in ray._private.state.jobs() if not j.get("IsDead")}


def train_callback_bases() -> tuple[type, ...]:
    """The base classes a Ray Train callback needs to hear about controller start, worker-group start,
    reports and the end of a run, and to act on every worker just before it uploads a checkpoint: Ray
    Train v2's internal ``ControllerCallback``, ``WorkerGroupCallback``, ``ReportCallback`` and
    ``TrainContextCallback`` (whose ``on_checkpoint_transfer`` context wraps each worker's upload; Ray
    pickles such a callback to the workers when it starts a worker group). ``ray.train.UserCallback``
    (public) sees reports only, and the ``RAY_TRAIN_CALLBACKS`` environment variable loads only
    subclasses of these."""
    from ray.train.v2._internal.execution.callback import (
        ControllerCallback,
        ReportCallback,
        TrainContextCallback,
        WorkerGroupCallback,
    )

    return ControllerCallback, WorkerGroupCallback, ReportCallback, TrainContextCallback


def worker_resources(scaling_config: Any) -> dict[str, float]:
    """What one training worker reserves (Ray fills in 1 CPU, or 1 GPU with use_gpu, when not given)."""
    resources = getattr(scaling_config, "_resources_per_worker_not_none", None)
    if isinstance(resources, dict):
        return {k: float(v) for k, v in resources.items()}
    given = dict(scaling_config.resources_per_worker or {})
    if scaling_config.use_gpu:
        given.setdefault("GPU", 1.0)
    return {k: float(v) for k, v in (given or {"CPU": 1.0}).items()}


def worker_placement(worker_group: Any) -> list[dict[str, Any]]:
    """Rank, hostname, IP and GPU ids of each worker of a started Ray Train worker group."""
    rows = []
    for i, worker in enumerate(worker_group.get_workers()):
        meta = worker.metadata
        context = getattr(worker, "distributed_context", None)
        rank = getattr(context, "world_rank", i)
        rows.append({"rank": rank, "hostname": meta.hostname, "ip": meta.node_ip, "gpu_ids": list(meta.gpu_ids)})
    return sorted(rows, key=lambda r: r["rank"])


def pin_torch_rendezvous(address_and_port: Callable[[], tuple[str, int]]) -> None:
    """Have Ray Train's torch backend (in this process: the Train controller) ask rank 0 for its address
    and rendezvous port through ``address_and_port``. Ray picks any free port and has no setting for a
    range; its ``on_start`` looks the function up by this module-level name at call time. Nothing to do,
    and torch not imported, where no TorchConfig was unpickled: raytrain's own runs
    (``raytrain.service.process_group``, which asks directly) and other frameworks' trainers."""
    import sys

    if "ray.train.torch.config" not in sys.modules:
        return
    import ray.train.torch.config as ray_torch_config

    if not hasattr(ray_torch_config, "get_address_and_port"):
        raise RuntimeError("Ray's torch backend no longer has get_address_and_port: update raytrain.ray_internals")
    ray_torch_config.get_address_and_port = address_and_port


def torch_framework() -> Any:
    """Ray Train's tag for a torch run, as its state API and dashboard show it."""
    from ray.train.v2._internal.util import TrainingFramework

    return TrainingFramework.TORCH


def torch_train_func_context() -> Any:
    """What Ray's torch backend wraps every worker's train function in (it picks the worker's CUDA device)."""
    from ray.train.torch.config import TorchConfigContextManager

    return TorchConfigContextManager


# Ray's own steps of its torch backend, run on each worker by raytrain's (raytrain.service.process_group).
# Module-level functions of this torch-free module, so that the controller, which sends them, need not
# import torch to name them.
def torch_env_on_worker(addr: str, port: int) -> None:
    """MASTER_ADDR/PORT for ``env://``, then torchrun's variables (RANK, LOCAL_RANK, ...) as Ray sets them."""
    import os

    from ray.train.torch.config import _set_torch_distributed_env_vars

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    _set_torch_distributed_env_vars()


def torch_process_group_on_worker(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    """``init_process_group`` over ``env://`` as Ray does it (NCCL's async error handling on, unless set)."""
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(backend, world_rank, world_size, "env://", timeout_s)


def torch_shutdown_on_worker(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


def torch_shutdown_timeout_s() -> int:
    """How long Ray's torch backend waits for its workers' process groups to close (its own setting)."""
    from ray._private.ray_constants import env_integer
    from ray.train.constants import (
        DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    )

    return int(env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))


def ray_address_and_port() -> tuple[str, int]:
    """Ray's own choice of rank 0's address and a free port."""
    from ray.train._internal.utils import get_address_and_port

    return get_address_and_port()  # type: ignore[no-any-return]


# What `ray start` writes in its --temp-dir (the GCS address) once its node has registered with the GCS
# (ray._common.utils.get_ray_address_file): a `ray start --block` that exits without it failed its own
# startup. Ray has no public way to tell a failed start from a later exit.
STARTED_FILE = "ray_current_cluster"


# Ray Train's index of a run's checkpoints, in the run directory (ray.train.v2 constants).
CHECKPOINT_SNAPSHOT = "checkpoint_manager_snapshot.json"


@dataclass(frozen=True)
class Registered:
    """A checkpoint in Ray Train's index: its directory, the metrics reported with it, its report number."""

    dir_name: str
    metrics: dict[str, Any]
    report_index: int


class OutsideRun(ValueError):
    """A checkpoint index that names something outside its run directory: written by someone else."""


def read_checkpoint_snapshot(blob: bytes) -> tuple[list[Registered], int]:
    """The checkpoints Ray Train keeps for a run (oldest first; the last is what
    ``ray.train.get_checkpoint()`` returns on resume) and its report counter, from
    ``checkpoint_manager_snapshot.json`` (Ray's private format: a pydantic model of its
    ``CheckpointManager``). Raises ValueError if the file does not parse as one."""
    import json

    raw = json.loads(blob)
    if not isinstance(raw, dict) or not isinstance(raw.get("checkpoint_results"), list):
        raise ValueError("not a Ray Train checkpoint snapshot")
    indices = raw.get("checkpoint_report_indices") or []
    for r in raw["checkpoint_results"]:
        name = str(r["checkpoint_dir_name"])
        if not name or "/" in name or name in (".", ".."):
            raise OutsideRun(f"it names {name!r}, which is not a checkpoint directory of the run")
    kept = [
        Registered(dir_name=str(r["checkpoint_dir_name"]), metrics=dict(r.get("metrics") or {}), report_index=int(i))
        for r, i in zip(raw["checkpoint_results"], indices, strict=True)
    ]
    latest = (raw.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    if latest is not None and kept and kept[-1].dir_name != latest:  # Ray keeps report order: latest is last
        kept = [k for k in kept if k.dir_name != latest] + [k for k in kept if k.dir_name == latest]
    return kept, int(raw.get("current_report_index", len(kept)))


def write_checkpoint_snapshot(kept: list[Registered], current_report_index: int) -> bytes:
    """A snapshot Ray Train loads as a run that keeps ``kept`` (oldest first), the last of them the
    latest, with nothing pending validation."""
    import json

    import ray

    def state(r: Registered) -> dict[str, Any]:
        return {"version": 0, "checkpoint_dir_name": r.dir_name, "metrics": r.metrics}

    snapshot = {
        "ray_version": ray.__version__,
        "checkpoint_results": [state(r) for r in kept],
        "checkpoint_report_indices": [r.report_index for r in kept],
        "latest_checkpoint_result": state(kept[-1]) if kept else None,
        "pending_training_results": [],
        "pending_validation_specs": [],
        "current_report_index": current_report_index,
        "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    }
    return json.dumps(snapshot).encode()


def user_exception(error: BaseException) -> BaseException:
    """The exception a training function raised, as Ray Train hands it to callbacks (wrapped with its
    traceback in ``UserExceptionWithTraceback``, whose ``_base_exc`` holds it)."""
    base = getattr(error, "_base_exc", None)
    return base if isinstance(base, BaseException) else error


def visible_gpus() -> int:
    """The NVIDIA GPUs this process may use, counted as Ray counts them when it starts a node (NVML, narrowed
    by ``CUDA_VISIBLE_DEVICES``), without importing torch: 2 s of CPU before a local Ray could start. Falls
    back to torch's count if Ray's accelerator manager moved."""
    try:
        from ray._private.accelerators import NvidiaGPUAcceleratorManager as Gpus
    except ImportError:
        import torch

        return torch.cuda.device_count()
    count = int(Gpus.get_current_node_num_accelerators())
    visible = Gpus.get_current_process_visible_accelerator_ids()
    return count if visible is None else min(count, len(visible))


class NoDatasets:
    """The dataset shard provider of a run given no datasets: a worker's ``ray.train.get_dataset_shard(name)``
    raises the ``KeyError`` Ray Train's own provider raises for a name it was not given (user code catches it
    to run without data), and no ``DatasetManager`` actor stands behind it."""

    def get_dataset_shard(self, dataset_info: Any) -> Any:
        raise KeyError(
            f"Dataset shard for '{dataset_info.dataset_name}' not found. "
            "Please ensure that the dataset is passed through the Trainer `datasets` argument."
        )


def trainer_without_idle_datasets(trainer_cls: type) -> type:
    """``trainer_cls`` (a Ray Train trainer) whose dataset callback, when it is given no datasets, hands the
    workers a ``NoDatasets`` provider: Ray Train's own starts a ``DatasetManager`` actor, a process of its own
    (about 2 s of CPU beside the starting workers) that could only answer ``KeyError``.
    ``_create_default_callbacks`` and ``DatasetsCallback.before_init_train_context`` are where Ray Train 2.60
    lists its callbacks and makes the provider; if they moved, the trainer is left as it is."""
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError:
        return trainer_cls
    if not hasattr(trainer_cls, "_create_default_callbacks") or not hasattr(
        DatasetsCallback, "before_init_train_context"
    ):
        return trainer_cls

    class Datasets(DatasetsCallback):  # type: ignore[misc]
        def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
            if self._datasets:
                return super().before_init_train_context(workers)  # type: ignore[no-any-return]
            return {"dataset_shard_provider": [NoDatasets()] * len(workers)}

    class Trainer(trainer_cls):  # type: ignore[misc]
        def _create_default_callbacks(self) -> list[Any]:
            callbacks: list[Any] = super()._create_default_callbacks()
            return [
                Datasets(train_run_context=self.train_run_context, datasets=self.datasets)
                if type(c) is DatasetsCallback
                else c
                for c in callbacks
            ]

    Trainer.__name__ = Trainer.__qualname__ = trainer_cls.__name__
    return Trainer


def tune_report_callback() -> Any:
    """Inside a Ray Tune trial (a sweep's): the Ray Train callback that hands rank 0's reports to Tune, for
    its schedulers and searchers (Ray's own integration; its check of the session is private). Else None."""
    import sys

    if "ray.tune" not in sys.modules:  # a trial has imported Tune; importing it here would cost a plain run
        return None
    from ray.tune.trainable.trainable_fn_utils import _in_tune_session

    if not _in_tune_session():
        return None
    from ray.tune.integration.ray_train import TuneReportCallback

    return TuneReportCallback()
