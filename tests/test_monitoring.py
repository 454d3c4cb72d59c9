"""Monitoring a run: progress within an epoch (worker meter, driver line), the curves a run leaves
(history.jsonl, TensorBoard events, curves.png) and ``raytrain report``."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from PIL import Image

from raytrain.contracts import env, rundir
from raytrain.contracts import metrics as keys
from raytrain.service import curves, live, telemetry
from raytrain.service.events import Progress
from raytrain.service.telemetry import StepMeter
from tests.conftest import assert_user_error, run_cli


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rank0_posts_its_pace_about_once_a_second_and_each_epoch_starts_afresh() -> None:
    clock, posted = Clock(), []
    meter = StepMeter(posted.append, rank=0, tags={}, every_s=1.0, clock=clock, world=2)
    meter(1, 32, 10, 1, 2, 0.0)  # an epoch's first step: no pace yet, but the driver hears of it
    for step in range(2, 11):  # 0.25 s a step: a post every 4 steps
        clock.now += 0.25
        meter(step, 32, 10, 1, 2, 0.05)
    assert [p.step for p in posted] == [1, 5, 9]
    assert posted[0].samples_per_s is None
    # 32 samples each 0.25 s on rank 0, and as many on the other rank: the run's pace
    assert posted[1].samples_per_s == pytest.approx(2 * 128.0) and posted[1].step_time_s == pytest.approx(0.25)
    assert posted[2].eta_s() == (pytest.approx(0.25), pytest.approx(0.25 + 10 * 0.25))
    clock.now += 30  # validation between the epochs is not a step
    meter(1, 32, 10, 2, 2, 0.0)
    assert posted[-1].step == 1 and posted[-1].epoch == 2 and posted[-1].samples_per_s is None
    other: list[Progress] = []
    StepMeter(other.append, rank=1, tags={}, clock=clock)(1, 32, 10, 1, 2, 0.0)
    assert other == []  # only rank 0 tells the driver


def _progress(step: int, at: float = 0.0) -> Progress:
    return Progress(step=step, steps=100, epoch=3, epochs=10, samples_per_s=1234.5, step_time_s=0.5, at=at)


def test_the_progress_line_is_live_on_a_terminal_and_steady_in_a_log() -> None:
    assert live.line(_progress(40)) == (
        "progress: epoch  3/10  step 40/100  1,234 samples/s  ETA epoch 0:30, run 6:20"
    )  # 60 steps x 0.5 s; then 7 epochs x 100 steps x 0.5 s

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term, echoed = Terminal(), []
    shown = live.LiveProgress(echoed.append, stream=term, every_s=30)
    shown.show(_progress(1))
    shown.show(_progress(2))
    shown.echo("epoch 3/10  loss ...")
    assert term.getvalue() == f"\r\033[K{live.line(_progress(1))}\r\033[K{live.line(_progress(2))}\r\033[K"
    assert echoed == ["epoch 3/10  loss ..."]  # printed after the live line was wiped

    clock, logged = Clock(), []
    log = live.LiveProgress(logged.append, stream=io.StringIO(), every_s=30, clock=clock)
    for step in range(1, 120):
        clock.now += 1
        log.show(_progress(step))
    assert [ln.split()[4] for ln in logged] == ["1/100", "31/100", "61/100", "91/100"]


def _entry(epoch: int, acc: float, attempt: float) -> rundir.HistoryEntry:
    return rundir.HistoryEntry(
        at=attempt + epoch,
        attempt=attempt,
        metrics={"epoch": epoch, "train_loss": 1 / epoch, "val_acc": acc, "samples_per_s": 300.0, "note": "x"},
    )


def test_a_resumed_run_draws_each_epoch_once_its_newest_report_and_the_report_says_so(tmp_path: Path) -> None:
    # Attempt 1 trained epochs 1-3 and failed; attempt 2 went back to epoch 2's checkpoint and trained 3-4.
    entries = [
        _entry(1, 0.5, 0.0),
        _entry(2, 0.6, 0.0),
        _entry(3, 0.1, 0.0),
        _entry(3, 0.7, 50.0),
        _entry(4, 0.8, 50.0),
    ]
    axis, points = curves.by_x(entries)
    assert axis == "epoch" and [x for x, _ in points] == [1, 2, 3, 4]
    assert [m["val_acc"] for _, m in points] == [0.5, 0.6, 0.7, 0.8]
    assert curves.columns(points) == ["train_loss", "val_acc", "samples_per_s"]

    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.HISTORY).write_text("".join(e.to_line() for e in entries) + '{"torn')
    lines = curves.report(pafs.LocalFileSystem(), str(run))
    assert "last attempt: still running, or ended before writing result.json" in lines
    rows = [ln.split() for ln in lines if ln.strip() and ln.split()[0].isdigit()]
    assert [(r[0], r[2]) for r in rows] == [("1", "0.5"), ("2", "0.6"), ("3", "0.7"), ("4", "0.8")]
    assert "reports: 5 over 2 attempt(s)" in lines


def test_reports_without_an_epoch_are_drawn_by_report_and_any_number_gets_a_panel() -> None:
    entries = [rundir.HistoryEntry(at=i, attempt=0, metrics={"reward": float(i), "tag": "a"}) for i in range(3)]
    axis, points = curves.by_x(entries)
    assert axis == "report" and [x for x, _ in points] == [1, 2, 3]
    png = curves.plot(entries, "script")
    assert png is not None and Image.open(io.BytesIO(png)).size[0] > 300


def test_curves_files_follow_every_report_and_a_failure_is_said_once(tmp_path: Path) -> None:
    """history.jsonl and the event file follow every report; curves.png the first at once, then at most every
    PLOT_EVERY_S, and the last when the attempt ends."""
    fs = pafs.LocalFileSystem()
    c = curves.Curves(fs, str(tmp_path / "r"), attempt=1.0, title="r")
    png = tmp_path / "r" / rundir.CURVES
    for epoch in (1, 2):
        assert c.add({"epoch": epoch, "epochs": 2, "train_loss": 1.0 / epoch, "val_acc": 0.4 * epoch}, at=epoch) is None
        if epoch == 1:
            first = png.read_bytes()
    assert png.read_bytes() == first  # the second report came within PLOT_EVERY_S: not drawn yet
    assert len(curves.read_history(fs, str(tmp_path / "r"))) == 2
    c.close()
    assert png.read_bytes() != first
    saved = curves.read_history(fs, str(tmp_path / "r"))
    assert [e.metrics for e in saved] == [
        {"epoch": 1, "train_loss": 1.0, "val_acc": 0.4},
        {"epoch": 2, "train_loss": 0.5, "val_acc": 0.8},
    ]
    assert len(list((tmp_path / "r" / rundir.TENSORBOARD).glob("events.out.tfevents.*"))) == 1
    pixels = np.asarray(Image.open(tmp_path / "r" / rundir.CURVES).convert("RGB"))
    assert (np.abs(pixels.astype(int) - (31, 119, 180)).sum(axis=2) < 30).sum() > 50  # the first series' blue

    # An attempt that ends abruptly (a job's driver killed): report redraws a picture behind the history.
    c = curves.Curves(fs, str(tmp_path / "r"), attempt=2.0, title="r")
    c.add({"epoch": 3, "epochs": 3, "train_loss": 0.2, "val_acc": 0.9}, at=3.0)  # drawn: the attempt's first
    c.add({"epoch": 4, "epochs": 4, "train_loss": 0.1, "val_acc": 0.95}, at=4.0)  # not yet, and never closed
    behind = png.read_bytes()
    drawn_at = png.stat().st_mtime - 60
    os.utime(png, (drawn_at, drawn_at))  # the clock's resolution aside, the picture is older than the history
    curves.report(fs, str(tmp_path / "r"))
    assert png.read_bytes() != behind
    redrawn = png.read_bytes()
    curves.report(fs, str(tmp_path / "r"))  # up to date: left as it is
    assert png.read_bytes() == redrawn and png.stat().st_mtime > drawn_at

    (tmp_path / "f").write_text("a file where the run directory would be")
    broken = curves.Curves(fs, str(tmp_path / "f"), attempt=1.0, title="f")
    note = broken.add({"epoch": 1, "val_acc": 0.5}, at=1.0)
    assert note is not None and note.startswith("run: curves not written from now on (")
    assert broken.add({"epoch": 2, "val_acc": 0.6}, at=2.0) is None  # said once; training goes on


def test_report_metric_names_are_what_prometheus_accepts() -> None:
    assert keys.report_metric("val_acc") == "raytrain_report_val_acc"
    assert keys.report_metric("loss/train-ema") == "raytrain_report_loss_train_ema"
    assert keys.numbers({"epoch": 2, "epochs": 9, "ok": True, "lr": 0.1, "name": "x"}) == {"epoch": 2.0, "lr": 0.1}


def test_report_on_a_missing_run_is_a_one_line_error(tmp_path: Path) -> None:
    assert_user_error(run_cli("report", "nope", "--storage", str(tmp_path)), "no run at", "--storage")


def test_report_of_a_run_from_before_history_files_uses_its_result(tmp_path: Path) -> None:
    from raytrain.contracts.result import RunResult

    run = tmp_path / "old"
    run.mkdir()
    result = RunResult(
        name="old",
        kind="fit",
        status="completed",
        error=None,
        world_size=2,
        backend="gloo",
        placement=[],
        final={},
        history=[{"epoch": 1, "val_acc": 0.9}],
        reports_this_attempt=1,
        last_checkpoint=None,
        wall_time_s=12.0,
    )
    (run / rundir.RESULT).write_text(json.dumps(result.to_json()))
    out = run_cli("report", str(run))
    assert out.returncode == 0, out.stderr
    assert "last attempt: completed, 2 workers, 12 s" in out.stdout
    assert any(ln.split() == ["1", "0.9"] for ln in out.stdout.splitlines()), out.stdout


def test_a_bad_progress_interval_is_a_one_line_error_before_anything_starts(tmp_path: Path) -> None:
    out = run_cli("fit", "--storage", str(tmp_path / "runs"), env={env.PROGRESS_EVERY.name: "often"})
    assert_user_error(out, f"{env.PROGRESS_EVERY.name}='often' is not a number: give a number of at least 0")
    assert not (tmp_path / "runs" / "digits-resnet18").exists()


def test_progress_outside_ray_train_does_nothing() -> None:
    telemetry.progress(1, samples=32, steps=10)  # a function run by hand, not by Ray Train
    assert telemetry._meter is None
