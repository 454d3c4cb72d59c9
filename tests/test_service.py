"""The service's pure parts: the fit check any trainer gets, train-function inputs, report lines, and
sizing an allocation from sinfo for `fit --slurm`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain import socket_names
from raytrain.contracts import env
from raytrain.errors import UserError
from raytrain.service import outcomes, process_group
from raytrain.service.callback import ClusterTooSmall, check_fits
from raytrain.service.config import ScaleConfig
from raytrain.service.slurm_submit import partition_of, size
from raytrain.service.workload import dataset_paths, parse_config
from raytrain.slurm_env import gres_gpus, parse_sinfo
from tests.conftest import image_table, write_parquet


class Scaling:
    """The parts of a ray.train.ScalingConfig the check reads."""

    def __init__(self, workers: int, resources: dict[str, float], use_gpu: bool = False) -> None:
        self.min_workers = workers
        self.resources_per_worker = resources
        self.use_gpu = use_gpu


def node(cpus: float, gpus: float = 0, alive: bool = True) -> dict[str, object]:
    return {"Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus}}


def test_fit_check_counts_whole_workers_per_node() -> None:
    nodes = [node(4, 2), node(4, 2), node(4, 2, alive=False)]
    check_fits(Scaling(4, {"CPU": 2, "GPU": 1}, use_gpu=True), nodes)
    with pytest.raises(ClusterTooSmall, match=r"holds 4 such worker\(s\): ask for 4 or fewer"):
        check_fits(Scaling(5, {"CPU": 1, "GPU": 1}, use_gpu=True), nodes)
    with pytest.raises(
        ClusterTooSmall, match=r"needs 3 CPU per worker, but this Ray cluster \(2 node\(s\), 8 CPU in all\)"
    ):
        check_fits(Scaling(3, {"CPU": 3}), nodes)  # 8 CPUs, but 3-CPU workers fit one per node
    with pytest.raises(ClusterTooSmall, match="1 GPU per worker"):
        check_fits(Scaling(1, {}, use_gpu=True), [node(8, 0)])


def test_config_values_parse_as_json_else_text() -> None:
    assert parse_config(["lr=0.1", "epochs=3", "amp=true", "layers=[1, 2]", "name=resnet", "path=a=b"]) == {
        "lr": 0.1,
        "epochs": 3,
        "amp": True,
        "layers": [1, 2],
        "name": "resnet",
        "path": "a=b",
    }
    with pytest.raises(UserError, match="is not KEY=VALUE"):
        parse_config(["=3"])


def test_data_paths_name_splits(tmp_path: Path) -> None:
    write_parquet(tmp_path / "split/train/a.parquet", image_table(3))
    write_parquet(tmp_path / "split/val/a.parquet", image_table(3))
    write_parquet(tmp_path / "flat.parquet", image_table(3))
    assert dataset_paths([str(tmp_path / "split")]) == {
        "train": f"{tmp_path}/split/train",
        "val": f"{tmp_path}/split/val",
    }
    assert dataset_paths([str(tmp_path / "flat.parquet"), f"extra={tmp_path}/split/val"]) == {
        "train": f"{tmp_path}/flat.parquet",
        "extra": f"{tmp_path}/split/val",
    }


def test_report_lines() -> None:
    assert outcomes.report_line({"epoch": 3, "epochs": 10, "loss": 0.123456, "note": "x", "big": [1]}, 7) == (
        "epoch 3/10  loss 0.1235  note x"
    )
    assert outcomes.report_line({"loss": 2.0}, 4) == "report 4  loss 2"
    assert outcomes.epoch_progress([{"epoch": 1, "epochs": 5}, {"loss": 1.0}, {"epoch": 2, "epochs": 5}]) == {
        "epochs_completed": 2,
        "epochs": 5,
        "epochs_this_attempt": 2,
    }


SINFO = """gpu01|64|gpu:a100:4(S:0-1)|idle|gpu
gpu02|64|gpu:a100:4(S:0-1)|mixed|gpu
gpu03|64|gpu:a100:4(S:0-1)|drained|gpu
cpu01|32|(null)|idle|cpu*
cpu02|32|(null)|allocated|cpu*
"""


def test_a_dead_worker_is_the_cause_and_its_peers_collective_errors_are_not() -> None:
    """Kill one rank and the others fail in their next collective, often first: the line names the dead
    worker and the run counts as lost (worth requeueing), not as failed training."""
    import torch.distributed as dist
    from ray.exceptions import ActorDiedError
    from ray.train import WorkerGroupError

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error: Connection reset")
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited")
    died = ActorDiedError()
    user = ValueError("bad label 12")
    assert outcomes.cause({0: gloo, 1: died}) == (1, died)
    assert outcomes.cause({0: nccl, 1: gloo, 2: died}) == (2, died)
    assert outcomes.cause({0: gloo, 3: user}) == (3, user)
    assert outcomes.cause({2: user, 1: ValueError("other")})[0] == 1
    assert outcomes.lost_workers(WorkerGroupError("x", {0: gloo, 1: died}))
    assert not outcomes.lost_workers(WorkerGroupError("x", {0: gloo, 1: user}))
    assert not outcomes.lost_workers(WorkerGroupError("x", {0: gloo, 1: nccl}))


def test_a_full_disk_is_told_whichever_process_met_it() -> None:
    """A worker's upload or Ray Train's controller (its checkpoint index) may hit the full disk first; the
    run says the same thing either way (tests/test_fit.py fills a real disk)."""
    import errno

    from ray.train.v2.api.exceptions import ControllerError

    full = OSError(errno.ENOSPC, "Error writing bytes to file")
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    wrapped = RuntimeError("upload failed")
    wrapped.__cause__ = quota
    for error in (full, wrapped, ControllerError(full)):
        assert outcomes.out_of_space(error)
    assert outcomes.no_space(ControllerError(full)).startswith("a disk is full or over quota ([Errno 28]")
    assert not outcomes.out_of_space(ControllerError(OSError(errno.EACCES, "Permission denied")))


def test_sinfo_nodes_of_a_partition() -> None:
    assert gres_gpus("gpu:a100:4(S:0-1)") == 4 and gres_gpus("gpu:2,shard:8") == 2
    assert gres_gpus("(null)") == 0
    assert [n.name for n in parse_sinfo(SINFO, "gpu")] == ["gpu01", "gpu02"]  # drained is left out
    assert [n.name for n in parse_sinfo(SINFO, None)] == ["cpu01", "cpu02"]  # the default partition
    assert partition_of(["--time=1:00:00", "-p", "gpu"]) == partition_of(["--partition=gpu"]) == "gpu"
    assert partition_of(["-pgpu"]) == "gpu" and partition_of(["--time=1"]) is None


def test_sizing_one_gpu_worker_per_device_and_cpu_workers_per_node() -> None:
    gpus, cpus = parse_sinfo(SINFO, "gpu"), parse_sinfo(SINFO, None)
    assert size(gpus, ScaleConfig(workers=8), "gpu") == [
        "--ntasks-per-node=1",
        "--nodes=2",
        "--gpus-per-node=4",
        "--cpus-per-task=64",
    ]
    assert size(gpus, ScaleConfig(workers=2), "gpu") == [
        "--ntasks-per-node=1",
        "--nodes=1",
        "--gpus-per-node=2",
        "--cpus-per-task=32",
    ]
    # CPU workers are sized by the placement plan's own rules: up to a worker per CPU, sharing one CPU per node
    # with data loading, unless --cpus-per-worker says otherwise.
    assert size(cpus, ScaleConfig(workers=64, device="cpu"), "cpu")[1] == "--nodes=2"  # 32-CPU nodes
    with pytest.raises(UserError, match="--workers 65 needs 3 nodes of 32 CPUs, but cpu has 2 usable"):
        size(cpus, ScaleConfig(workers=65, device="cpu"), "cpu")
    assert size(cpus, ScaleConfig(workers=40, device="cpu", cpus_per_worker=1), "cpu")[1] == "--nodes=2"
    assert size(cpus, ScaleConfig(workers=32, device="cpu", cpus_per_worker=1), "cpu")[1] == "--nodes=2"
    with pytest.raises(UserError, match="--cpus-per-worker 40 does not fit on the 32-CPU nodes of cpu"):
        size(cpus, ScaleConfig(workers=2, device="cpu", cpus_per_worker=40), "cpu")
    with pytest.raises(UserError, match="--workers 12 needs 3 nodes of 4 GPUs, but gpu has 2 usable"):
        size(gpus, ScaleConfig(workers=12), "gpu")
    with pytest.raises(UserError, match="have no GPUs"):
        size(cpus, ScaleConfig(device="gpu"), "the default partition")


def test_a_local_cluster_without_the_dashboards_packages_trains_without_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ray refuses to start at all when asked for a dashboard whose packages are missing (a GPU host's
    own Python with a minimal Ray); the local run goes on without it and says how to have it."""
    from raytrain import ray_internals
    from raytrain.service import cluster

    assert ray_internals.dashboard_unavailable() is None  # this venv has ray[default]: Ray's own check agrees
    assert cluster._dashboard_can_start()
    monkeypatch.setattr(ray_internals, "dashboard_unavailable", lambda: "No module named 'aiohttp_cors'")
    assert not cluster._dashboard_can_start()
    assert "pip install 'ray[default]'" in caplog.text and "aiohttp_cors" in caplog.text


