"""Experiment tracking where people already look: a run's parameters, its metrics at every report and its
best checkpoint, logged to MLflow (``--tracker mlflow[=URI]``; the ``raytrain[mlflow]`` extra).

The driver logs, never the workers: rank 0's reports reach it already, so there is one writer per run and
nothing in the training loop. A run's MLflow run id is kept in its run directory (``tracking.json``), so
every attempt of the run (a requeue, a resume, a yield to a run of higher priority) logs into the same
MLflow run, each report at its epoch. A sweep's trials log into the sweep's experiment, one MLflow run each.

The tracker is reached once before any worker starts: a wrong URI, a server that does not answer or a
missing package is one line within seconds. Once training is under way, tracking never stops it: the first
failure is said in one line and the run goes on untracked.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow.fs as pafs

from raytrain import fsio, uri
from raytrain.contracts import env, rundir
from raytrain.contracts.result import RunResult
from raytrain.errors import UserError
from raytrain.service import curves
from raytrain.service.config import Tracker

if TYPE_CHECKING:
    from raytrain.contracts.rundir import HistoryEntry
    from raytrain.service.runs import RunDir

DEFAULT_EXPERIMENT = "raytrain"
BEST_ARTIFACTS = "best_checkpoint"  # the artifact directory the best checkpoint's files go to
_PARAM_MAX = 6000  # characters MLflow keeps of a parameter's value
_BATCH_MAX = 100  # parameters MLflow takes in one log_batch call
T = TypeVar("T")
MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "lost": "FAILED", "cancelled": "KILLED"}


def experiment(tracker: Tracker) -> str:
    """The MLflow experiment a run logs into: the tracker's, else ``MLFLOW_EXPERIMENT_NAME``, else ours."""
    return tracker.experiment or env.MLFLOW_EXPERIMENT.get() or DEFAULT_EXPERIMENT


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def _flat(settings: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as MLflow parameters: ``a.b`` keys, values as text (None left out)."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{name}."))
        elif value is not None:
            out[name] = str(value)[:_PARAM_MAX]
    return out


class Tracking:
    """One run's tracking, in its driver: ``open`` before any worker starts, ``report`` for each report,
    ``end`` when the attempt ends."""

    def __init__(self, client: Any, run_id: str, echo: Callable[[str], None], where: str, before: int) -> None:
        self._client = client
        self.run_id = run_id
        self._echo = echo
        self._where = where
        self._logged = before  # reports in the run's history: a report without an epoch is logged at its number
        self._failed = False

    @staticmethod
    def reach(tracker: Tracker, storage_uri: str, *, experiment: str | None = None) -> None:
        """Before the cluster starts: the client is installed and the tracker answers, and EXPERIMENT (a
        sweep's, which its trials then share) exists; a UserError in one line if not."""
        uri = _tracking_uri(tracker, storage_uri)
        client = _client(uri)
        _answering(uri, lambda: client.search_experiments(max_results=1))
        if experiment is not None:
            _answering(uri, lambda: _experiment_id(client, experiment))

    @staticmethod
    def tracked_before(run_dir: RunDir) -> bool:
        """Whether an earlier attempt of the run logged to a tracker."""
        return _kept(run_dir.fs, posixpath.join(run_dir.path, rundir.TRACKING)) is not None

    @classmethod
    def open(
        cls,
        tracker: Tracker,
        *,
        run_dir: RunDir,
        run_name: str,
        settings: Mapping[str, Any],
        tags: Mapping[str, str],
        echo: Callable[[str], None],
    ) -> Tracking:
        """The run's MLflow run, made on its first attempt (with its parameters) and taken up again on the
        next ones. A first attempt that cannot reach the tracker stops before anything starts (a UserError);
        a later one (a requeue) goes on untracked, with a line."""
        uri = _tracking_uri(tracker, run_dir.storage.uri)
        client = _client(uri)
        path = posixpath.join(run_dir.path, rundir.TRACKING)
        kept = _kept(run_dir.fs, path)

        def start() -> str:
            if kept is not None and kept.get("uri") == uri:
                run_id = str(kept["run_id"])
                client.update_run(run_id, status="RUNNING")
                echo(f"tracking: MLflow run {run_id} at {uri} goes on")
                return run_id
            name = experiment(tracker)
            run_id = str(
                client.create_run(_experiment_id(client, name), run_name=run_name, tags=dict(tags)).info.run_id
            )
            _log_params(client, run_id, _flat(settings))
            _write(run_dir.fs, path, {"uri": uri, "run_id": run_id, "experiment": name})
            echo(f"tracking: MLflow run {run_id} in experiment {name!r} at {uri}")
            return run_id

        before = len(curves.read_history(run_dir.fs, run_dir.path))
        try:
            run_id = _answering(uri, start)
        except UserError as exc:
            if kept is None:
                raise
            echo(f"tracking: {str(exc).removeprefix('--tracker mlflow: ')}; this attempt goes on untracked")
            tracking = cls(client, str(kept["run_id"]), echo, uri, before)
            tracking._failed = True
            return tracking
        return cls(client, run_id, echo, uri, before)

    def report(self, metrics: Mapping[str, Any], at: float) -> None:
        """One report's numbers, at its epoch, else at its number in the run's history."""
        self._logged += 1
        number = self._logged
        self._try(lambda: _log_metrics(self._client, self.run_id, metrics, number, at))

    def end(self, result: RunResult, best: str | None, fs: pafs.FileSystem) -> None:
        """The attempt's outcome: the MLflow run's status, and the best checkpoint's files as artifacts once
        the run completed (its path as a tag in any case)."""
        self._ended(result.status)
        if best is None:
            return
        self._try(lambda: self._client.set_tag(self.run_id, "raytrain.best_checkpoint", best))
        if result.status == "completed" and isinstance(fs, pafs.LocalFileSystem) and os.path.isdir(best):
            self._try(lambda: self._client.log_artifacts(self.run_id, best, BEST_ARTIFACTS))

    def cancelled(self) -> None:
        """``raytrain cancel`` ended the run while it waited its turn."""
        self._ended("cancelled")

    def _ended(self, status: str) -> None:
        def say() -> None:
            self._client.set_tag(self.run_id, "raytrain.status", status)
            if status in MLFLOW_STATUS:  # a preempted run is not over: it stays RUNNING
                self._client.set_terminated(self.run_id, status=MLFLOW_STATUS[status])

        self._failed = False  # the run's end is worth another try after a failed report
        self._try(say)

    def _try(self, log: Callable[[], None]) -> None:
        if self._failed:
            return
        try:
            log()
        except Exception as exc:  # tracking never stops training
            self._failed = True
            self._echo(f"tracking: logging to {self._where} failed ({_brief(exc)}); the run goes on untracked")


