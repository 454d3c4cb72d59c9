"""`raytrain sweep`: a search space checked before anything starts, trials that are raytrain runs, early
stopping by Ray Tune's ASHA, the ranking, the best trial evaluated, and a sweep that resumes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from raytrain.contracts import rundir, sweepdir
from raytrain.contracts.result import RunResult
from raytrain.errors import UserError
from raytrain.service import sweep_space
from tests.conftest import assert_user_error, run_cli


def test_a_space_from_flags_and_a_file_reads_each_kind() -> None:
    lr = sweep_space.parse_flag("lr=loguniform:1e-4:0.1")
    assert (lr.name, lr.kind, lr.values) == ("lr", "loguniform", (1e-4, 0.1))
    layers = sweep_space.parse_flag("layers=int:1:4")
    assert layers.values == (1, 4) and all(type(v) is int for v in layers.values)
    model = sweep_space.parse_flag("model=choice:resnet18, 32,true")
    assert model.values == ("resnet18", 32, True)
    assert sweep_space.parse_flag(str(model)) == model  # a parameter reads back as it is written
    space = sweep_space.SearchSpace.of(["wd=grid:0,1e-4,5e-4", "bs=grid:32,64"], None)
    assert space.grid_size == 6
    # Ray Tune's own domains: an int range includes its upper end, as `int:LO:HI` says.
    from ray import tune

    domain = layers.to_tune()
    assert isinstance(domain, tune.search.sample.Integer) and (domain.lower, domain.upper) == (1, 5)
    assert space.to_tune()["wd"] == {"grid_search": [0, 1e-4, 5e-4]}


def test_a_params_file_in_yaml_or_json_gives_the_same_space(tmp_path: Path) -> None:
    yaml_file = tmp_path / "space.yaml"
    yaml_file.write_text("lr: loguniform:1e-4:1e-1\nbatch_size: {choice: [32, 64]}\n")
    json_file = tmp_path / "space.json"
    json_file.write_text(json.dumps({"lr": {"loguniform": [1e-4, 1e-1]}, "batch_size": "choice:32,64"}))
    assert sweep_space.SearchSpace.of([], yaml_file) == sweep_space.SearchSpace.of([], json_file)
    with pytest.raises(UserError, match="'lr' is given twice"):
        sweep_space.SearchSpace.of(["lr=uniform:0.1:0.2"], yaml_file)


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        ("lr=gaussian:0:1", "unknown distribution 'gaussian': use one of loguniform, uniform, int, choice, grid"),
        ("lr=uniform:0.1", "uniform takes LO:HI, e.g. lr=uniform:1e-4:1e-1 (1 value(s) given)"),
        ("lr=uniform:0.5:0.1", "the range 0.5..0.1 is empty or reversed: give LO below HI"),
        ("lr=uniform:a:0.1", "'a' is not a number"),
        ("lr=loguniform:0:0.1", "loguniform needs LO above 0 (0 given)"),
        ("layers=int:1:2.5", "int takes whole numbers LO:HI"),
        ("lr", "is not NAME=KIND:ARGS"),
        ("model=choice:", "choice needs at least one value"),
    ],
)
def test_a_malformed_parameter_is_one_line_naming_it(flag: str, said: str) -> None:
    with pytest.raises(UserError) as caught:
        sweep_space.parse_flag(flag)
    assert said in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--param", "lr=gaussian:0:1"], ["--param 'lr=gaussian:0:1': unknown distribution 'gaussian'"]),
        (
            ["--param", "lrr=uniform:0.01:0.1"],
            ["--param lrr: the built-in classifier has no such option (did you mean lr?)"],
        ),
        (["--param", "batch_size=uniform:16:64"], ["--batch-size takes whole numbers: use int:LO:HI, choice or grid"]),
        (["--param", "lr=uniform:-0.1:0.1"], ["--param lr=uniform:-0.1:0.1: --lr -0.1 must be positive"]),
        (["--param", "optimizer=choice:sgd,lion"], ["--optimizer 'lion' is not one of sgd, adamw"]),
        (
            ["--param", "lr=uniform:0.01:0.1", "--metric", "val_accuracy"],
            ["--metric val_accuracy: the workload never reports it"],
        ),
        (
            ["--param", "lr=uniform:0.01:0.1", "--concurrent", "1000"],
            ["--concurrent 1000: a trial takes 1 worker(s) x 1 CPU"],
        ),
        (["--param", "lr=uniform:0.01:0.1", "--workers", "1:2"], ["--workers MIN:MAX is for one elastic run"]),
        (
            ["--param", "lr=uniform:0.01:0.1", "--train-func", "tests.user_code.train_func:train_func"],
            ["need --metric"],
        ),
        ([], ["a sweep needs a search space"]),
    ],
)
def test_a_sweep_that_cannot_run_fails_in_one_line_before_anything_starts(
    tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    result = run_cli("sweep", "--storage", str(tmp_path / "runs"), "--name", "s", *args)
    assert_user_error(result, *fragments)
    assert not (tmp_path / "runs" / "s").exists()


def test_a_trial_replays_each_epoch_once_and_the_metric_check_needs_a_report_without_it() -> None:
    from raytrain.contracts.rundir import HistoryEntry
    from raytrain.service import sweeps

    def entry(**metrics: float) -> HistoryEntry:
        return HistoryEntry(at=0.0, attempt=0.0, metrics=dict(metrics))

    # Epoch 2 cut short by a preemption, then trained whole by the resume: Tune hears epochs 1, 2, 3 once.
    history = [entry(epoch=1, loss=0.9), entry(epoch=2, loss=0.8), entry(epoch=2, loss=0.7), entry(epoch=3, loss=0.6)]
    assert [m["loss"] for m in sweeps._replayed(history, "epoch")] == [0.9, 0.7, 0.6]
    # A train function's clock is Tune's count of reports: by its epochs when it reports them, else all.
    assert [m["loss"] for m in sweeps._replayed(history, "training_iteration")] == [0.9, 0.7, 0.6]
    assert len(sweeps._replayed([entry(loss=1.0), entry(loss=1.0)], "training_iteration")) == 2

    class Trial:
        def __init__(self, trial_id: str) -> None:
            self.trial_id = trial_id

    check = sweeps._MetricCheck("accuracy")
    check("a_00000", {"done": True, "trial_id": "a_00000"})  # Tune's own last result of a trial that failed first
    check.on_trial_complete(0, [], Trial("a_00000"))
    check("a_00001", {"epoch": 1, "accuracy": 0.5})
    check.on_trial_complete(0, [], Trial("a_00001"))
    assert not check.stop_all()
    check("a_00002", {"epoch": 1, "loss": 0.5, "training_iteration": 1})
    check.on_trial_complete(0, [], Trial("a_00002"))
    assert check.stop_all() and check.missing == ["epoch", "loss"]


@pytest.mark.parametrize(
    ("status", "saved"), [("cancelled", "failed"), ("preempted", "preempted"), (None, "preempted")]
)
def test_a_trial_cancelled_as_the_job_ends_stays_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: str | None, saved: str
) -> None:
    """`raytrain cancel` ended a trial's run just as the job began to end: the sweep records it as ended,
    not as preempted (which its next attempt would run again); a trial the ending stopped does resume, and
    so does one that would have started as the job ends (no run yet: `_trial` raised TrialEnded)."""
    from types import SimpleNamespace

    import pyarrow.fs as pafs

    from raytrain.service import preemption, runs, sweeps

    monkeypatch.setattr(preemption, "job_ending", lambda: True)
    cfg = SimpleNamespace(space=SimpleNamespace(names=["lr"]), tracker=None)
    lines: list[str] = []
    progress = sweeps.Progress(cfg, pafs.LocalFileSystem(), str(tmp_path), "epoch", lines.append)  # type: ignore[arg-type]
    trial = SimpleNamespace(trial_id="sweep_00003", config={"lr": 0.1}, last_result={}, error_file=None)
    progress.on_trial_start(0, [], trial)
    name = sweepdir.trial_name(3)
    if status is not None:
        result = RunResult(name=name, kind="fit", status=status, world_size=1, backend="gloo")  # type: ignore[arg-type]
        (tmp_path / sweepdir.RUNS / name).mkdir(parents=True)
        runs.write_json(pafs.LocalFileSystem(), str(tmp_path / sweepdir.RUNS / name / "result.json"), result.to_json())
    progress.on_trial_error(0, [], trial)
    (record,) = json.loads((tmp_path / sweepdir.TRIALS).read_text())
    assert record["name"] == name and record["status"] == saved, (record, lines)
    if status is None:
        assert lines[-1] == f"sweep: {name} preempted: not started: the job ends soon; it resumes with the sweep"


def _history(run: Path) -> list[dict[str, object]]:
    return [json.loads(line)["metrics"] for line in (run / rundir.HISTORY).read_text().splitlines()]


@pytest.mark.slow
def test_a_sweep_stops_the_trailing_trials_ranks_them_evaluates_the_best_and_resumes(
    tmp_path: Path, mlflow_server: str
) -> None:
    from mlflow.tracking import MlflowClient

    storage = tmp_path / "runs"
    sweep = [
        "sweep",
        "--storage",
        str(storage),
        "--name",
        "lr-sweep",
        "--param",
        "lr=grid:1e-5,0.05",  # a rate too small to learn in 3 epochs, and one that learns
        "--param",
        "batch_size=choice:32,64",
        "--trials",
        "2",
        "--epochs",
        "3",
        "--grace",
        "2",  # epoch 1's accuracy is near chance at either rate: ASHA tells them apart at epoch 2
        "--image-size",
        "8",
        "--concurrent",
        "2",
        "--tracker",
        f"mlflow={mlflow_server}",
    ]
    first = run_cli(*sweep, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "4 trial(s) of lr=grid:1e-05,0.05, batch_size=choice:32,64; 2 at once" in out, out
    root = storage / "lr-sweep"
    records = [sweepdir.TrialRecord.from_json(r) for r in json.loads((root / sweepdir.TRIALS).read_text())]
    records.sort(key=lambda r: r.name)
    assert [r.name for r in records] == [sweepdir.trial_name(i) for i in range(4)]
    # Each trial is a raytrain run of its own, with its parameters; ASHA stopped one that trailed at epoch 2,
    # and those that completed trained every epoch and wrote result.json. The rates alternate, two trials at
    # once; at epoch 2 the small rate's val_acc is near chance (~14%), the other's ~60% (measured). ASHA stops
    # a trial below two-thirds of the way up the values recorded before it (~45% for one of each), so a
    # small-rate trial that reports after a large-rate one is stopped, and a large-rate one never is. Trial 0
    # reports after trial 1, or trial 2 does: it starts only once trial 0 or 1 has ended, and trial 1, started
    # with trial 0, reports epoch 2 long before trial 2 can (a start and two epochs later).
    by_status: dict[str, list[sweepdir.TrialRecord]] = {}
    for r in records:
        by_status.setdefault(r.status, []).append(r)
        run = root / sweepdir.RUNS / r.name
        config = json.loads((run / rundir.RUN_META).read_text())["config"]["optim"]
        assert (config["lr"], config["batch_size"]) == (r.params["lr"], r.params["batch_size"])
        assert r.params["lr"] == (1e-5, 0.05)[int(r.name[-5:]) % 2] and r.params["batch_size"] in (32, 64)
        epochs = [m["epoch"] for m in _history(run)]
        if r.status == "completed":
            result = RunResult.from_json(json.loads((run / rundir.RESULT).read_text()))
            assert result.status == "completed" and result.epochs_completed == 3 and epochs == [1, 2, 3]
        else:
            assert r.status == "stopped" and epochs == [1, 2] and r.params["lr"] == 1e-5, (r, epochs)
            assert re.search(rf"^sweep: {r.name} stopped early by ASHA at epoch 2$", out, re.M), out
    assert set(by_status) == {"completed", "stopped"} and by_status["stopped"], records

    # Every trial logged to MLflow, in the sweep's experiment: its parameters, its epochs, how it ended.
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("lr-sweep")
    assert experiment is not None
    tracked = {t.info.run_name: t for t in client.search_runs([experiment.experiment_id])}
    assert sorted(tracked) == sorted(r.name for r in records), tracked
    for r in records:
        t = tracked[r.name]
        assert float(t.data.params["optim.lr"]) == pytest.approx(r.params["lr"])
        assert t.data.params["optim.batch_size"] == str(r.params["batch_size"])
        steps = sorted(m.step for m in client.get_metric_history(t.info.run_id, "val_acc"))
        assert steps == sorted({m["epoch"] for m in _history(root / sweepdir.RUNS / r.name)}), (r, steps)
        assert t.data.tags["raytrain.status"] == r.status
        assert t.info.status == ("FINISHED" if r.status == "completed" else "KILLED"), t.info

    # The ranking: by each trial's best val_acc in its history, best first; evaluate takes the best trial.
    best = {r.name: max(float(m["val_acc"]) for m in _history(root / sweepdir.RUNS / r.name)) for r in records}
    report = run_cli("report", str(root))
    assert report.returncode == 0, report.stderr
    ranked = re.findall(r"^\d+\s+(trial_\d{5})\s+(completed|stopped)\s+(\S+)", report.stdout, re.M)
    assert [name for name, _, _ in ranked] == sorted(best, key=lambda n: -best[n]), report.stdout
    assert all(abs(float(v) - best[name]) < 1e-3 for name, _, v in ranked)
    assert (root / sweepdir.CURVES).read_bytes().startswith(b"\x89PNG")
    top = root / sweepdir.RUNS / ranked[0][0]
    evaluated = run_cli("evaluate", str(root), timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"its best trial, {top}" in evaluated.stdout
    (written,) = (top / "eval").glob("*/evaluation.json")
    evaluation = json.loads(written.read_text())
    assert evaluation["checkpoint"].startswith(f"{top}/best/") and evaluation["accuracy"] > 0.5, evaluation

    # The same command again resumes the sweep: every trial had ended, so none starts again, nor does Ray.
    again = run_cli(*sweep, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming (finished trials kept, stopped ones stay stopped)" in again.stdout
    assert "sweep: every trial has ended: nothing to run" in again.stdout, again.stdout
    assert " started: " not in again.stdout and "dashboard:" not in again.stdout, again.stdout
    assert re.findall(r"^\d+\s+(trial_\d{5})", again.stdout, re.M) == [name for name, _, _ in ranked]  # the table
    assert [r.status for r in records] == [
        sweepdir.TrialRecord.from_json(r).status for r in json.loads((root / sweepdir.TRIALS).read_text())
    ]
    # Another space under the same name is refused, nothing changed; --fresh would move the sweep aside.
    other = run_cli(*[a.replace("choice:32,64", "choice:16,32") for a in sweep])
    assert_user_error(other, "sweep 'lr-sweep' in", "was started with other settings", "--fresh")


@pytest.mark.slow
def test_a_train_function_sweep_whose_metric_never_comes_ends_saying_what_it_reports(tmp_path: Path) -> None:
    result = run_cli(
        "sweep",
        "--storage",
        str(tmp_path / "runs"),
        "--train-func",
        "tests.user_code.train_func:train_func",
        "--config",
        "epochs=2",
        "--config",
        "steps=2",
        "--param",
        "lr=uniform:0.01:0.1",
        "--trials",
        "2",
        "--metric",
        "accuracy",
        timeout=600,
    )
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert lines[0].startswith("raytrain: error: --metric accuracy: the trials do not report it (a report had: ")
    assert re.search(r"had: [^)]*\bepoch\b[^)]*\bloss\b", lines[0]) and "Traceback" not in result.stdout, lines
