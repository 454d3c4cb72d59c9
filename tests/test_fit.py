"""`raytrain fit` end to end on a real local Ray: the embedded default, resume, and name reuse."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pyarrow.fs as pafs
import pytest
import torch
from PIL import Image

from raytrain import ray_internals
from raytrain.contracts import env, rundir
from raytrain.contracts.rundir import HistoryEntry
from raytrain.recipe import checkpoint_files
from tests.conftest import (
    SMALL_MODEL,
    assert_user_error,
    damage_a_page,
    image_table,
    read_rest,
    read_until,
    run_cli,
    spawn_cli,
)

pytestmark = pytest.mark.slow


def result_of(storage: Path, name: str) -> dict:  # type: ignore[type-arg]
    return json.loads((storage / name / "result.json").read_text())


def test_default_run_reaches_95_percent_within_5_minutes(tmp_path: Path) -> None:
    """`make run`'s job. It takes about 2 min on this 2-core machine (124 s measured), but the same code took
    187 s and 201 s in runs of the suite while the host was slower (every unchanged test about 1.5x), so the
    bound is 5 min: it catches a start or an epoch made much slower, not a busy host."""
    storage = tmp_path / "runs"
    out = run_cli("fit", "--workers", "2", "--storage", str(storage), timeout=420)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.seconds < 300, f"took {out.seconds:.0f} s"
    epoch_lines = [ln for ln in out.stdout.splitlines() if re.match(r"^epoch +\d+/10 ", ln)]
    assert len(epoch_lines) == 10, out.stdout
    result = result_of(storage, "digits-resnet18")
    assert result["status"] == "completed" and result["epochs_completed"] == 10
    assert result["final"]["val_acc"] >= 0.95, result["final"]
    assert result["world_size"] == 2 and [p["rank"] for p in result["placement"]] == [0, 1]
    assert Path(result["last_checkpoint"]).name == "epoch_0010"
    assert (Path(result["last_checkpoint"]) / checkpoint_files.STATE).is_file()
    assert len(list((storage / "digits-resnet18").glob("epoch_*"))) == 3  # --keep 3


def test_resume_continues_at_next_epoch_with_optimizer_state_and_passes_over_what_is_damaged(
    tmp_path: Path, mlflow_server: str, ray_to_join: dict[str, str]
) -> None:
    """A run resumed at its next epoch with its optimizer, both attempts logged to one MLflow run on a real
    tracking server; then its newest checkpoint damaged and Ray Train's index truncated: it resumes from the
    newest intact checkpoint and says which; with none intact it stops, touching nothing; --fresh moves it
    aside. Every command joins one running Ray, as commands in a Slurm job do."""
    from mlflow.tracking import MlflowClient

    storage = tmp_path / "runs"
    run = storage / "r"
    common = ("--workers", "2", "--storage", str(storage), "--name", "r", "--image-size", "8", "--model", SMALL_MODEL)
    tracked = ("--tracker", f"mlflow={mlflow_server}")
    experiment = {env.MLFLOW_EXPERIMENT.name: f"resume-{tmp_path.name}", **ray_to_join}

    first = run_cli("fit", *common, *tracked, "--epochs", "2", env=experiment)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "new run" in first.stdout
    logged = re.search(r"^tracking: MLflow run (\w+) in experiment 'resume-", first.stdout, re.M)
    assert logged, first.stdout

    # A progress line for each of rank 0's posts (about one a second), as a batch log gets one every 30 s.
    second = run_cli("fit", *common, *tracked, "--epochs", "3", env={env.PROGRESS_EVERY.name: "0", **experiment})
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from epoch_0002 (epoch 2 of 3 done)" in second.stdout
    assert f"tracking: MLflow run {logged[1]} at {mlflow_server} goes on" in second.stdout
    lines = second.stdout.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("epoch ")] == ["3/3"]
    progress = [ln for ln in lines if ln.startswith("progress: ")]
    steps = [re.match(r"^progress: epoch 3/3  step (\d+)/(\d+)", ln) for ln in progress]
    assert steps and all(steps) and steps[0][1] == "1", second.stdout  # type: ignore[index]
    assert [int(m[1]) for m in steps] == sorted(int(m[1]) for m in steps)  # type: ignore[index]
    result = result_of(storage, "r")
    assert result["epochs_completed"] == 3 and result["epochs_this_attempt"] == 1
    resumed = result["resumed_from"]
    assert resumed["epoch"] == 2 and Path(resumed["checkpoint"]).name == "epoch_0002"
    saved = torch.load(run / "epoch_0002" / checkpoint_files.STATE, weights_only=True)
    assert resumed["optimizer_digest"] == checkpoint_files.digest(saved["optimizer"])
    assert resumed["global_step"] == saved["global_step"] > 0
    # One MLflow run for both attempts: the first's parameters, every epoch's metrics once at its epoch, the
    # best checkpoint's files as artifacts.
    client = MlflowClient(mlflow_server)
    tracked_run = client.get_run(logged[1])
    assert tracked_run.info.status == "FINISHED" and tracked_run.data.tags["raytrain.status"] == "completed"
    assert tracked_run.data.params["optim.epochs"] == "2" and tracked_run.data.params["scale.workers"] == "2"
    history = sorted((m.step, m.value) for m in client.get_metric_history(logged[1], "val_acc"))
    kept = [HistoryEntry.from_line(line).metrics for line in (run / rundir.HISTORY).read_text().splitlines()]
    assert history == [(m["epoch"], pytest.approx(m["val_acc"])) for m in kept] and len(history) == 3, history
    best = Path(result["best_checkpoint"])
    assert tracked_run.data.tags["raytrain.best_checkpoint"] == str(best)
    artifacts = {Path(a.path).name: a.file_size for a in client.list_artifacts(logged[1], "best_checkpoint")}
    assert artifacts[checkpoint_files.STATE] == (best / checkpoint_files.STATE).stat().st_size, artifacts

    again = run_cli("fit", *common, "--epochs", "3", env=ray_to_join)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    _check_curves(run, result)

    clash = run_cli("fit", *common, "--epochs", "3", "--model", "resnet34", env=ray_to_join)
    assert_user_error(clash, f"model: '{SMALL_MODEL}' -> 'resnet34'")

    # The newest checkpoint damaged, and Ray Train's index truncated: the index is rebuilt from the
    # checkpoints' manifests, and the run resumes from the newest that verifies, naming the one it passed over.
    _flip_a_byte(run / "epoch_0003" / checkpoint_files.STATE)
    snapshot = run / ray_internals.CHECKPOINT_SNAPSHOT
    snapshot.write_bytes(snapshot.read_bytes()[:40])
    fourth = run_cli("fit", *common, "--epochs", "4", env=ray_to_join)
    assert fourth.returncode == 0, fourth.stdout + fourth.stderr
    assert "resuming from epoch_0002 (epoch 2 of 4 done)" in fourth.stdout
    assert "passed over newer checkpoints that are missing or damaged (kept as they are): epoch_0003" in fourth.stdout
    result = result_of(storage, "r")
    assert Path(result["resumed_from"]["checkpoint"]).name == "epoch_0002" and result["epochs_completed"] == 4
    assert result["epochs_this_attempt"] == 2
    assert len(list(run.glob(f"{ray_internals.CHECKPOINT_SNAPSHOT}.damaged-*"))) == 1  # kept aside

    for state in run.glob("epoch_*/" + checkpoint_files.STATE):
        _flip_a_byte(state)
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    none_left = run_cli("fit", *common, "--epochs", "5", env=ray_to_join)
    assert_user_error(
        none_left,
        "no checkpoint of run",
        *(f"{e}: state.pt is not as it was written: CRC32 " for e in ("epoch_0004", "epoch_0003", "epoch_0002")),
    )
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before

    fresh = run_cli("fit", *common, "--epochs", "1", "--model", "shufflenet_v2_x1_0", "--fresh", env=ray_to_join)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert result_of(storage, "r")["config"]["model"]["name"] == "shufflenet_v2_x1_0"
    (old,) = storage.glob("r.replaced-*")
    assert (old / "epoch_0004" / checkpoint_files.STATE).is_file()  # moved aside, not deleted


def _flip_a_byte(path: Path) -> None:
    """One byte of PATH changed, its size kept: torch.load may still read it; its CRC32 tells."""
    blob = path.read_bytes()
    path.write_bytes(blob[:-9] + bytes([blob[-9] ^ 0xFF]) + blob[-8:])


def _check_curves(run: Path, result: dict) -> None:  # type: ignore[type-arg]
    """The run's curves over both attempts, read back the way a user looks at them: TensorBoard's own event
    reader, the plot's pixels, and ``raytrain report``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / rundir.TENSORBOARD))
    events.Reload()
    val_acc = [(s.step, s.value) for s in events.Scalars("val_acc")]
    assert [step for step, _ in val_acc] == [1, 2, 3]  # epochs 1-2 by the first attempt, 3 by the resume
    assert val_acc[-1][1] == pytest.approx(result["final"]["val_acc"])
    assert len(list((run / rundir.TENSORBOARD).glob("events.out.tfevents.*"))) == 2  # one file per attempt

    pixels = np.asarray(Image.open(run / rundir.CURVES).convert("RGB")).astype(int)
    assert pixels.shape[1] > 3 * pixels.shape[0]  # three panels side by side: loss, accuracy, throughput
    for colour in ((31, 119, 180), (255, 127, 14)):  # train_ and val_ series
        assert (np.abs(pixels - colour).sum(axis=2) < 30).sum() > 50, f"no {colour} line in {rundir.CURVES}"

    report = run_cli("report", str(run))
    assert report.returncode == 0, report.stderr
    rows = {ln.split()[0]: ln.split() for ln in report.stdout.splitlines() if re.match(r"^\s*\d+ ", ln)}
    assert sorted(rows) == ["1", "2", "3"]
    header = next(ln.split() for ln in report.stdout.splitlines() if ln.split()[:1] == ["epoch"])
    assert float(rows["3"][header.index("val_acc")]) == pytest.approx(result["final"]["val_acc"], abs=1e-4)
    assert "reports: 3 over 2 attempt(s)" in report.stdout
    assert f"tensorboard --logdir {run / rundir.TENSORBOARD}" in report.stdout


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # ended meanwhile, or a zombie
        return []


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# Each signal, at another moment: SIGTERM once the run has a checkpoint, which stays; Ctrl-C while Ray Train
# starts its controller and workers, as soon as the cluster is up.
STOPPED = {
    signal.SIGTERM: (
        "epoch ",
        143,
        "raytrain: stopped by SIGTERM; the local Ray cluster is shut down. Rerun the same "
        "command to go on from the last checkpoint",
    ),
    signal.SIGINT: ("dashboard: ", 130, "raytrain: interrupted"),
}


