"""Monitoring a job on the 3-node Slurm testbed the way a user does, while it trains: the job's own
Prometheus scraping raytrain's training metrics beside Ray's, the Ray dashboard in a real browser
(headless Chromium) through the ssh tunnel the job log prints, the progress lines, and what the job
leaves in its log directory. Screenshots go to $RAYTRAIN_SCREENSHOTS (the README's come from here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from raytrain import waits
from raytrain.contracts import env, jobdir
from raytrain.contracts import metrics as keys
from raytrain.service.dashboard import LOCAL_PORT
from tests.conftest import SMALL_MODEL
from tests.lockdown import in_head_netns
from tests.slurm_util import Testbed, assert_cleaned_up, exit_code, wait_text
from tests.tunnel import jump_host, ssh_servers, tunnel

pytestmark = pytest.mark.slurm
NODES = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=4")
# A run long enough to be watched: it is stopped with the cluster once everything was seen.
FIT = ("fit", "--workers", "3", "--cpus-per-worker", "3", "--device", "cpu", "--image-size", "8", "--epochs", "200")
FIT += ("--model", SMALL_MODEL)
RUN = "watched"
CLASS_FILTER = "//label[text()='Class']/following-sibling::div//input"  # the actors table's filter
T = TypeVar("T")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def prometheus_query(port: int, query: str) -> list[dict]:  # type: ignore[type-arg]
    """An instant query to the job's Prometheus, from inside the head's network namespace (loopback)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(query)}"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    answer = json.loads(in_head_netns(code))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]  # type: ignore[no-any-return]


