"""A sweep as its directory tells it (``raytrain.contracts.sweepdir``): the trials ranked by the sweep's
metric, the curves of the best few in one PNG, and the best trial's run, for ``raytrain report``,
``evaluate``, ``predict`` and ``export``. Each trial's best value is read from its run's history, so a
trial the scheduler stopped (whose run wrote no ``result.json``) ranks by what it reported."""

from __future__ import annotations

import io
import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from raytrain.contracts import sweepdir
from raytrain.contracts.sweepdir import SweepMeta, TrialRecord
from raytrain.errors import UserError
from raytrain.service import curves, runs

TOP = 5  # trials drawn in sweep.png


def is_sweep(fs: pafs.FileSystem, path: str) -> bool:
    return bool(fs.get_file_info(posixpath.join(path, sweepdir.SWEEP_META)).type == pafs.FileType.File)


def records(fs: pafs.FileSystem, root: str) -> list[TrialRecord]:
    """The trial table as the sweep's driver last wrote it (none before its first trial started)."""
    try:
        return [TrialRecord.from_json(r) for r in runs.read_json(fs, posixpath.join(root, sweepdir.TRIALS))]
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class Trial:
    """One trial and the best value of the sweep's metric it reported (None: it reported none), and when."""

    record: TrialRecord
    best: float | None
    at: float | None  # the epoch (or report) of its best value
    reports: int
    curve: list[tuple[float, float]]  # the metric by epoch (or report), as its history holds it
    axis: str  # "epoch", or "report" when its reports carry none


@dataclass(frozen=True)
class Ranked:
    meta: SweepMeta
    root: str
    trials: list[Trial]  # best first; those that reported nothing last

    def run_path(self, trial: Trial) -> str:
        return posixpath.join(self.root, sweepdir.RUNS, trial.record.name)


def ranked(fs: pafs.FileSystem, root: str) -> Ranked:
    meta = SweepMeta.from_json(runs.read_json(fs, posixpath.join(root, sweepdir.SWEEP_META)))
    sign = 1.0 if meta.mode == "max" else -1.0
    found = []
    for record in records(fs, root):
        axis, points = curves.by_x(curves.read_history(fs, posixpath.join(root, sweepdir.RUNS, record.name)))
        curve = [(x, float(m[meta.metric])) for x, m in points if number(m.get(meta.metric))]
        best = max(curve, key=lambda xy: sign * xy[1]) if curve else None
        at, value = best if best else (None, None)
        found.append(Trial(record, value, at, len(points), curve, axis))
    found.sort(key=lambda t: (t.best is None, -sign * (t.best or 0.0), t.record.name))
    return Ranked(meta, root, found)


def number(v: Any) -> bool:
    """A value a trial can rank by: a diverged run's NaN or inf is none."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def params_text(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def table(sweep: Ranked) -> list[str]:
    """The trials, best first: rank, name, status, the best value of the metric and when, parameters."""
    meta = sweep.meta
    rows = [["rank", "trial", "status", f"best {meta.metric}", "at", "parameters"]]
    for i, t in enumerate(sweep.trials, start=1):
        best = "-" if t.best is None else f"{t.best:.4g}"
        at = "-" if t.at is None else f"{t.at:g}"
        rows.append([str(i), t.record.name, t.record.status, best, at, params_text(t.record.params)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    done = sum(t.record.status in ("completed", "stopped") for t in sweep.trials)
    lines.insert(0, f"sweep {meta.name}: {len(sweep.trials)} trial(s), {done} ended; {meta.mode} {meta.metric}")
    return lines


def best(fs: pafs.FileSystem, root: str) -> str:
    """The run directory of the sweep's best trial, for ``evaluate``, ``predict`` and ``export``."""
    sweep = ranked(fs, root)
    top = next((t for t in sweep.trials if t.best is not None), None)
    if top is None:
        raise UserError(f"sweep {root} has no trial that reported {sweep.meta.metric} yet: let it run, then try again")
    return sweep.run_path(top)


def plot(sweep: Ranked, top: int = TOP) -> bytes | None:
    """The sweep's metric by epoch (or report) for its best TOP trials, one line each, in one panel."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    metric = sweep.meta.metric
    drawn = [t for t in sweep.trials if t.best is not None][:top]
    if not drawn:
        return None
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for t in drawn:
        label = f"{t.record.name} ({params_text(t.record.params)})"
        ax.plot(*zip(*t.curve, strict=True), marker="o", markersize=3, label=label)
    ax.set_xlabel(drawn[0].axis)
    ax.set_ylabel(metric)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.suptitle(f"sweep {sweep.meta.name}: best {len(drawn)} by {metric} ({sweep.meta.mode})", fontsize="medium")
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    return out.getvalue()


def report(fs: pafs.FileSystem, root: str) -> list[str]:
    """``raytrain report SWEEP``: the ranking, and sweep.png with the best trials' curves."""
    sweep = ranked(fs, root)
    lines = table(sweep)
    png = plot(sweep)
    if png is not None:
        path = posixpath.join(root, sweepdir.CURVES)
        with fs.open_output_stream(path) as out:
            out.write(png)
        lines.append(f"plot: {path}")
    if sweep.trials and sweep.trials[0].best is not None:
        lines.append(f"best: {sweep.run_path(sweep.trials[0])} (raytrain evaluate/predict/export {root} use it)")
    return lines