@pytest.mark.parametrize("sig", list(STOPPED), ids=lambda s: s.name)
def test_a_signal_stops_the_local_cluster_and_keeps_the_checkpoint(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM (kill, timeout, a scheduler) or Ctrl-C to a local run: every Ray process it started is
    stopped, its private directory with the token is removed, and it says so; SIGTERM, sent once the run
    has a checkpoint, keeps it."""
    storage = tmp_path / "runs"
    errors = tmp_path / "stderr"
    moment, status, message = STOPPED[sig]
    args = ("--workers", "1", "--image-size", "8", "--model", SMALL_MODEL, "--epochs", "30")
    proc = spawn_cli("fit", *args, "--storage", str(storage), "--name", "t", stderr=errors)
    seen = read_until(proc, moment)  # all of it, should the run fail before that moment
    private = re.search(r"\(token: (/\S+)/token\)", seen)
    assert private and Path(private.group(1)).is_dir(), seen
    ray_processes = psutil.Process(proc.pid).children(recursive=True)
    assert len(ray_processes) >= 5, ray_processes  # GCS, raylet, agents, workers

    proc.send_signal(sig)
    rest = read_rest(proc, 60)
    err = errors.read_text()
    assert proc.returncode == status, seen + rest + err
    assert err.strip().splitlines() == [message], err
    assert not Path(private.group(1)).exists()
    assert [p.pid for p in ray_processes if _running(p)] == []  # the command returned after all of them
    if sig == signal.SIGTERM:
        assert (storage / "t/epoch_0001" / checkpoint_files.STATE).is_file()


def test_a_killed_worker_restarts_from_the_newest_checkpoint(tmp_path: Path, ray_to_join: dict[str, str]) -> None:
    """SIGKILL one training worker mid-run (an OOM kill, a crash): Ray Train restarts the workers from the
    newest checkpoint and the run completes; result.json records the restart and what it cost."""
    storage = tmp_path / "runs"
    args = (
        *("--workers", "2", "--image-size", "8", "--model", SMALL_MODEL),
        *("--epochs", "6", "--storage", str(storage), "--name", "k"),
    )
    proc = spawn_cli("fit", *args, stderr=tmp_path / "stderr", env=ray_to_join)
    seen = read_until(proc, "epoch 2/6 ")
    joined = psutil.Process().children(recursive=True)  # the Ray this test process started, and its workers
    workers = [p for p in joined if "RayTrainWorker" in " ".join(_cmdline(p))]
    assert len(workers) == 2, seen
    workers[0].kill()
    rest = read_rest(proc, 400)
    out = seen + rest
    assert proc.returncode == 0, out + (tmp_path / "stderr").read_text()
    failed = r"^workers failed \(rank [\d, ]+: The actor is dead because its worker process has died\); "
    failure = re.search(
        failed + r"Ray Train restarts the workers from the newest checkpoint \(failure 1 of at most 3\)$", out, re.M
    )
    assert failure, out
    # Epochs run in about 2 s here, so the kill may land in epoch 3 or 4: the newest checkpoint is the
    # last epoch reported before the failure.
    newest = max(int(n) for n in re.findall(r"^epoch (\d+)/6 ", out[: failure.start()], re.M))
    assert 2 <= newest < 6, out
    result = result_of(storage, "k")
    assert result["status"] == "completed" and result["epochs_completed"] == 6
    (restart,) = result["restarts"]
    assert Path(restart["resumed_from"]).name == f"epoch_{newest:04d}", (restart, out)
    assert 0 <= restart["lost_s"] < 60 and 0 < restart["restart_s"] < 120, restart
    assert [h["epoch"] for h in result["history"]] == [1, 2, 3, 4, 5, 6]  # the epoch in progress was not reported


def test_a_diverged_loss_stops_the_run_before_its_checkpoint_rotates_good_ones_out(
    tmp_path: Path, ray_to_join: dict[str, str]
) -> None:
    storage = tmp_path / "runs"
    model = "tests.user_code.models:diverges_in_epoch_2"
    args = (
        "--workers",
        "1",
        "--epochs",
        "4",
        "--keep",
        "1",
        "--model",
        model,
        "--storage",
        str(storage),
        "--name",
        "nan",
    )
    out = run_cli("fit", *args, env={"PYTHONPATH": str(Path(__file__).parent.parent), **ray_to_join})
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(
        r"^workers failed \(rank 0: the training loss is nan in epoch 2: training diverged, .*\); "
        r"not retried: no retry can fix this$",
        out.stdout,
        re.M,
    ), out.stdout
    assert "training failed after 1 epochs: the training loss is nan in epoch 2" in out.stdout
    assert sorted(p.name for p in (storage / "nan").glob("epoch_*")) == ["epoch_0001"]  # kept, intact
    assert checkpoint_files.verify(pafs.LocalFileSystem(), str(storage / "nan/epoch_0001"))
    result = result_of(storage, "nan")
    assert result["status"] == "failed" and result["restarts"][0]["restart_s"] is None


def test_a_damaged_data_page_stops_the_run_at_once_saying_which_file(
    tmp_path: Path, ray_to_join: dict[str, str]
) -> None:
    """A Parquet file whose footer is fine (the check passes) and one of whose image pages is not: the first
    rank to read it stops the run, with no retry of the workers (none could read it), in one line."""
    import pyarrow.parquet as pq

    data = tmp_path / "d.parquet"
    pq.write_table(image_table(200), data, row_group_size=50)
    damage_a_page(data, column=0)
    args = ("--workers", "2", "--data", str(data), "--epochs", "2", "--storage", str(tmp_path / "runs"))
    out = run_cli("fit", *args, "--name", "damaged", env=ray_to_join)
    assert out.returncode == 1, out.stdout + out.stderr
    damaged = rf"data file {data} cannot be read \(Couldn't deserialize thrift[^)]*\): a page of it is damaged"
    once = rf"^workers failed \(rank [\d, ]+: data file {data} cannot be read .*\); not retried: no retry can fix this$"
    assert re.search(once, out.stdout, re.M), out.stdout
    assert re.search(rf"^training failed after 0 epochs: {damaged}", out.stdout, re.M), out.stdout
    assert len(re.findall(r"^workers failed", out.stdout, re.M)) == 1 and "Traceback" not in out.stderr


def test_unusable_rows_and_a_one_sample_batch_are_skipped_counted_and_reported(
    tmp_path: Path, ray_to_join: dict[str, str]
) -> None:
    """One undecodable image, one missing image and one null label among 130 rows, and shards that end
    in a one-sample batch under BatchNorm: training goes on, each epoch line and result.json count them."""
    import pyarrow as pa

    from tests.conftest import image_table, write_parquet

    table = image_table(130, size=32)
    blobs = table.column("image").to_pylist()
    blobs[5], blobs[9] = b"\xff\xd8\xff\xe0 truncated jpeg", None
    labels = table.column("label").to_pylist()
    labels[13] = None
    data = tmp_path / "data"
    write_parquet(data / "train/a.parquet", pa.table({"image": pa.array(blobs, pa.binary()), "label": labels}))
    write_parquet(data / "val/a.parquet", image_table(20, size=32, seed=1))
    storage = tmp_path / "runs"
    # 2 workers x 65 rows each, batch 32: 32 + 32 + 1 per rank, and resnet18 at 32 px ends in 1x1 BatchNorm.
    args = ("--data", str(data), "--workers", "2", "--epochs", "2", "--batch-size", "32", "--name", "bad")
    out = run_cli("fit", *args, "--storage", str(storage), env=ray_to_join)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    described = "130 rows (20 in its val split), 3 classes, images at 32px (their own size); 1 rows have no label"
    assert described in out.stdout
    lines = [ln for ln in out.stdout.splitlines() if re.match(r"^epoch [12]/2 ", ln)]
    assert len(lines) == 2, out.stdout
    # A bad row that the shuffle puts into a one-sample batch counts as dropped, not unusable: every row is
    # counted once, either way.
    for line, epoch in zip(lines, result_of(storage, "bad")["history"], strict=True):
        unusable, dropped = epoch["unusable_samples"], epoch["dropped_samples"]
        assert dropped == 2 and unusable in (2, 3) and epoch["train_samples"] + unusable + dropped == 130, epoch
        skipped = f"(skipped: {unusable} unusable (undecodable image or no label), 2 in a one-sample batch)"
        assert line.endswith(skipped), line


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 150 MB tmpfs: room for the run and one resnet18 checkpoint (~90 MB), not for a second."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=150m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_during_a_checkpoint_stops_at_once_and_keeps_the_older_one(
    small_disk: Path, ray_to_join: dict[str, str]
) -> None:
    storage = small_disk / "runs"
    args = ("--workers", "1", "--image-size", "8", "--storage", str(storage), "--name", "full")
    out = run_cli("fit", *args, "--epochs", "3", env=ray_to_join)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    # Whichever process meets the full disk first (a worker uploading epoch 2, or Ray Train's controller
    # writing its checkpoint index), the run stops at once with what to do.
    failures = [ln for ln in out.stdout.splitlines() if ln.startswith("workers failed")]
    assert all(ln.endswith("not retried: no retry can fix this") for ln in failures) and len(failures) <= 1, out.stdout
    assert "training failed after 1 epochs: a disk is full or over quota ([Errno 28]" in out.stdout
    # Epoch 2's upload is cut short; epoch 3 may have begun its own before the failure reached the driver.
    cut = re.search(r"^run: (epoch_0002(, epoch_0003)?): cut short, never registered as a checkpoint", out.stdout, re.M)
    assert cut, out.stdout
    assert checkpoint_files.verify(pafs.LocalFileSystem(), str(storage / "full/epoch_0001"))

    # Space freed (the partial uploads deleted, the quota raised): the same command goes on from epoch 1.
    for name in cut[1].split(", "):
        shutil.rmtree(storage / "full" / name)
    subprocess.run(["mount", "-o", "remount,size=400m", str(small_disk)], check=True)
    again = run_cli("fit", *args, "--epochs", "2", env=ray_to_join)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming from epoch_0001 (epoch 1 of 2 done)" in again.stdout
    assert [h["epoch"] for h in result_of(storage, "full")["history"]] == [2]


def test_a_preempted_epoch_resumes_with_exactly_the_rows_it_had_not_trained(
    tmp_path: Path, ray_to_join: dict[str, str]
) -> None:
    """The job-ends-soon flag mid-epoch: the checkpoint records which rows that epoch trained (on every
    rank), and the resumed epoch trains the others, once (tests/test_shards.py checks the rows exactly),
    here streamed where the first attempt held the data in memory."""
    import numpy as np

    from raytrain.contracts import env, jobdir

    storage, job = tmp_path / "runs", tmp_path / "job"
    job.mkdir(mode=0o700)
    args = ("--workers", "2", "--epochs", "3", "--image-size", "96", "--storage", str(storage), "--name", "p")
    # The flag goes down once epoch 2 is under way (its first progress line): every rank then checks it within
    # about 5 s of training (raytrain.service.preemption), well before the epoch's end: at 96 px an epoch takes
    # three times that on a fast 2-core host (at 48 px, 4.6 s: the flag was first seen after the epoch).
    progress = {env.JOB_DIR.name: str(job), env.PROGRESS_EVERY.name: "0.5", **ray_to_join}
    proc = spawn_cli("fit", *args, stderr=tmp_path / "stderr", env=progress)
    seen = read_until(proc, "progress: epoch 2/3 ")
    (job / jobdir.PREEMPT_FLAG).write_text("test\n")  # what the batch script does on Slurm's signal
    rest = read_rest(proc, 300)
    assert proc.returncode == 75, seen + rest + (tmp_path / "stderr").read_text()
    stopped = re.search(r"^preempted: checkpoint (epoch_0001_step_(\d+)) saved", rest, re.M)
    assert stopped, rest
    trained = np.load(storage / "p" / stopped.group(1) / checkpoint_files.TRAINED)
    first = result_of(storage, "p")["history"]
    assert len(trained) == len(np.unique(trained)) == first[1]["train_samples"] > 0
    full = first[0]["train_samples"] + first[0]["dropped_samples"]

    # Resumed streamed (--stream may change between attempts): Ray Data's rest of the epoch, then epoch 3's
    # pass, started while epoch 2 validated (shards.ShardFeed).
    again = run_cli("fit", *args, "--stream", env=ray_to_join)
    assert again.returncode == 0, again.stdout + again.stderr
    note = f"resuming from {stopped.group(1)} (epoch 1 of 3 done; epoch 2 goes on with the rows it has not trained"
    assert f"{note} ({len(trained)} were))" in again.stdout, again.stdout
    resumed = result_of(storage, "p")["history"][0]
    assert resumed["epoch"] == 2
    assert abs(len(trained) + resumed["train_samples"] + resumed["dropped_samples"] - full) <= 1  # equal shards