def settle(fs: pafs.FileSystem, run_path: str, status: str, echo: Callable[[str], None]) -> None:
    """A run whose end its own driver could not say (a sweep's trial that its scheduler stopped early, or
    that failed to start): its MLflow run, if it has one, ends with STATUS (never raises)."""
    try:
        kept = _kept(fs, posixpath.join(run_path, rundir.TRACKING))
        if kept is None:
            return
        client = _client(str(kept["uri"]))
        run_id = str(kept["run_id"])  # the sweep's word on its trial stands over the trial's own
        _catch_up(client, run_id, curves.read_history(fs, run_path))
        client.set_tag(run_id, "raytrain.status", status)
        client.set_terminated(run_id, status=MLFLOW_STATUS.get(status, "KILLED"))
    except Exception as exc:  # a report of the run must never fail the sweep
        echo(f"tracking: could not mark {posixpath.basename(run_path)} {status} ({_brief(exc)})")


def _log_metrics(client: Any, run_id: str, metrics: Mapping[str, Any], number: int, at: float) -> None:
    """One report's numbers, at its epoch, else at NUMBER (its place in the run's history, from 1)."""
    from mlflow.entities import Metric

    numbers = _numbers(metrics)
    step = int(numbers.get("epoch", number))
    client.log_batch(run_id, metrics=[Metric(k, v, int(at * 1000), step) for k, v in numbers.items()])


def _catch_up(client: Any, run_id: str, history: list[HistoryEntry]) -> None:
    """Log the reports of the run's history that its MLflow run lacks: the last one of a trial that Tune
    stopped as it came, before its driver had logged it."""
    if not history or not (probe := next(iter(_numbers(history[-1].metrics)), None)):
        return
    logged = {m.step for m in client.get_metric_history(run_id, probe)}
    for number, entry in enumerate(history, start=1):
        if int(_numbers(entry.metrics).get("epoch", number)) not in logged:
            _log_metrics(client, run_id, entry.metrics, number, entry.at)


def _experiment_id(client: Any, name: str) -> str:
    """The experiment's id, made if there is none (by whichever of the runs starting at once gets there)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except Exception:  # another run made it meanwhile (RESOURCE_ALREADY_EXISTS)
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _client(uri: str) -> Any:
    # Fail in seconds where MLflow would retry for minutes (settings the user exported win).
    for var in (env.MLFLOW_RETRIES, env.MLFLOW_TIMEOUT, env.MLFLOW_FILE_STORE):
        os.environ.setdefault(var.name, var.require())
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise UserError(
            "--tracker mlflow needs MLflow's client: pip install 'raytrain[mlflow]' (or mlflow-skinny)"
        ) from None
    return MlflowClient(tracking_uri=uri)


def _answering(uri: str, call: Callable[[], T]) -> T:
    """CALL's value, or a UserError in one line when the tracker does not take it."""
    try:
        return call()
    except UserError:
        raise
    except Exception as exc:  # MLflow's own errors, the network's, the store's
        raise UserError(
            f"--tracker mlflow: cannot log to {uri} ({_brief(exc)}): check the URI and that the server runs, "
            "or train without --tracker"
        ) from None


def _tracking_uri(tracker: Tracker, storage_uri: str) -> str:
    if tracker.uri:
        return tracker.uri
    if configured := env.MLFLOW_URI.get():
        return configured
    fs, path = uri.resolve(storage_uri)
    if not isinstance(fs, pafs.LocalFileSystem):
        raise UserError(
            f"--tracker mlflow: --storage {storage_uri} is not a local path, so there is no file store beside the "
            "runs: give the tracking server, --tracker mlflow=http://HOST:5000"
        )
    return "file://" + posixpath.join(path, "mlruns")


def _kept(fs: pafs.FileSystem, path: str) -> dict[str, Any] | None:
    from raytrain.service import runs

    if fsio.bounded(lambda: fs.get_file_info(path), f"looking for {path}").type == pafs.FileType.NotFound:
        return None
    kept = fsio.bounded(lambda: runs.read_json(fs, path), f"reading {path}")
    return kept if isinstance(kept, dict) and kept.get("run_id") else None


def _write(fs: pafs.FileSystem, path: str, payload: dict[str, Any]) -> None:
    from raytrain.service import runs

    fsio.bounded(lambda: runs.write_json(fs, path, payload), f"writing {path}", writes=True)


def _log_params(client: Any, run_id: str, params: Mapping[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in sorted(params.items())]
    for start in range(0, len(items), _BATCH_MAX):
        client.log_batch(run_id, params=items[start : start + _BATCH_MAX])


def _brief(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
