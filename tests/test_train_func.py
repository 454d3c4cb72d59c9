"""Any Ray Train code on raytrain: a user's function through `fit --train-func`, a stock trainer that
asks for more than the cluster holds, and the result.json a stock script gets (real local Ray)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from raytrain import ray_internals
from raytrain.contracts.result import RunResult
from tests.conftest import assert_user_error, image_table, read_until, run_cli, spawn_cli, write_parquet

FUNC = "tests.user_code.train_func:train_func"


def result_of(storage: Path, name: str) -> RunResult:
    return RunResult.from_json(json.loads((storage / name / "result.json").read_text()))


class TestBadInput:
    """One line, exit 2, in seconds, before any Ray starts."""

    def test_function_that_does_not_import(self, tmp_path: Path) -> None:
        out = run_cli("fit", "--train-func", "no_such_pkg.train:fn", "--storage", str(tmp_path))
        assert_user_error(out, "cannot import 'no_such_pkg.train' for --train-func", "PYTHONPATH")

    def test_not_module_colon_function(self, tmp_path: Path) -> None:
        assert_user_error(run_cli("fit", "--train-func", "train_func", "--storage", str(tmp_path)), "MODULE:FUNCTION")

    def test_recipe_options_are_refused(self, tmp_path: Path) -> None:
        out = run_cli("fit", "--train-func", FUNC, "--epochs", "3", "--storage", str(tmp_path))
        assert_user_error(out, "--epochs set the built-in classifier", "--config KEY=VALUE")

    def test_config_without_equals(self, tmp_path: Path) -> None:
        out = run_cli("fit", "--train-func", FUNC, "--config", "epochs", "--storage", str(tmp_path))
        assert_user_error(out, "--config 'epochs' is not KEY=VALUE")

    def test_missing_data(self, tmp_path: Path) -> None:
        out = run_cli("fit", "--train-func", FUNC, "--data", str(tmp_path / "nope"), "--storage", str(tmp_path))
        assert_user_error(out, "does not exist")

    def test_sbatch_arguments_without_slurm(self, tmp_path: Path) -> None:
        assert_user_error(run_cli("fit", "--storage", str(tmp_path), "--", "-p", "gpu"), "go after --slurm --")


def stock_trainer(storage: Path, name: str, workers: int, cpus_per_worker: float, epochs: int) -> Any:
    """A TorchTrainer as a stock script builds one (tests/user_code/stock_train.py), no raytrain in it."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from tests.user_code.stock_train import train_func

    return TorchTrainer(
        train_func,
        train_loop_config={"lr": 0.1, "epochs": epochs},
        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": cpus_per_worker}),
        run_config=ray.train.RunConfig(storage_path=str(storage), name=name),
    )


@pytest.mark.ray
def test_a_stock_trainer_asking_for_more_than_the_cluster_fails_at_once(ray_local: object, tmp_path: Path) -> None:
    import ray.train

    cpus = int(ray.cluster_resources()["CPU"])
    trainer = stock_trainer(tmp_path, "too-big", workers=cpus + 1, cpus_per_worker=1, epochs=1)
    start = time.monotonic()
    with pytest.raises(ray.train.TrainingFailedError) as failed:
        trainer.fit()
    assert time.monotonic() - start < 30  # Ray alone retries WorkerGroupStartupTimeoutError forever
    assert (
        f"ScalingConfig(num_workers={cpus + 1}) needs 1 CPU per worker, but this Ray cluster (1 node(s), {cpus} CPU "
        f"in all) holds {cpus} such worker(s): ask for {cpus} or fewer" in str(failed.value)
    )


@pytest.mark.ray
def test_a_stock_trainer_gets_a_result_json(ray_local: object, tmp_path: Path) -> None:
    fitted = stock_trainer(tmp_path, "stock", workers=2, cpus_per_worker=0.5, epochs=2).fit()
    result = result_of(tmp_path, "stock")
    assert result.kind == "script" and result.status == "completed" and result.world_size == 2
    assert [m["epoch"] for m in result.history] == [1, 2] and result.epochs_completed == 2
    assert result.final["loss"] == pytest.approx(fitted.metrics["loss"])
    assert [p.rank for p in result.placement] == [0, 1] and {p.device for p in result.placement} == {"cpu"}
    assert result.last_checkpoint == fitted.checkpoint.path


def _asks_for_a_shard(config: dict[str, Any]) -> None:
    import ray.train

    answer = Path(config["answers"]) / str(ray.train.get_context().get_world_rank())
    try:
        ray.train.get_dataset_shard("train")
    except KeyError as missing:
        answer.write_text(f"KeyError: {missing}")
    else:
        answer.write_text("a shard")


@pytest.mark.ray
def test_a_run_given_no_datasets_answers_a_shard_request_as_ray_does_without_a_dataset_manager(
    ray_local: object, tmp_path: Path
) -> None:
    """User code that runs with or without data asks for a shard and catches KeyError (Ray Train's answer
    for a name it was not given); raytrain's trainer must answer the same, with no DatasetManager actor."""
    import ray._private.state
    import ray.train
    from ray.train.torch import TorchTrainer

    def managers() -> list[str]:
        return [a["ActorID"] for a in ray._private.state.actors().values() if a["ActorClassName"] == "DatasetManager"]

    before = managers()
    answers = tmp_path / "answers"
    answers.mkdir()
    trainer = ray_internals.trainer_without_idle_datasets(TorchTrainer)(
        _asks_for_a_shard,
        train_loop_config={"answers": str(answers)},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="no-data"),
    )
    assert trainer.fit().error is None
    for rank in ("0", "1"):
        assert (answers / rank).read_text().startswith("KeyError: \"Dataset shard for 'train' not found")
    assert managers() == before