def wait_series(port: int, query: str, want: int, timeout: float) -> list[dict]:  # type: ignore[type-arg]
    """The query's series once there are WANT of them (Prometheus scrapes every few seconds)."""
    found: list[dict] = []  # type: ignore[type-arg]

    def enough() -> bool:
        nonlocal found
        found = prometheus_query(port, query)
        return len(found) >= want

    if waits.until(enough, timeout_s=timeout, every_s=1):
        return found
    raise AssertionError(f"{query}: {len(found)} series after {timeout} s, wanted {want}: {found}")


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("RAYTRAIN_SCREENSHOTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture
def browser() -> Iterator[object]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("needs Debian's chromium and chromium-driver (make system-deps installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_a_job_is_watched_through_its_prometheus_and_its_dashboard_while_it_trains(
    testbed: Testbed, browser: object, screenshots: Path, tmp_path: Path
) -> None:
    job = testbed.submit(*NODES, fit=("--serve",), env={env.PROMETHEUS.name: "1"})
    log = testbed.wait_output(job, r"cluster: all 3 nodes joined", timeout=120)
    out = tmp_path / "driver.out"
    driver = testbed.spawn_raytrain(
        "submit", job, "--", *FIT, "--storage", "runs", "--name", RUN, out=out, env={env.PROGRESS_EVERY.name: "2"}
    )
    try:
        wait_text(out, r"^epoch +2/200  loss", timeout=240)
        cluster = json.loads((jobdir.job_dir(job) / jobdir.CLUSTER).read_text())
        _prometheus_has_the_run(job, cluster["prometheus_port"], log)
        printed = re.search(r"from your machine: (ssh -N -L .*)$", log, re.M)
        assert printed, log
        token = Path(cluster["token_path"]).read_text().strip()
        with (
            ssh_servers(tmp_path / "ssh", "rtn1", cluster["head_ip"], login=jump_host(printed[1])) as config,
            tunnel(printed[1], config, LOCAL_PORT),
        ):
            _dashboard_shows_the_cluster_and_the_run(browser, token, screenshots)
        progress = [
            ln for ln in out.read_text().splitlines() if re.match(r"^progress: epoch +\d+/200  step \d+/\d+", ln)
        ]
        assert progress, out.read_text()  # the driver's plain progress lines
    finally:
        stop = testbed.raytrain("stop", job)
        driver.wait(timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    info = testbed.wait_done(job, timeout=120)
    assert info["JobState"] == "COMPLETED" and exit_code(info) == 0, testbed.output(job)
    logs = testbed.log_dir(job)
    assert f"replacement: '{job}'" in (logs / jobdir.PROMETHEUS_CONFIG).read_text()
    assert any((logs / jobdir.PROMETHEUS_DATA).iterdir())  # its data stays after the job
    assert_cleaned_up(job)  # Prometheus and sshd's tunnel included


def _prometheus_has_the_run(job: str, port: int, log: str) -> None:
    assert port, "cluster.json names no Prometheus"
    assert f"add -L 9090:127.0.0.1:{port} to that ssh command" in log  # the log's tunnel hint names it
    mine = f'{{slurm_job_id="{job}", run="{RUN}"}}'
    prom = keys.PROMETHEUS_PREFIX
    # Each rank's pace, from raytrain.progress on every worker, on every node, labelled with job and run.
    rates = wait_series(port, f"{prom}{keys.SAMPLES_PER_S}{mine}", want=3, timeout=120)
    assert sorted(s["metric"]["rank"] for s in rates) == ["0", "1", "2"]
    assert all(float(s["value"][1]) > 0 for s in rates)
    # Rank 0's reports, from the driver; and Ray's own series from the same scrape, with the job id.
    (acc,) = wait_series(port, f"{prom}{keys.report_metric('val_acc')}{mine}", want=1, timeout=60)
    assert 0.0 <= float(acc["value"][1]) <= 1.0
    ray_own = prometheus_query(port, f'count by (instance) (ray_node_cpu_utilization{{slurm_job_id="{job}"}})')
    assert len(ray_own) == 3, ray_own  # every node's exporter, found through Ray's discovery file


def _dashboard_shows_the_cluster_and_the_run(d: object, token: str, shots: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(d, WebDriver)
    home = f"http://localhost:{LOCAL_PORT}"

    def text() -> str:
        return str(d.find_element(By.TAG_NAME, "body").text)

    def until(what: str, check: Callable[[], T | None], timeout: float = 60) -> T:
        """check()'s first truthy value. The dashboard re-renders as data arrives, so an element found a moment
        ago can be gone when it is read: every check finds what it reads afresh, and a stale read is retried."""
        wait = WebDriverWait(d, timeout, ignored_exceptions=(StaleElementReferenceException,))
        try:
            found = wait.until(lambda _: check())
        except Exception as exc:
            d.save_screenshot(str(shots / "failed.png"))
            shown = str(d.execute_script("return document.body.innerText"))  # read in one go: nothing to go stale
            raise AssertionError(f"the dashboard never showed {what}; it shows:\n{shown[:2000]}") from exc
        assert found is not None  # until() returns only a truthy value
        return found

    # Without the token: the dialog that asks for it, and no cluster behind it.
    d.get(f"{home}/#/cluster")
    until("the token dialog", lambda: "Authentication Token Required" in text())
    until("an empty node list", lambda: "TOTAL\nx 0" in text())
    assert "node2" not in text() and "10.77.0.12" not in text()
    d.save_screenshot(str(shots / "dashboard-token.png"))

    # The token, given the way the dialog asks for it: then every node of the job, alive.
    until("the token field", lambda: d.find_element(By.CSS_SELECTOR, "input[type=password]")).send_keys(
        token, Keys.ENTER
    )
    until("the dialog closing", lambda: "Authentication Token Required" not in text())
    d.get(f"{home}/#/cluster")
    until("three live nodes", lambda: all(f"node{i}" in text() for i in (1, 2, 3)) and text().count("ALIVE") >= 3)
    d.save_screenshot(str(shots / "dashboard-cluster.png"))

    # The run: its driver is a Ray job; its Ray Train workers, one per node, are that job's actors.
    d.get(f"{home}/#/jobs")

    def driver_job() -> str | None:
        rows = [r.text for r in d.find_elements(By.CSS_SELECTOR, "tbody tr")]
        return next((r.split()[0] for r in rows if f"--name {RUN}" in r and "RUNNING" in r), None)

    ray_job = until("the run's driver", driver_job)
    d.get(f"{home}/#/jobs/{ray_job}/actors")
    until("the job's actors", lambda: "RayTrainWorker" in text())
    until("the class filter", lambda: d.find_element(By.XPATH, CLASS_FILTER)).send_keys("RayTrainWorker")

    def workers() -> list[str] | None:
        rows = [r.text for r in d.find_elements(By.CSS_SELECTOR, "tbody tr")]
        alive = [r for r in rows if "RayTrainWorker" in r and "ALIVE" in r]
        return alive if len(alive) == 3 else None

    alive = until("three training workers", workers)
    assert sorted(re.search(r"10\.77\.0\.1\d", w)[0] for w in alive) == [  # type: ignore[index]
        "10.77.0.11",
        "10.77.0.12",
        "10.77.0.13",
    ]
    d.save_screenshot(str(shots / "dashboard-train-workers.png"))

    # A worker's logs: its actor page shows what it wrote, the reports it made included.
    def actor_link() -> str | None:
        links = [a.get_attribute("href") or "" for a in d.find_elements(By.TAG_NAME, "a")]
        return next((h for h in links if re.search(r"/actors/[0-9a-f]{32}$", h)), None)

    d.get(until("a worker's page", actor_link))
    until("the worker's log", lambda: ":actor_name:RayTrainWorker" in text() and "Reporting training result" in text())
    has = "contains(., ':actor_name:RayTrainWorker')"
    innermost = f"//*[{has} and not(*[{has}])]"  # the element that shows the line, not its ancestors

    def scrolled() -> bool:
        d.execute_script("arguments[0].scrollIntoView({block: 'center'});", d.find_element(By.XPATH, innermost))
        return True

    until("the worker's log line in view", scrolled)
    d.save_screenshot(str(shots / "dashboard-worker-log.png"))
