"""A run's curves, for any Ray Train code: ``history.jsonl``, TensorBoard event files and ``curves.png``.

After each report the driver (or, for a script's own trainer, the service callback in Ray Train's
controller) appends rank 0's plain metrics to ``RUN/history.jsonl`` and adds them to TensorBoard event
files in ``RUN/tensorboard/``. It redraws ``RUN/curves.png`` after the first report, then at most every
``PLOT_EVERY_S`` and once more when the attempt ends: a drawing takes matplotlib about a second of CPU,
which the driver would take from rank 0's node at every epoch of a fast run. An attempt that ends
abruptly (its driver killed) can leave the picture behind the history: ``raytrain report RUN``, which
prints the table, redraws it then. The curves are loss, accuracy and throughput by epoch (by report when
the reports carry no epoch), over every attempt of the run; when an attempt went back to an earlier
checkpoint, the newest report of each epoch is the one drawn. Writing them never fails training: a
failure is said once and training goes on.
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
import time
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow.fs as pafs

from raytrain.contracts import metrics as keys
from raytrain.contracts import rundir
from raytrain.contracts.rundir import HistoryEntry

log = logging.getLogger(__name__)

Scalar = keys.Scalar
# What each panel of curves.png (and the report table) shows, by metric name.
PANELS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("loss", lambda k: "loss" in k),
    ("accuracy", lambda k: k.endswith("acc") or "accuracy" in k),
    ("throughput", lambda k: "per_s" in k or "throughput" in k),
)
MAX_COLUMNS = 9
PLOT_EVERY_S = 30.0


def read_history(fs: pafs.FileSystem, run_path: str) -> list[HistoryEntry]:
    """Every entry of the run's history file (none if it has none); a torn last line is left out."""
    path = posixpath.join(run_path, rundir.HISTORY)
    try:
        with fs.open_input_stream(path) as f:
            text = f.read().decode()
    except (FileNotFoundError, OSError):
        return []
    entries = []
    for line in text.splitlines():
        try:
            entries.append(HistoryEntry.from_line(line))
        except (ValueError, KeyError):
            continue
    return entries


def by_x(entries: Iterable[HistoryEntry]) -> tuple[str, list[tuple[float, dict[str, Scalar]]]]:
    """The x axis ("epoch", or "report" when no report has one) and the newest metrics at each x."""
    entries = list(entries)
    has_epoch = any(keys.EPOCH in e.metrics for e in entries)
    latest: dict[float, dict[str, Scalar]] = {}
    for i, e in enumerate(entries, start=1):
        x = e.metrics.get(keys.EPOCH) if has_epoch else i
        if isinstance(x, int | float):
            latest[float(x)] = e.metrics
    return ("epoch" if has_epoch else "report"), sorted(latest.items())


def columns(points: list[tuple[float, dict[str, Scalar]]]) -> list[str]:
    """The metrics worth a column or a panel: loss, accuracy and throughput ones, in the order first seen."""
    seen: dict[str, None] = {}
    for _, m in points:
        seen.update(dict.fromkeys(k for k in keys.numbers(m) if k != keys.EPOCH))
    chosen = [k for _, match in PANELS for k in seen if match(k)]
    timing = [k for k in seen if "time" in k and k not in chosen]
    return (chosen + timing)[:MAX_COLUMNS] if chosen else list(seen)[:MAX_COLUMNS]


