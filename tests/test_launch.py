"""The batch script's Python helpers: port blocks, addresses, object store sizing (real sockets, locks)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from raytrain import slurm_env
from raytrain.errors import UserError
from raytrain.launch import netinfo, node, ports

BLOCK = {"base": 41000, "size": 40, "count": 3}


def test_two_jobs_on_a_node_get_different_blocks(tmp_path: Path) -> None:
    a, fd_a = ports.claim("job-1", lock_dir=tmp_path, **BLOCK)
    b, fd_b = ports.claim("job-1", lock_dir=tmp_path, **BLOCK)  # same hash start, first block is held
    try:
        assert a.index != b.index
        assert set(a.fixed_ports()).isdisjoint(b.fixed_ports())
        assert a.worker_range[1] < b.base or b.worker_range[1] < a.base
    finally:
        os.close(fd_a)
        os.close(fd_b)
    again, fd = ports.claim("job-1", lock_dir=tmp_path, **BLOCK)  # released: the first block is free again
    os.close(fd)
    assert again.index == a.index


def test_a_block_with_a_busy_port_is_skipped(tmp_path: Path) -> None:
    first, fd = ports.claim("job-2", lock_dir=tmp_path, **BLOCK)
    os.close(fd)
    with socket.socket() as s:
        s.bind(("0.0.0.0", first.port("gcs")))
        s.listen()
        other, fd = ports.claim("job-2", lock_dir=tmp_path, **BLOCK)
        os.close(fd)
    assert other.index != first.index


def test_no_free_block_says_what_to_do(tmp_path: Path) -> None:
    held = [ports.claim("j", lock_dir=tmp_path, **BLOCK)[1] for _ in range(BLOCK["count"])]
    try:
        with pytest.raises(UserError, match="set RAYTRAIN_PORT_BASE"):
            ports.claim("j", lock_dir=tmp_path, **BLOCK)
    finally:
        for fd in held:
            os.close(fd)


def test_block_layout_keeps_named_ports_and_ranges_apart() -> None:
    block = ports.PortBlock(index=2, base=21000, size=500)
    fixed = block.fixed_ports()
    assert len(set(fixed)) == len(fixed) == 11
    assert max(fixed) < block.torch_range[0] <= block.torch_range[1] < block.worker_range[0]
    assert block.worker_range == (21020, 21499)


def test_addresses() -> None:
    assert netinfo.route_source("127.0.0.1") == "127.0.0.1"
    assert netinfo.iface_of("127.0.0.1") == "lo"
    assert netinfo.ip_of("lo") == "127.0.0.1"
    with pytest.raises(UserError, match="RAYTRAIN_IFNAME=nosuch0 has no IPv4 address"):
        netinfo.ip_of("nosuch0")
    assert netinfo.head_address("anything", ifname=None, override="10.1.2.3") == "10.1.2.3"


def test_object_store_fits_shm_and_slurm_memory() -> None:
    job = slurm_env.current({"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": "1000"})
    assert node.object_store_bytes(job) == int(1000 * 1024**2 * 0.3)
    import shutil

    huge = slurm_env.current({"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": str(10**9)})
    assert node.object_store_bytes(huge) <= int(shutil.disk_usage("/dev/shm").free * 0.9) + 1


def test_slurm_counts_parse() -> None:
    env = {"SLURM_JOB_ID": "9", "SLURM_CPUS_ON_NODE": "4(x3)", "SLURM_GPUS_ON_NODE": "gpu:a100:2"}
    env |= {"SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "2"}
    job = slurm_env.current(env)
    assert job is not None
    assert (job.cpus_on_node, job.gpus_on_node, job.key, job.restart_count) == (4, 2, "8_3", 2)
    assert slurm_env.current({}) is None