@pytest.fixture
def own_torch_names(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[socket.socket]]:
    """Rendezvous claims under a name prefix of this test's own (not a real job's), released afterwards."""
    claims: list[socket.socket] = []
    monkeypatch.setattr(process_group, "NAME_PREFIX", f"raytrain-torch-test-{os.getpid()}-")
    monkeypatch.setattr(process_group, "_claims", claims)
    yield claims
    for claim in claims:
        claim.close()


def _free_ports(count: int) -> int:
    """The first of COUNT consecutive ports that nothing on this machine listens on."""
    for first in range(30000, 32000, count):  # below the ephemeral range: no outgoing connection takes one
        if all(socket_names.port_free(port) for port in range(first, first + count)):
            return first
    raise AssertionError("no free ports")


def test_two_runs_starting_at_once_on_a_node_take_different_rendezvous_ports(
    monkeypatch: pytest.MonkeyPatch, own_torch_names: list[socket.socket]
) -> None:
    """Rank 0 claims the port it picks until its process ends: torch binds it seconds later, and another run's
    rank 0 starting meanwhile on the node, which finds the port still free, takes the next one."""
    first = _free_ports(2)
    monkeypatch.setenv(env.TORCH_PORTS.name, f"{first}-{first + 1}")
    taken = [process_group.address_and_port()[1], process_group.address_and_port()[1]]
    assert taken == [first, first + 1] and len(own_torch_names) == 2
    assert socket_names.bind(f"{process_group.NAME_PREFIX}{first}") is None  # held, whoever asks
    with pytest.raises(RuntimeError, match=rf"in {env.TORCH_PORTS.name}={first}-{first + 1}: every one is in use"):
        process_group.address_and_port()


def test_what_ray_trains_controller_unpickles_of_a_fit_run_imports_no_torch() -> None:
    """The backend config, the recipe's training function and the service's setup and callback, as the
    controller gets them: a process that unpickles them has not imported torch (3 s of CPU a run)."""
    import cloudpickle

    from raytrain.recipe.config import FitConfig
    from raytrain.recipe.fit import ImageClassifier
    from raytrain.service.callback import ServiceCallback
    from raytrain.service.wrapper import WorkerSetup

    setup = WorkerSetup(ImageClassifier(FitConfig()).train_func(), None, None, None, 1.0)
    blob = cloudpickle.dumps((process_group.ProcessGroup(backend="gloo", timeout_s=60), setup, ServiceCallback))
    check = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], input=blob, capture_output=True, check=True)
    assert out.stdout.decode().strip() == "False", out.stderr.decode()[-2000:]