def table(entries: list[HistoryEntry]) -> list[str]:
    """The history as text: a row per epoch (or report), a column per metric that matters."""
    axis, points = by_x(entries)
    cols = columns(points)
    rows = [[axis, *cols]]
    for x, m in points:
        rows.append([f"{x:g}", *(_cell(m.get(c)) for c in cols)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _cell(v: Scalar | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"
    return str(v)


def plot(entries: list[HistoryEntry], title: str) -> bytes | None:
    """curves.png: a panel each for loss, accuracy and throughput (or the first metrics reported)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    axis, points = by_x(entries)
    cols = columns(points)
    panels = [(name, [c for c in cols if match(c)]) for name, match in PANELS]
    panels = [(name, ks) for name, ks in panels if ks] or [(c, [c]) for c in cols[:4]]
    if not points or not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 3.4), layout="constrained")
    for ax, (name, names) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for k in names:
            xy = [(x, float(m[k])) for x, m in points if isinstance(m.get(k), int | float)]
            if xy:
                ax.plot(*zip(*xy, strict=True), marker="o", markersize=3, label=k)
        ax.set_title(name)
        ax.set_xlabel(axis)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    return out.getvalue()


def report(fs: pafs.FileSystem, run_path: str) -> list[str]:
    """``raytrain report RUN``: how the run ended, its history table, and where its curves are."""
    from pyarrow.fs import FileType

    from raytrain.contracts.result import RunResult
    from raytrain.errors import UserError

    if fs.get_file_info(run_path).type != FileType.Directory:
        raise UserError(f"no run at {run_path}: give a run directory, or a run name with --storage")
    entries = read_history(fs, run_path)
    lines = [f"run: {run_path}"]
    try:
        with fs.open_input_stream(posixpath.join(run_path, rundir.RESULT)) as f:
            result = RunResult.from_json(json.loads(f.read()))
        best = f"; best checkpoint {result.best_checkpoint}" if result.best_checkpoint else ""
        lines.append(f"last attempt: {result.status}, {result.world_size} workers, {result.wall_time_s:.0f} s{best}")
        if not entries:  # a run from before history.jsonl: its last attempt's reports
            entries = [HistoryEntry(at=0.0, attempt=0.0, metrics=keys.plain(m)) for m in result.history]
    except FileNotFoundError:
        lines.append("last attempt: still running, or ended before writing result.json")
    if not entries:
        return [*lines, "no reports yet"]
    _redraw_if_behind(fs, run_path, entries, title=posixpath.basename(run_path.rstrip("/")))
    attempts = len({e.attempt for e in entries})
    lines += ["", *table(entries), ""]
    lines.append(f"reports: {len(entries)} over {attempts} attempt(s)")
    for name, what in ((rundir.CURVES, "plot"), (rundir.TENSORBOARD, "tensorboard"), (rundir.HISTORY, "history")):
        path = posixpath.join(run_path, name)
        if fs.get_file_info(path).type != FileType.NotFound:
            view = f"  (view: tensorboard --logdir {path})" if name == rundir.TENSORBOARD else ""
            lines.append(f"{what}: {path}{view}")
    return lines


def _write_plot(fs: pafs.FileSystem, path: str, entries: list[HistoryEntry], title: str) -> None:
    if (png := plot(entries, title)) is not None:
        with fs.open_output_stream(path) as out:
            out.write(png)


def _redraw_if_behind(fs: pafs.FileSystem, run_path: str, entries: list[HistoryEntry], title: str) -> None:
    """Draw curves.png again when history.jsonl is newer: an attempt that ended abruptly (a job's driver
    killed by SIGTERM, a trial its sweep stopped) can leave it up to PLOT_EVERY_S of reports behind. Best
    effort: a run you may read but not write keeps the picture it has."""
    png, history = posixpath.join(run_path, rundir.CURVES), posixpath.join(run_path, rundir.HISTORY)
    try:
        drawn, written = fs.get_file_info([png, history])
        if drawn.mtime is not None and written.mtime is not None and drawn.mtime >= written.mtime:
            return
        _write_plot(fs, png, entries, title)
    except Exception:  # the table is what `report` is for
        log.debug("curves: could not redraw %s", png, exc_info=True)


class Curves:
    """Keeps a run's history file, TensorBoard events and curves.png up to date, report by report."""

    def __init__(self, fs: pafs.FileSystem, run_path: str, attempt: float, title: str) -> None:
        self.fs = fs
        self.run_path = run_path
        self.attempt = attempt
        self.title = title
        self.entries = read_history(fs, run_path)
        self.failed: str | None = None  # why the curves stopped being written
        self._writer: Any = None
        self._drawn_at: float | None = None  # time.monotonic() of the last curves.png
        self._undrawn = False  # reports since then

    def add(self, metrics: dict[str, Any], at: float) -> str | None:
        """Record one report; a line to say if writing failed (once), else None."""
        if self.failed:
            return None
        entry = HistoryEntry(at=at, attempt=self.attempt, metrics=keys.plain(metrics))
        self.entries.append(entry)
        self._undrawn = True

        def write() -> None:
            if len(self.entries) == 1:
                self.fs.create_dir(self.run_path, recursive=True)
            with self.fs.open_output_stream(self.file(rundir.HISTORY)) as out:
                out.write("".join(e.to_line() for e in self.entries).encode())
            self._tensorboard(entry, len(self.entries))
            if self._drawn_at is None or time.monotonic() - self._drawn_at >= PLOT_EVERY_S:
                self._draw()

        return self._safely(write)

    def _draw(self) -> None:
        _write_plot(self.fs, self.file(rundir.CURVES), self.entries, self.title)
        self._drawn_at, self._undrawn = time.monotonic(), False

    def _safely(self, write: Callable[[], None]) -> str | None:
        try:
            write()
        except Exception as exc:  # curves are for looking at: training goes on without them
            log.debug("curves", exc_info=True)
            self.failed = f"{type(exc).__name__}: {exc}"
            return f"run: curves not written from now on ({self.failed}); training goes on"
        return None

    def file(self, name: str) -> str:
        return posixpath.join(self.run_path, name)

    def _tensorboard(self, entry: HistoryEntry, index: int) -> None:
        if not isinstance(self.fs, pafs.LocalFileSystem):
            return  # TensorBoard's writer writes local files only: history.jsonl and curves.png still do
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=self.file(rundir.TENSORBOARD), flush_secs=10)
        epoch = entry.metrics.get(keys.EPOCH)
        step = int(epoch) if isinstance(epoch, int | float) else index
        for k, v in keys.numbers(entry.metrics).items():
            if k != keys.EPOCH:
                self._writer.add_scalar(k, v, global_step=step, walltime=entry.at)
        self._writer.flush()

    def close(self, draw: bool = True) -> str | None:
        """The attempt has ended: curves.png drawn with its last reports (unless DRAW is false: the run is
        no longer this driver's to write), the event file closed. A line to say if writing failed."""
        note = self._safely(self._draw) if draw and self._undrawn and not self.failed else None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return note
