"""`raytrain fit --dry-run` prints the resolved config and the placement plan, and changes nothing."""

import re
import socket
from pathlib import Path

from raytrain.service.cluster import local_node
from tests.conftest import golden, run_cli


def normalise(text: str, storage: Path) -> str:
    """Replace what differs between machines; plan rows lose their (host-dependent) column padding."""
    host, ip = socket.gethostname(), local_node().ip
    lines = []
    for line in text.replace(str(storage), "<storage>").splitlines():
        if re.match(r"^  (rank|\d+) ", line):
            line = "  " + " ".join("<host>" if w == host else "<ip>" if w == ip else w for w in line.split())
        line = line.replace(f"({host} ", "(<host> ")  # the data line's CPUs left on each node
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_local_dry_run_is_pinned_by_golden_file(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    result = run_cli(
        "fit", "--dry-run", "--workers", "2", "--device", "cpu", "--cpus-per-worker", "0.5", "--storage", str(storage)
    )
    assert result.returncode == 0, result.stderr
    golden("dry_run_local_2cpu.txt", normalise(result.stdout, storage))
    assert not (storage / "digits-resnet18").exists()  # a dry run creates no run


def test_dry_run_on_slurm_gpus_shows_one_worker_per_gpu(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "41", "SLURM_CPUS_ON_NODE": "8", "SLURM_GPUS_ON_NODE": "4"}
    result = run_cli("fit", "--dry-run", "--stream", "--storage", str(tmp_path), env=env)
    assert result.returncode == 0, result.stderr
    assert "placement: 4 GPU workers on 1 node, backend nccl" in result.stdout
    assert [line.split()[-1] for line in result.stdout.splitlines() if re.match(r"^  \d ", line)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
    ]
    assert '"name": "digits-resnet18"' in result.stdout  # the same in every job: a resubmission resumes
    # One worker a GPU, a CPU each: the node's other 4 CPUs are the data's, which --stream sends through Ray Data.
    leave = r"^data: streamed, Ray Data's tasks decoding on the CPUs the workers leave \(\S+ 4\) \(--stream\)$"
    assert re.search(leave, result.stdout, re.M), result.stdout
