"""Any Ray Train code on raytrain: a user's function through `fit --train-func`, a stock trainer that
asks for more than the cluster holds, and the result.json a stock script gets (real local Ray)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from raytrain import ray_internals
from raytrain.contracts import env, jobdir, rundir
from raytrain.contracts.result import RunResult
from raytrain.contracts.rundir import FileSum, HistoryEntry, Manifest, Part
from tests.conftest import assert_user_error, image_table, read_rest, read_until, run_cli, spawn_cli, write_parquet

FUNC = "tests.user_code.train_func:train_func"
FSDP = "tests.user_code.fsdp_train:train_func"
WHOLE = "tests.user_code.whole_save:train_func"


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

    def test_datasets_with_no_whole_cpu_left_for_their_reads(self, tmp_path: Path) -> None:
        # Ray Data's tasks take a CPU each: workers that leave half of one would wait for them forever.
        data = write_parquet(tmp_path / "d.parquet", image_table(8))
        per = (len(os.sched_getaffinity(0)) - 0.5) / 2
        args = ("--data", str(data), "--workers", "2", "--cpus-per-worker", str(per), "--storage", str(tmp_path))
        out = run_cli("fit", "--train-func", FUNC, *args)
        assert_user_error(out, "(reading, decoding) take a whole CPU each, but the workers leave at most 0.5 CPUs free")

    def test_sbatch_arguments_without_slurm(self, tmp_path: Path) -> None:
        assert_user_error(run_cli("fit", "--storage", str(tmp_path), "--", "-p", "gpu"), "go after --slurm --")


def stock_trainer(
    storage: Path, name: str, workers: int, cpus_per_worker: float, epochs: int, die_once: Path | None = None
) -> Any:
    """A TorchTrainer as a stock script builds one (tests/user_code/stock_train.py), no raytrain in it;
    ``die_once``: rank 1 kills itself in its second epoch, once Ray Train has registered the first
    epoch's checkpoint, once (Ray Train may restart once)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from tests.user_code.stock_train import train_func

    return TorchTrainer(
        train_func,
        train_loop_config={
            "lr": 0.1,
            "epochs": epochs,
            "die_once": str(die_once) if die_once else None,
            "index": str(storage / name / ray_internals.CHECKPOINT_SNAPSHOT),
        },
        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": cpus_per_worker}),
        run_config=ray.train.RunConfig(
            storage_path=str(storage), name=name, failure_config=ray.train.FailureConfig(max_failures=1)
        ),
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
def test_a_stock_trainer_gets_a_result_json_with_its_restart_and_checkpoints_checked_file_by_file(
    ray_local: object, tmp_path: Path
) -> None:
    """Rank 1 of a stock script dies in its second epoch: the restart goes on from the first epoch's
    checkpoint, and result.json lists the restart as it does for raytrain's own runs. Each checkpoint's
    manifest has its file's size and CRC32, as rank 0 recorded them."""
    fitted = stock_trainer(
        tmp_path, "stock", workers=2, cpus_per_worker=0.5, epochs=2, die_once=tmp_path / "died"
    ).fit()
    result = result_of(tmp_path, "stock")
    assert result.kind == "script" and result.status == "completed" and result.world_size == 2
    assert [m["epoch"] for m in result.history] == [1, 2] and result.epochs_completed == 2
    assert result.final["loss"] == pytest.approx(fitted.metrics["loss"])
    assert [p.rank for p in result.placement] == [0, 1] and {p.device for p in result.placement} == {"cpu"}
    assert result.last_checkpoint == fitted.checkpoint.path
    kept, _ = ray_internals.read_checkpoint_snapshot(
        (tmp_path / "stock" / ray_internals.CHECKPOINT_SNAPSHOT).read_bytes()
    )
    first = tmp_path / "stock" / kept[0].dir_name
    assert kept[0].metrics["epoch"] == 1
    [restart] = result.restarts
    assert 1 in restart.ranks and "died" in restart.error and restart.lost_s is not None, restart
    assert restart.resumed_from == str(first) and restart.restart_s is not None and restart.restart_s > 0, restart
    for checkpoint in kept:
        model = (tmp_path / "stock" / checkpoint.dir_name / "model.pt").read_bytes()
        manifest = Manifest.from_bytes((tmp_path / "stock" / checkpoint.dir_name / rundir.MANIFEST).read_bytes())
        assert manifest.files == {"model.pt": FileSum(size=len(model), crc32=zlib.crc32(model))}


@pytest.mark.ray
def test_a_stock_script_resumed_passes_over_a_damaged_or_missing_newest_checkpoint(
    ray_local: object, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A stock script resubmitted resumes from its newest checkpoint that verifies, as raytrain's runs do.
    4 KB of the newest checkpoint's file overwritten with zeros, its size unchanged (torch.load would take
    it without a word): passed over, named, kept on disk. Then the newest checkpoint's directory deleted
    (Ray Train alone stops with CheckpointManagerInitializationError): the index is repaired and the run
    goes on from the one before."""
    import shutil

    run = tmp_path / "s"

    def registered() -> list[Path]:
        kept, _ = ray_internals.read_checkpoint_snapshot((run / ray_internals.CHECKPOINT_SNAPSHOT).read_bytes())
        return [run / k.dir_name for k in kept]

    def fit(epochs: int) -> tuple[RunResult, str]:
        capfd.readouterr()
        stock_trainer(tmp_path, "s", workers=1, cpus_per_worker=0.5, epochs=epochs).fit()
        return result_of(tmp_path, "s"), capfd.readouterr().out

    fit(2)
    first, second = registered()
    model = second / "model.pt"
    blob = model.read_bytes()
    with model.open("r+b") as f:
        f.seek(len(blob) // 4)
        f.write(bytes(min(4096, len(blob) // 2)))
    assert model.stat().st_size == len(blob)
    result, out = fit(3)
    assert (
        f"raytrain: passed over newer checkpoints that are missing or damaged (kept as they are): {second.name} "
        "(model.pt is not as it was written: CRC32 " in out
    ), out
    assert [m["epoch"] for m in result.history] == [2, 3], result.history  # on from epoch 1's checkpoint
    assert model.exists() and registered()[0] == first and second not in registered()

    newest = registered()[-1]
    shutil.rmtree(newest)
    result, out = fit(4)
    assert (
        f"passed over newer checkpoints that are missing or damaged (kept as they are): {newest.name} (it is gone)"
        in out
    )
    assert [m["epoch"] for m in result.history] == [3, 4], result.history
    assert result.status == "completed" and newest not in registered()


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
    assert not set(managers()) - set(before)  # none started (an earlier test's dead ones may be gone from the table)


@pytest.mark.slow
def test_a_sharded_train_func_recovers_resumes_at_another_world_size_and_passes_over_a_damaged_shard(
    tmp_path: Path,
) -> None:
    """The README's FSDP2 function (tests/user_code/fsdp_train.py) on 3 workers (a third of a CPU each), data
    handed over as Ray Data shards. Rank 1 kills itself right after its first checkpoint, before Ray Train's controller
    (polling every 3 s here) collects the report (ray-project/ray#41700): the restart goes on from that
    checkpoint all the same. Stopped (SIGTERM) once its second epoch is reported; 4 KB in the middle of one rank's
    shard of the newest checkpoint are overwritten with zeros (the size unchanged: DCP would load it
    without a word). The same command at 2 workers passes over that checkpoint, naming the shard, and goes
    on from the one before, resharded from 3 ranks to 2, with the loss where it was (within 1e-5, the
    float32 sums' reordering); told the job ends soon, it saves at once and that last save is in storage,
    whole, before it stops as preempted. (A last save slowed past the deadline is abandoned with a line:
    tests/test_service_slurm.py.)"""
    data = write_parquet(tmp_path / "d.parquet", image_table(90))
    storage = tmp_path / "runs"
    errors = tmp_path / "stderr"
    args = ("fit", "--train-func", FSDP, "--data", str(data), "--config", "epochs=5", "--config", "steps=10")
    args += ("--config", f"die_once={tmp_path / 'died'}", "--storage", str(storage), "--name", "mine")
    slow_polls = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "3"}
    proc = spawn_cli(*args, "--workers", "3", "--cpus-per-worker", "0.33", stderr=errors, env=slow_polls)
    first = read_until(proc, "epoch 2/5 ")
    assert f"train function: {FSDP}; datasets: train=" in first, first
    assert re.search(r"^run: .*/mine: new run$", first, re.M), first
    assert re.search(
        r"^workers failed \(rank [\d, ]*\b1\b[\d, ]*: .*\); Ray Train restarts the workers", first, re.M
    ), first
    assert re.search(r"^epoch 1/5  loss [\d.]+.*  rows 90", first, re.M), first  # every shard: every row
    proc.send_signal(signal.SIGTERM)
    read_rest(proc, 60)
    assert proc.returncode == 143, errors.read_text()
    # Epoch 1 was trained once: the restart started from its checkpoint, which Ray Train never collected.
    history = [HistoryEntry.from_line(ln).metrics for ln in (storage / "mine" / rundir.HISTORY).open()]
    assert [m["epoch"] for m in history] == [1, 2], history
    assert abs(history[1]["resumed_at"] - history[0]["loss"]) < 1e-5, history
    assert Manifest.from_bytes((storage / "mine" / "epoch_0001" / rundir.MANIFEST).read_bytes()).recovered

    # Each rank summed what it uploaded; a registered checkpoint's manifest took the ranks' sums.
    run = storage / "mine"
    registered = Manifest.from_bytes((run / "epoch_0002" / rundir.MANIFEST).read_bytes())
    assert set(registered.files) == {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp", ".metadata", "extra.json"}
    for rank in range(3):
        part = Part.from_bytes((run / "epoch_0002" / rundir.part_name(rank)).read_bytes())
        assert f"__{rank}_0.distcp" in part.files and all(registered.files[n] == s for n, s in part.files.items())
    # The newest checkpoint every rank finished (a later epoch's too, when the stop came after its uploads
    # and before Ray Train collected them) has 4 KB of rank 1's shard zeroed.
    whole = sorted(d for d in run.glob("epoch_*") if all((d / rundir.part_name(r)).exists() for r in range(3)))
    newest = whole[-1]
    done = int(newest.name.removeprefix("epoch_")) - 1
    before = f"epoch_{done:04d}"
    # The loss the checkpoint before it was reported with, from rank 0's record in it: the history has it
    # only if Ray Train collected that report before the stop (epochs may run on until the workers end).
    saved = Part.from_bytes((run / before / rundir.part_name(0)).read_bytes()).metrics["loss"]
    shard = newest / "__1_0.distcp"
    blob = shard.read_bytes()
    assert Part.from_bytes((newest / rundir.part_name(1)).read_bytes()).files[shard.name] == FileSum(
        size=len(blob), crc32=zlib.crc32(blob)
    )
    with shard.open("r+b") as f:
        f.seek(len(blob) // 2)
        f.write(bytes(4096))

    # Told the job ends soon as the run resumes (the batch script's flag, its deadline 300 s away), the
    # run saves at its first step, every rank's part written and copied before it stops.
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    again_err = tmp_path / "again-stderr"
    ending = {env.JOB_DIR.name: str(job)}
    proc = spawn_cli(*args, "--workers", "2", stderr=again_err, env=ending)
    head = read_until(proc, "run: ")  # resuming from ...
    (job / jobdir.PREEMPT_FLAG).write_text(f"{time.time() + 300:.3f}\n")  # before the workers start
    rest = read_rest(proc, 300)
    out = head + rest
    assert proc.returncode == 75, out + again_err.read_text()
    assert re.search(rf"^run: .*/mine: resuming from {before}$", out, re.M), out
    assert "run: passed over newer checkpoints that are missing or damaged (kept as they are): " in out, out
    assert f"{newest.name} (__1_0.distcp is not as it was written: CRC32 " in out, out
    assert "run: it trained with 3 workers and goes on with 2" in out
    assert "last save abandoned" not in out, out
    last = re.search(r"^preempted: checkpoint (\S+) saved", out, re.M)
    assert last and last[1] not in (before, newest.name), out
    saved_last = Manifest.from_bytes((run / last[1] / rundir.MANIFEST).read_bytes())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.json"} <= set(saved_last.files), saved_last
    for rank in range(2):
        assert (run / last[1] / rundir.part_name(rank)).exists()
    lines = [ln for ln in out.splitlines() if ln.startswith("epoch ")]
    assert [ln.split()[1] for ln in lines] == [f"{done + 1}/5"] and "stopped_at_step 1" in lines[0], lines
    result = result_of(storage, "mine")
    assert result.kind == "train-func" and result.status == "preempted" and result.last_checkpoint == str(run / last[1])
    assert result.resumed_from == {"checkpoint": str(run / before)}
    assert result.reports_this_attempt == 1 and result.world_size == 2
    # Resharded from 3 ranks to 2, the model is the one saved: its loss over the whole data is the loss
    # the checkpoint was reported with, and training goes on from there.
    assert abs(result.history[0]["resumed_at"] - saved) < 1e-5, (result.history, saved)
    assert result.history[-1]["loss"] < saved  # one step on


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


def test_a_whole_save_is_written_in_the_background_from_a_copy(tmp_path: Path) -> None:
    """``raytrain.save_whole`` returns before its write (tests/user_code/whole_save.py holds each write until
    the training thread has gone on, and fails the run otherwise), and the write is of the state as it was
    when saved, though the live weights changed meanwhile."""
    import torch

    out = run_cli("fit", "--train-func", WHOLE, "--workers", "2", "--config", "epochs=2", "--storage", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    name = re.search(r"^run: .*/([^/\s]+): new run$", out.stdout, re.M)
    assert name, out.stdout
    result = result_of(tmp_path, name[1])
    assert [m["epoch"] for m in result.history] == [1, 2], result.history
    for epoch, metrics in zip((1, 2), result.history, strict=True):
        state = torch.load(tmp_path / name[1] / f"epoch_{epoch:04d}" / "state.pt", weights_only=True)
        assert sum(float(t.sum()) for t in state["model"].values()) == pytest.approx(metrics["weight_sum"])
