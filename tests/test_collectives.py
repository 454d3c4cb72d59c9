"""``raytrain.all_reduce`` reduces by name, over a real two-process gloo group and outside any group."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import raytrain


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # Each rank builds its dict in its own order: the names, not the positions, pair the values up.
        mine = {"loss": 1.0 + rank, "count": 10.0 * (rank + 1)} if rank == 0 else {"count": 20.0, "loss": 2.0}
        total = raytrain.all_reduce(mine, torch.device("cpu"), dist.ReduceOp.SUM)
        most = raytrain.all_reduce({"wait_s": 0.5 + rank}, torch.device("cpu"), dist.ReduceOp.MAX)
        Path(out, str(rank)).write_text(repr((total, most)))
    finally:
        dist.destroy_process_group()


def test_values_are_reduced_by_name_across_ranks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert (tmp_path / str(rank)).read_text() == repr(({"count": 30.0, "loss": 3.0}, {"wait_s": 1.5}))


def test_one_worker_gets_its_own_values_back_by_name_or_by_position() -> None:
    assert raytrain.all_reduce({"a": 2, "b": 1.5}, torch.device("cpu"), dist.ReduceOp.SUM) == {"a": 2.0, "b": 1.5}
    assert raytrain.all_reduce([2, 1.5], torch.device("cpu"), dist.ReduceOp.SUM) == [2.0, 1.5]