@pytest.mark.slow
def test_train_func_trains_with_data_and_resumes_from_its_own_checkpoint(tmp_path: Path) -> None:
    """Data handed over as Ray Data shards; stopped (SIGTERM) after its second epoch; the same command
    goes on from the function's own checkpoint."""
    data = write_parquet(tmp_path / "d.parquet", image_table(90))
    storage = tmp_path / "runs"
    errors = tmp_path / "stderr"
    args = ("fit", "--train-func", FUNC, "--workers", "2", "--data", str(data), "--config", "epochs=6")
    args += ("--config", "steps=30", "--storage", str(storage), "--name", "mine")
    proc = spawn_cli(*args, stderr=errors)
    first = read_until(proc, "epoch 2/6 ")
    assert "train function: tests.user_code.train_func:train_func; datasets: train=" in first, first
    assert re.search(r"^run: .*/mine: new run$", first, re.M), first
    assert re.search(r"^epoch 1/6  loss [\d.]+  rows 90$", first, re.M), first  # both shards: every row
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143, errors.read_text()
    # The newest checkpoint Ray Train registered goes missing (a scratch purge): the run goes on from the one before.
    kept, _ = ray_internals.read_checkpoint_snapshot(
        (storage / "mine" / ray_internals.CHECKPOINT_SNAPSHOT).read_bytes()
    )
    assert len(kept) >= 2, kept
    shutil.rmtree(storage / "mine" / kept[-1].dir_name)

    again = run_cli(*args, timeout=400)
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = re.search(r"^run: .*/mine: resuming from (epoch_\d{4})$", again.stdout, re.M)
    assert resumed and resumed.group(1) == kept[-2].dir_name, again.stdout
    assert f"passed over newer checkpoints that are missing or damaged (kept as they are): {kept[-1].dir_name}" in (
        again.stdout
    )
    done = int(resumed.group(1).removeprefix("epoch_"))
    lines = [ln for ln in again.stdout.splitlines() if ln.startswith("epoch ")]
    assert lines[0].startswith(f"epoch {done + 1}/6 ") and lines[-1].startswith("epoch 6/6 "), lines
    result = result_of(storage, "mine")
    assert result.kind == "train-func" and result.status == "completed" and result.epochs_completed == 6
    assert result.resumed_from == {"checkpoint": str(storage / "mine" / resumed.group(1))}
    assert result.reports_this_attempt == 6 - done and result.world_size == 2
    assert result.config["train_func"] == FUNC and result.config["config"] == {"epochs": 6, "steps": 30}
    assert all(m["rows"] == 90 for m in result.history)
    assert Path(result.last_checkpoint or "").name == "epoch_0006"


@pytest.mark.ray
def test_a_driver_whose_run_is_taken_over_writes_no_further_checkpoint_nor_result(tmp_path: Path) -> None:
    """Another driver takes the run over mid-run: the next checkpoint upload is refused on every worker (no
    retry can help), and the driver stops with one line, writing no result.json into the other's run."""
    storage = tmp_path / "runs"
    run_dir = storage / "taken"
    args = ("fit", "--train-func", "tests.user_code.takeover:train_func", "--workers", "2")
    out = run_cli(*args, "--config", f"run_dir={run_dir}", "--storage", str(storage), "--name", "taken", timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == [
        "raytrain: error: run 'taken' was taken over by pid 4242 on node9 (job 77, since 20261124T000000Z) while "
        "this driver trained: stopped without writing another checkpoint or result.json; the run is the other "
        "driver's now (check what holds it before starting it again)"
    ], out.stderr
    assert (run_dir / "epoch_0001").is_dir() and not (run_dir / "epoch_0002").exists()
    assert not (run_dir / "result.json").exists()
    assert json.loads((run_dir / "driver.lock").read_text())["pid"] == 4242  # the other's lock, left alone


@pytest.mark.ray
def test_a_stock_trainer_holds_its_run_against_a_second_driver(ray_local: object, tmp_path: Path) -> None:
    """A stock script's run is locked as raytrain's are: a second trainer of the same run fails at once
    while the first's driver lives, naming it."""
    import subprocess
    import sys

    import psutil
    import ray.train

    from raytrain.service import runlock

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / "held").mkdir()
        other = runlock.Holder.me()
        other = runlock.Holder(**{**other.__dict__, "pid": live.pid, "started": psutil.Process(live.pid).create_time()})
        (tmp_path / "held" / "driver.lock").write_bytes(other.to_bytes())
        start = time.monotonic()
        with pytest.raises(ray.train.TrainingFailedError) as failed:
            stock_trainer(tmp_path, "held", workers=1, cpus_per_worker=0.5, epochs=1).fit()
        assert time.monotonic() - start < 30
        assert f"run 'held' is in use by pid {live.pid} on " in str(failed.value)
        assert not (tmp_path / "held" / "result.json").exists()
    finally:
        live.kill()
        live.wait()
