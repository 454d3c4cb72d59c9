"""``raytrain status JOBID``, as run on the job's head: its nodes, what is in use, and its drivers."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

from raytrain.contracts import env
from raytrain.contracts.jobdir import DRIVERS, QUEUE, SLURM_NODE_LABEL, ClusterFile, EndRequest, Ticket
from raytrain.errors import UserError


def _num(x: float) -> str:
    return f"{x:g}"


def _drivers(job_dir: Path) -> dict[int, list[str]]:
    """pid -> command, as registered by the drivers started on this host."""
    found: dict[int, list[str]] = {}
    for path in (job_dir / DRIVERS).glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found[int(entry["pid"])] = [str(a) for a in entry["command"]]
    return found


def report(job_dir: Path) -> str:
    info = ClusterFile.read(job_dir)
    os.environ[env.RAY_AUTH_MODE.name] = "token"
    os.environ[env.RAY_AUTH_TOKEN_PATH.name] = info.token_path
    from raytrain.ray_internals import GcsGone, GcsReader

    try:
        gcs = GcsReader(info.gcs_address)
        try:
            nodes, free, drivers = gcs.alive(), gcs.available_per_node(), gcs.drivers()
        finally:
            gcs.close()
    except GcsGone as exc:
        raise UserError(
            f"{exc}: the job's head is gone, the job is ending, or its node is too busy to answer; try again, "
            f"and see {info.log_dir}"
        ) from None
    lines = [
        f"job {info.job_id}: Ray {info.gcs_address}, head {info.head_node}, dashboard 127.0.0.1:"
        f"{info.dashboard_port} on the head (raytrain dashboard {info.job_id})"
    ]
    rows = [("node", "ip", "CPUs in use", "GPUs in use")]
    totals = {"CPU": [0.0, 0.0], "GPU": [0.0, 0.0]}
    for n in sorted(nodes, key=lambda n: str((n.get("Labels") or {}).get(SLURM_NODE_LABEL))):
        total, avail = n.get("Resources", {}), free.get(n["NodeID"], n.get("Resources", {}))
        cells = []
        for k in ("CPU", "GPU"):
            used = float(total.get(k, 0)) - float(avail.get(k, 0))
            totals[k][0] += used
            totals[k][1] += float(total.get(k, 0))
            cells.append(f"{_num(used)}/{_num(float(total.get(k, 0)))}")
        rows.append(
            (
                str((n.get("Labels") or {}).get(SLURM_NODE_LABEL) or n["NodeManagerHostname"]),
                n["NodeManagerAddress"],
                *cells,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    cpu, gpu = totals["CPU"], totals["GPU"]
    lines.append(
        f"free: {_num(cpu[1] - cpu[0])} of {_num(cpu[1])} CPUs, {_num(gpu[1] - gpu[0])} of {_num(gpu[1])} GPUs"
    )
    registered = _drivers(job_dir)
    lines.append(f"drivers: {len(drivers)}")
    for d in sorted(drivers, key=lambda d: d.get("StartTime", 0)):
        started = dt.datetime.fromtimestamp(d.get("StartTime", 0) / 1000).strftime("%H:%M:%S")
        cmd = registered.get(int(d.get("DriverPid", 0))) or str(d.get("Entrypoint") or "?").split()
        lines.append(f"  pid {d.get('DriverPid')} on {d.get('DriverIPAddress')} since {started}: {' '.join(cmd)}")
    return "\n".join([*lines, *_runs(job_dir / QUEUE)])


def _runs(queue: Path) -> list[str]:
    """The runs admitted (with any request that they end) and those waiting, in the order they go."""
    tickets = Ticket.read_all(queue)
    admitted = [t for t in tickets if t.phase != "waiting"]
    waiting = sorted((t for t in tickets if t.phase == "waiting"), key=lambda t: t.order)
    lines = [f"runs: {len(admitted)}" if admitted else "runs: none"]
    for t in admitted:
        asked = EndRequest.read(queue / t.request_file)
        ending = f"; asked to end by {asked.by} ({asked.why})" if asked is not None else ""
        lines.append(f"  {t.describe()}, {t.phase} since {_clock(t.since)}{ending}")
    lines.append(
        f"waiting: {len(waiting)} run(s), admitted in this order as room frees up" if waiting else "waiting: none"
    )
    lines += [f"  {t.describe()}, waiting since {_clock(t.since)}" + (f": {t.why}" if t.why else "") for t in waiting]
    return lines


def _clock(at: float) -> str:
    return dt.datetime.fromtimestamp(at).strftime("%H:%M:%S")
