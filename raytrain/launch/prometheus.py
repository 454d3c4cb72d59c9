"""The job's own Prometheus (``RAYTRAIN_PROMETHEUS=1``), run by the head's supervisor beside Ray.

It scrapes every node's Ray metrics exporter, raytrain's training metrics among them, through the
service-discovery file Ray's head keeps up to date as nodes join and leave, adds the Slurm job id to
every series (``slurm_job_id``; raytrain's series also carry the ``run``), listens on the head's
loopback only (reached through the dashboard's ssh tunnel; the dashboard queries it for its metrics
views) and keeps its configuration and data in the attempt's log directory, so the job's history can
be queried after the job: ``prometheus --config.file=<log>/prometheus.yml --storage.tsdb.path=<log>/prometheus``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from raytrain import processes
from raytrain.contracts import env, jobdir
from raytrain.errors import UserError

SCRAPE_S = 5  # Ray's exporters refresh every few seconds; a job's metrics are few
# Ray's head writes it under --temp-dir (a link to the session's copy): nodes join as it changes.
DISCOVERY_FILE = "prom_metrics_service_discovery.json"


def binary() -> str | None:
    """The Prometheus to run, None when the job runs none; a UserError when it is asked for but missing."""
    setting = env.PROMETHEUS.get()
    if not setting or setting.lower() in ("0", "off", "no"):
        return None
    found = shutil.which("prometheus" if setting.lower() in ("1", "on", "yes") else setting)
    if found is None:
        raise UserError(
            f"{env.PROMETHEUS.name}={setting}: no Prometheus binary found on the head node: install it "
            f"(Debian: apt-get install prometheus), give its path in {env.PROMETHEUS.name}, or unset it"
        )
    return found


def config(discovery: Path, job_id: str) -> str:
    """prometheus.yml: one scrape job over Ray's discovery file, every series labelled with the job id."""
    return f"""# The Prometheus of Slurm job {job_id}, written by raytrain. A site's Prometheus can take the scrape job
# below as it is, while the job runs on a node it reaches, with its own path to Ray's discovery file.
global:
  scrape_interval: {SCRAPE_S}s
  evaluation_interval: {SCRAPE_S}s
scrape_configs:
  - job_name: ray
    file_sd_configs:
      - files: ['{discovery}']
        refresh_interval: {SCRAPE_S}s
    relabel_configs:
      - target_label: slurm_job_id
        replacement: '{job_id}'
"""


def start(prometheus: str, *, temp_dir: Path, log_dir: Path, port: int, job_id: str) -> subprocess.Popen[bytes]:
    """Start it in a session of its own (so a stop of Ray's group leaves it to ``stop``); TEMP_DIR: Ray's, where
    its head keeps the discovery file."""
    conf = log_dir / jobdir.PROMETHEUS_CONFIG
    conf.write_text(config(temp_dir / DISCOVERY_FILE, job_id))
    data = log_dir / jobdir.PROMETHEUS_DATA
    data.mkdir(parents=True, exist_ok=True)
    with (log_dir / jobdir.PROMETHEUS_LOG).open("ab") as log:
        return subprocess.Popen(
            [
                prometheus,
                f"--config.file={conf}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=90d",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM: Prometheus writes its data out and exits; SIGKILL if it does not within ``grace_s``."""
    processes.terminate(processes.of([proc]), grace_s)
