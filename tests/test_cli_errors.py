"""Every bad input fails before any worker starts: exit 2, one line, no traceback, checkpoints untouched."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from raytrain import cli, errors
from raytrain.contracts import rundir
from raytrain.recipe import checkpoint_files
from raytrain.recipe.config import EMBEDDED_DATA, DataConfig, FitConfig
from raytrain.recipe.data import digits
from raytrain.service import runs
from raytrain.service.config import RunConfig
from tests.conftest import assert_user_error, image_table, read_until, run_cli, spawn_cli, write_parquet

NAME = "existing"


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    """A storage root holding a run with a checkpoint, made as `raytrain fit` makes them."""
    root = tmp_path / "runs"
    resolved = {"image_size": digits.IMAGE_SIZE, "num_classes": 10, "classes": tuple("0123456789")}
    cfg = FitConfig(data=DataConfig(uri=EMBEDDED_DATA, augment=digits.AUGMENT, **resolved))
    storage, run_cfg = runs.Storage.open(str(root)), RunConfig(storage=str(root), name=NAME)
    run = runs.open_run(storage, run_cfg, experiment=cfg.experiment(), intact=lambda fs, path: True)
    with runs.claimed(run, experiment=cfg.experiment(), settings=cfg.to_dict(), workers=1, echo=print):
        pass
    ckpt = Path(run.path) / checkpoint_files.name(1)
    ckpt.mkdir()
    checkpoint_files.write(ckpt, {"model": {"w": torch.ones(2)}, "epoch": 1}, {"epoch": 1})
    return root


@pytest.fixture
def untouched(storage: Path):  # type: ignore[no-untyped-def]
    before = snapshot(storage / NAME)
    yield
    assert snapshot(storage / NAME) == before


def fit(storage: Path, *args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return run_cli("fit", "--storage", str(storage), "--name", NAME, *args, env=env)


@pytest.mark.usefixtures("untouched")
class TestBadData:
    def test_missing_path(self, storage: Path, tmp_path: Path) -> None:
        assert_user_error(fit(storage, "--data", str(tmp_path / "nope")), "does not exist", "raytrain prepare")

    def test_empty_directory(self, storage: Path, tmp_path: Path) -> None:
        (tmp_path / "empty").mkdir()
        assert_user_error(fit(storage, "--data", str(tmp_path / "empty")), "holds no files")

    def test_directory_without_parquet(self, storage: Path, tmp_path: Path) -> None:
        (tmp_path / "csv").mkdir()
        (tmp_path / "csv/a.csv").write_text("image,label\n")
        assert_user_error(fit(storage, "--data", str(tmp_path / "csv")), "none ending in .parquet")

    def test_file_that_is_not_parquet(self, storage: Path, tmp_path: Path) -> None:
        (tmp_path / "fake.parquet").write_text("this is not parquet")
        assert_user_error(fit(storage, "--data", str(tmp_path / "fake.parquet")), "not a readable Parquet file")

    def test_missing_column(self, storage: Path, tmp_path: Path) -> None:
        table = image_table(4).rename_columns(["img", "label"])
        path = write_parquet(tmp_path / "d.parquet", table)
        assert_user_error(fit(storage, "--data", str(path)), "no 'image' column (it has: img, label)")

    def test_mistyped_column(self, storage: Path, tmp_path: Path) -> None:
        table = image_table(4)
        table = table.set_column(1, "label", pa.array([0.5, 1.0, 2.0, 3.0]))
        path = write_parquet(tmp_path / "d.parquet", table)
        assert_user_error(
            fit(storage, "--data", str(path)),
            "column 'label'",
            "is double, not integer class ids or string class names",
        )

    def test_named_column_missing(self, storage: Path, tmp_path: Path) -> None:
        path = write_parquet(tmp_path / "d.parquet", image_table(4))
        result = fit(storage, "--data", str(path), "--label-column", "species")
        assert_user_error(result, "no 'species' column (it has: image, label)", "--label-column")

    def test_splits_without_training_files(self, storage: Path, tmp_path: Path) -> None:
        write_parquet(tmp_path / "d/test-00000-of-00001.parquet", image_table(4))
        assert_user_error(fit(storage, "--data", str(tmp_path / "d")), "has test files but no training split")

    def test_files_with_different_schemas(self, storage: Path, tmp_path: Path) -> None:
        write_parquet(tmp_path / "d/a.parquet", image_table(4))
        t = image_table(4)
        write_parquet(tmp_path / "d/b.parquet", t.set_column(1, "label", t.column("label").cast(pa.int32())))
        assert_user_error(fit(storage, "--data", str(tmp_path / "d")), "is int64 in", "but int32 in")

    def test_no_rows(self, storage: Path, tmp_path: Path) -> None:
        path = write_parquet(tmp_path / "d.parquet", image_table(0))
        assert_user_error(fit(storage, "--data", str(path)), "has no rows")


@pytest.mark.usefixtures("untouched")
class TestBadSettings:
    def test_unknown_model(self, storage: Path) -> None:
        assert_user_error(fit(storage, "--model", "resnet19"), "unknown model 'resnet19'", "did you mean")

    def test_factory_that_does_not_import(self, storage: Path) -> None:
        assert_user_error(fit(storage, "--model", "no_such_pkg.models:net"), "cannot import 'no_such_pkg.models'")

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (("--freeze-backbone",), "--freeze-backbone and --backbone-lr-scale fine-tune pretrained weights"),
            (("--warmup-epochs", "10"), "--warmup-epochs 10 must be at least 0 and below --epochs 10"),
            (("--seed", "-1"), "--seed -1 is negative: give a seed of 0 or more"),
            (("--label-smoothing", "1.5"), "--label-smoothing 1.5 is out of range"),
            (("--clip-grad-norm", "0"), "--clip-grad-norm 0.0 must be positive"),
            (("--accumulate", "0"), "--accumulate 0 is below 1"),
            (("--ema-decay", "1.5"), "--ema-decay 1.5 is out of range"),
            (("--random-erase", "2"), "--random-erase 2.0 is out of range"),
            (("--weights", "DEFAULT", "--backbone-lr-scale", "2"), "--backbone-lr-scale 2.0 is out of range"),
            (("--optimizer", "lamb"), "'lamb' is not one of 'sgd', 'adamw'"),
            (("--augment", "mixup"), "'mixup' is not one of 'crop-flip', 'flip', 'none'"),
            (("--auto-augment", "mixup"), "'mixup' is not one of 'ta_wide', 'ra', 'augmix'"),
            (("--momentum", "1.5"), "--momentum 1.5 is out of range"),
            (("--strategy", "zero3"), "'zero3' is not one of 'ddp', 'fsdp'"),
            (("--strategy", "fsdp", "--ema-decay", "0.99"), "--ema-decay does not go with --strategy fsdp yet"),
            (("--name", "x" * 256), "--name is 256 bytes long, more than the 224 a run name may have"),
            (("--name", "é" * 115), "--name is 230 bytes long"),
            (("--workers", "3:2"), "--workers 3:2 is not a range: give MIN:MAX with 1 <= MIN <= MAX"),
            (("--workers", "2:"), "'2:' is not a worker count: give N or MIN:MAX"),
            (("--workers", "0:2"), "--workers 0:2 is not a range"),
            (("--tracker", "wandb"), "--tracker wandb: 'wandb' is not a tracker raytrain logs to: give mlflow"),
            # reached before Ray starts: seconds, even where MLflow alone would retry for minutes
            (("--tracker", "mlflow=http://127.0.0.1:1"), "--tracker mlflow: cannot log to http://127.0.0.1:1 ("),
        ],
    )
    def test_bad_option(self, storage: Path, args: tuple[str, ...], message: str) -> None:
        assert_user_error(fit(storage, *args), message)

    def test_weights_that_are_nothing(self, storage: Path) -> None:
        result = fit(storage, "--weights", "IMAGENET9K")
        assert_user_error(result, "--weights IMAGENET9K is neither a file nor a directory nor a torchvision weight")

    def test_torchvision_weights_not_in_the_cache(self, storage: Path, tmp_path: Path) -> None:
        result = fit(storage, "--weights", "IMAGENET1K_V1", env={"TORCH_HOME": str(tmp_path / "empty-cache")})
        assert_user_error(result, "ResNet18_Weights.IMAGENET1K_V1 is not in the torch cache", "downloads nothing")

    def test_weights_file_without_a_state_dict(self, storage: Path, tmp_path: Path) -> None:
        torch.save([1, 2, 3], tmp_path / "w.pt")
        assert_user_error(fit(storage, "--weights", str(tmp_path / "w.pt")), "holds no state dict")

    def test_weights_of_another_architecture(self, storage: Path, tmp_path: Path) -> None:
        torch.save({"layer.weight": torch.ones(3, 3)}, tmp_path / "w.pt")
        assert_user_error(fit(storage, "--weights", str(tmp_path / "w.pt")), "none of its tensors fit --model resnet18")

    def test_workers_below_one(self, storage: Path) -> None:
        assert_user_error(fit(storage, "--workers", "0"), "--workers 0 is below 1")

    def test_more_cpu_workers_than_cpus(self, storage: Path) -> None:
        cpus = len(os.sched_getaffinity(0))
        result = fit(storage, "--workers", "64", "--device", "cpu")
        assert_user_error(result, f"--workers 64 asks for 64 CPU workers but the cluster has {cpus} CPUs")

    def test_gpu_without_gpus(self, storage: Path) -> None:
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        assert_user_error(fit(storage, "--device", "gpu"), "--device gpu but none of the 1 node(s) has a GPU")

    def test_more_gpu_workers_than_gpus_fails_before_workers_start(self, storage: Path) -> None:
        # As inside `srun --gpus=2`: a local Ray starts with the 2 GPUs Slurm granted, then the plan refuses.
        env = {"SLURM_JOB_ID": "77", "SLURM_CPUS_ON_NODE": "4", "SLURM_GPUS_ON_NODE": "2"}
        result = fit(storage, "--device", "gpu", "--workers", "3", env=env)
        assert_user_error(result, "--workers 3 needs 3 GPUs but the cluster has 2", "use --workers 2 or fewer")
        assert "placement:" not in result.stdout and "loss" not in result.stdout

    def test_storage_not_writable(self, tmp_path: Path) -> None:
        blocker = tmp_path / "file"
        blocker.write_text("a file, not a directory")
        assert_user_error(run_cli("fit", "--storage", str(blocker / "runs")), "is not writable")

    def test_name_reused_with_other_settings(self, storage: Path) -> None:
        result = fit(storage, "--lr", "0.1", "--batch-size", "32")
        assert_user_error(result, "started with other settings", "batch_size: 64 -> 32", "lr: 0.02 -> 0.1", "--fresh")

    def test_run_in_use_by_a_live_driver(self, storage: Path) -> None:
        import socket

        (storage / NAME / rundir.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        try:
            assert_user_error(fit(storage, "--epochs", "1"), f"run '{NAME}' is in use by pid {os.getpid()}")
        finally:
            (storage / NAME / rundir.LOCK).unlink()


def test_usage_errors_are_one_line(tmp_path: Path) -> None:
    assert_user_error(run_cli("fit", "--wokers", "2"), "No such option '--wokers'", "--workers")
    assert_user_error(run_cli("fit", "--device", "tpu"), "--device")


def test_an_interrupt_wrapped_on_its_way_up_still_reads_as_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C that lands while a lazy import defines a class reaches the CLI as a RuntimeError caused by
    the KeyboardInterrupt (Python wraps what ``__set_name__`` raises): still exit 130 and one line. A bug
    is still a traceback."""

    class Field:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    def interrupted(**kwargs: object) -> None:
        type("Events", (), {"reports": Field()})

    def bug(**kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli.cli, "main", interrupted)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["fit"])
    assert stopped.value.code == 130 and capsys.readouterr().err == "raytrain: interrupted\n"
    monkeypatch.setattr(cli.cli, "main", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fit"])


def test_a_start_that_fails_before_training_leaves_no_run(tmp_path: Path) -> None:
    """A refused request must not pin the run name to its settings: the corrected command is not refused."""
    storage = tmp_path / "runs"
    too_many = run_cli("fit", "--workers", "64", "--device", "cpu", "--storage", str(storage), "--name", "w")
    assert_user_error(too_many, "--workers 64 asks for 64 CPU workers")
    assert not (storage / "w").exists()
    corrected = run_cli("fit", "--dry-run", "--model", "resnet34", "--storage", str(storage), "--name", "w")
    assert corrected.returncode == 0, corrected.stderr


def test_fit_slurm_forwards_the_tokens_the_user_typed() -> None:
    """`fit --slurm` hands the job's `fit` exactly what was typed (less --slurm and the sbatch options): a
    value printed back from its parsed form would differ (0.00012345678 as 0.000123457; 2:3 as a tuple)."""
    from raytrain import cli

    typed = ["--lr", "0.00012345678", "--workers", "2:3", "--slurm", "--name=x y", "--no-amp", "--epochs", "2"]
    ctx = cli.fit.make_context("fit", [*typed, "--", "--time=10:00", "--slurm"])
    assert cli._forwarded(ctx) == [t for t in typed if t != "--slurm"]
    assert ctx.params["workers"] == cli.WorkerCount(2, 3)
    # A value is forwarded as typed, whatever it looks like; the `--` that is not a value separates.
    ctx = cli.fit.make_context("fit", ["--slurm", "--name", "--", "--epochs", "3", "--", "-p", "gpu"])
    assert ctx.params["name"] == "--" and cli._forwarded(ctx) == ["--name", "--", "--epochs", "3"]
    assert cli._forwarded(cli.fit.make_context("fit", ["--name", "--slurm", "--slurm"])) == ["--name", "--slurm"]
    assert cli._forwarded(cli.fit.make_context("fit", ["--slurm", "--epochs", "3", "--"])) == ["--epochs", "3"]
    # A positional before `--` is neither fit's nor surely sbatch's: refused, naming it.
    for argv in (["--slurm", "--epochs", "3", "stray", "--", "-p", "x"], ["--slurm", "stray", "--name", "--", "--"]):
        with pytest.raises(errors.UserError, match=r"unexpected argument 'stray': fit takes options"):
            cli._forwarded(cli.fit.make_context("fit", argv))


class TestJobCommands:
    """`raytrain submit/status/stop JOB` with a job that cannot take them: one line, exit 2, nothing run.
    Slurm's scontrol is stubbed to report the job's state (from a file the test rewrites)."""

    @pytest.fixture
    def slurm(self, tmp_path: Path) -> dict[str, str]:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (tmp_path / "state").write_text("JobId=9 JobState=RUNNING")
        scontrol = bin_dir / "scontrol"
        scontrol.write_text(f"#!/bin/sh\ncat {tmp_path / 'state'}\n")
        scontrol.chmod(0o755)
        srun = bin_dir / "srun"
        srun.write_text(f"#!/bin/sh\necho ran > {tmp_path / 'srun-ran'}\n")
        srun.chmod(0o755)
        return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RAYTRAIN_STATE_DIR": str(tmp_path / "jobs")}

    @pytest.mark.parametrize("command", ["submit", "status", "stop"])
    def test_not_a_job_id(self, slurm: dict[str, str], command: str) -> None:
        extra = ("--", "fit") if command == "submit" else ()
        assert_user_error(run_cli(command, "../../etc", *extra, env=slurm), "'../../etc' is not a Slurm job id")

    def test_an_array_task(self, slurm: dict[str, str], tmp_path: Path) -> None:
        (tmp_path / "state").write_text("JobId=15 ArrayJobId=12 ArrayTaskId=3 JobState=RUNNING")
        out = run_cli("submit", "12_3", "--", "fit", env=slurm)
        assert_user_error(out, "12_3 is a task of a job array: give the task's own job id (12_3 is job 15)")

    @pytest.mark.parametrize("command", ["submit", "status", "stop"])
    def test_an_ended_job(self, slurm: dict[str, str], tmp_path: Path, command: str) -> None:
        (tmp_path / "state").write_text("JobId=9 JobState=COMPLETED")
        extra = ("--", "fit") if command == "submit" else ()
        assert_user_error(run_cli(command, "9", *extra, env=slurm), "job 9 has ended (COMPLETED): start a serving")

    def test_a_job_that_is_not_serving(self, slurm: dict[str, str], tmp_path: Path) -> None:
        from raytrain.contracts import jobdir

        job = tmp_path / "jobs" / "9"
        job.mkdir(parents=True)
        (job / jobdir.CLUSTER).write_text("{}")
        (job / jobdir.READY).touch()
        out = run_cli("submit", "9", "--", "fit", env=slurm)
        assert_user_error(out, "job 9 runs a driver of its own (it was not started with --serve)")
        assert not (tmp_path / "srun-ran").exists()

    def test_a_pending_job_with_no_wait(self, slurm: dict[str, str], tmp_path: Path) -> None:
        (tmp_path / "state").write_text("JobId=9 JobState=PENDING")
        out = run_cli("submit", "--no-wait", "9", "--", "fit", env=slurm)
        assert_user_error(out, "job 9 is pending (squeue -j 9 says why): submit again once it serves")

    def test_a_pending_job_is_waited_for_with_a_line_until_it_ends(self, slurm: dict[str, str], tmp_path: Path) -> None:
        (tmp_path / "state").write_text("JobId=9 JobState=PENDING")
        proc = spawn_cli("submit", "9", "--", "fit", stderr=tmp_path / "err", env=slurm)
        said = read_until(proc, "job 9 is")
        assert said == "job 9 is pending (squeue -j 9 says why); waiting for it (Ctrl-C stops waiting, not the job)\n"
        (tmp_path / "state").write_text("JobId=9 JobState=CANCELLED")
        assert proc.wait(timeout=30) == 2
        assert "raytrain: error: job 9 has ended (CANCELLED)" in (tmp_path / "err").read_text()
        assert not (tmp_path / "srun-ran").exists()
