"""The placement plan: which rank runs on which node and device, decided before any worker starts.

Ray alone retries forever when more workers are asked for than the cluster holds, so every request is
checked here first. The plan is also enforced: on a multi-node cluster each worker's placement-group bundle
is pinned to its planned node through Ray's node-id label, so ``--dry-run`` shows what will happen.

Ranks follow Ray Train's own ordering: grouped by node in bundle order, by GPU index within a node.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain.contracts.jobdir import NODE_ID_LABEL
from raytrain.contracts.result import Placement
from raytrain.errors import UserError
from raytrain.service.cluster import NodeInfo
from raytrain.service.config import ScaleConfig


@dataclass(frozen=True)
class Slot:
    rank: int
    local_rank: int
    node: NodeInfo
    device: str


@dataclass(frozen=True)
class Plan:
    use_gpu: bool
    cpus_per_worker: float
    slots: tuple[Slot, ...]  # the full plan (elastic: the most workers, as placed at the start)
    min_workers: int | None = None  # elastic: training goes on down to this many workers
    idle_cpus: float = 0.0  # the most CPUs of a cluster node the plan puts no worker on (Ray Data's to use)
    pinned: bool = True  # each rank on its slot's node; False: Ray places them (ScaleConfig.pinned)

    @property
    def workers(self) -> int:
        return len(self.slots)

    @property
    def backend(self) -> str:
        return "nccl" if self.use_gpu else "gloo"

    @property
    def nodes(self) -> tuple[NodeInfo, ...]:
        seen: dict[str, NodeInfo] = {}
        for slot in self.slots:
            seen.setdefault(slot.node.node_id, slot.node)
        return tuple(seen.values())

    @property
    def ranks_per_node(self) -> collections.Counter[str]:
        """How many workers the plan puts on each node, by node id."""
        return collections.Counter(slot.node.node_id for slot in self.slots)

    def cpus_left(self) -> dict[str, float]:
        """The CPUs the workers leave on each node they use, by node id."""
        taken = self.ranks_per_node
        return {n.node_id: n.cpus - taken[n.node_id] * self.cpus_per_worker for n in self.nodes}

    def spare_cpus(self) -> float:
        """The most CPUs the workers leave free on one node of the cluster, with or without workers (an
        elastic run's idle nodes not counted: it moves onto one when it loses a node)."""
        idle = self.idle_cpus if self.min_workers is None else 0.0
        return max(idle, *self.cpus_left().values())

    def data_cpus(self) -> int:
        """The whole CPUs the workers leave Ray Data: on the nodes they use, and the largest node without one
        (not for an elastic run, which moves onto it when it loses a node, as ``spare_cpus`` says)."""
        left = sum(int(cpus + 1e-9) for cpus in self.cpus_left().values())
        idle = self.idle_cpus if self.min_workers is None else 0.0
        return max(1, left + int(idle))

    def check_data_cpus(self, streams: str) -> None:
        """Ray Data's tasks that read or decode take a whole CPU each: refuse a CPU plan whose workers leave
        no node a whole CPU (nodes without workers counted), where the first task would wait for one
        forever. ``streams``: what streams through Ray Data, as the line names it."""
        spare = self.spare_cpus()
        if spare < 1 - 1e-9:
            raise UserError(
                f"{streams} through Ray Data, whose tasks (reading, decoding) take a whole CPU each, but the "
                f"workers leave at most {_num(spare)} CPUs free on a node: lower --cpus-per-worker or --workers, or "
                "ask Slurm for more CPUs"
            )

    def resources_per_worker(self) -> dict[str, float]:
        res = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            res["GPU"] = 1.0
        return res

    def label_selectors(self) -> list[dict[str, str]] | None:
        """Per-worker node pins, or None when everything lands on one node anyway, or when the run is
        elastic (a pin would keep naming a lost node; Ray places the workers on the nodes left)."""
        if len(self.nodes) < 2 or self.min_workers is not None or not self.pinned:
            return None
        return [{NODE_ID_LABEL: slot.node.node_id} for slot in self.slots]

    def render(self) -> str:
        kind = "GPU" if self.use_gpu else "CPU"
        head = (
            f"placement: {self.workers} {kind} worker{'s' if self.workers != 1 else ''} on "
            f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''}, backend {self.backend}, "
            f"{_num(self.cpus_per_worker)} CPU{'s' if self.cpus_per_worker != 1 else ''} per worker"
        )
        if self.min_workers is not None:
            head += f"; elastic: goes on with at least {self.min_workers} when a node is lost"
        elif not self.pinned and len(self.nodes) > 1:
            head += "; Ray places them where there is room (as planned here when the cluster is idle)"
        rows = [("rank", "node", "ip", "device")]
        rows += [(str(s.rank), s.node.hostname, s.node.ip, s.device) for s in self.slots]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [head] + ["  " + "  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        return "\n".join(lines)

    def placements(self) -> list[Placement]:
        return [Placement(rank=s.rank, hostname=s.node.hostname, ip=s.node.ip, device=s.device) for s in self.slots]


def _num(x: float) -> str:
    return f"{x:g}"


def _natural(hostname: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", hostname)]


def order_nodes(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """The driver's node first (rank 0 sits next to the driver), then by hostname, node10 after node9."""
    return sorted(nodes, key=lambda n: (not n.is_driver, _natural(n.hostname), n.ip))


def make_plan(nodes: Sequence[NodeInfo], scale: ScaleConfig) -> Plan:
    """Resolve device, worker count and CPUs per worker against the cluster, or say why it cannot work."""
    if not nodes:
        raise UserError("the Ray cluster has no live nodes: check the job log for nodes that failed to start")
    ordered = order_nodes(nodes)
    total_gpus = sum(n.gpus for n in ordered)
    if scale.device == "gpu" and total_gpus == 0:
        raise UserError(
            f"--device gpu but none of the {len(ordered)} node(s) has a GPU: "
            "run on GPU nodes (e.g. sbatch --gpus-per-node=N) or use --device cpu"
        )
    use_gpu = scale.device == "gpu" or (scale.device == "auto" and total_gpus > 0)
    plan = _gpu_plan(ordered, scale, total_gpus) if use_gpu else _cpu_plan(ordered, scale)
    placed = {slot.node.node_id for slot in plan.slots}
    idle = max((n.cpus for n in ordered if n.node_id not in placed), default=0.0)
    return dataclasses.replace(plan, min_workers=scale.min_workers, idle_cpus=idle, pinned=scale.pinned)


def _gpu_plan(nodes: list[NodeInfo], scale: ScaleConfig, total_gpus: int) -> Plan:
    workers = scale.workers or total_gpus
    if workers > total_gpus:
        per_node = ", ".join(f"{n.hostname}: {n.gpus}" for n in nodes)
        raise UserError(
            f"--workers {workers} needs {workers} GPUs but the cluster has {total_gpus} ({per_node}): "
            f"use --workers {total_gpus} or fewer, ask Slurm for more GPUs, or use --device cpu"
        )
    cpus = scale.cpus_per_worker or 1.0
    counts: list[tuple[NodeInfo, int]] = []
    left = workers
    for node in nodes:  # pack: fill each node's GPUs before using the next node
        take = min(node.gpus, left)
        if take:
            counts.append((node, take))
            left -= take
    _check_cpus(counts, cpus, nodes)
    return Plan(use_gpu=True, cpus_per_worker=cpus, slots=_slots(counts, gpu=True))


def _cpu_plan(nodes: list[NodeInfo], scale: ScaleConfig) -> Plan:
    workers = scale.workers or len(nodes)
    # A CPU worker a CPU, unless --cpus-per-worker says how much of one a worker takes (then the CPUs
    # check below decides what fits).
    per = scale.cpus_per_worker or 1.0
    capacity = sum(int(n.cpus / per + 1e-9) for n in nodes)
    if workers > capacity:
        asked = f" of {_num(per)} CPUs each" if scale.cpus_per_worker else ""
        raise UserError(
            f"--workers {workers} asks for {workers} CPU workers{asked} but the cluster has "
            f"{_num(sum(n.cpus for n in nodes))} CPUs: use --workers {capacity} or fewer, or ask Slurm for more CPUs"
        )
    # Spread: CPU workers scale with nodes, not with processes crowded onto one node.
    counts = [(n, workers // len(nodes) + (1 if i < workers % len(nodes) else 0)) for i, n in enumerate(nodes)]
    counts = [(n, k) for n, k in counts if k]
    for node, k in counts:
        if k > int(node.cpus / per + 1e-9):  # nodes with fewer CPUs than an even share
            raise UserError(
                f"--workers {workers} would put {k} workers on {node.hostname}, which has "
                f"{_num(node.cpus)} CPUs: use fewer workers or give every node more CPUs"
            )
    if scale.cpus_per_worker:
        cpus = scale.cpus_per_worker
    else:
        # Leave up to one CPU per node to Ray Data's tasks (reading and decoding); split the rest evenly.
        cpus = min((n.cpus - min(1.0, n.cpus / 2)) / k for n, k in counts)
        cpus = math.floor(cpus * 100) / 100
    _check_cpus(counts, cpus, nodes)
    return Plan(use_gpu=False, cpus_per_worker=cpus, slots=_slots(counts, gpu=False))


def _check_cpus(counts: list[tuple[NodeInfo, int]], cpus: float, nodes: list[NodeInfo]) -> None:
    for node, k in counts:
        if k * cpus > node.cpus + 1e-9:
            raise UserError(
                f"{k} workers x {_num(cpus)} CPUs do not fit on {node.hostname} ({_num(node.cpus)} CPUs): "
                "lower --cpus-per-worker or ask Slurm for more CPUs per node"
            )
    used = sum(k * cpus for _, k in counts)
    if sum(n.cpus for n in nodes) - used < 0.5 - 1e-9:
        raise UserError(
            f"the workers take {_num(used)} of the cluster's {_num(sum(n.cpus for n in nodes))} CPUs and "
            "leave none for data loading: lower --cpus-per-worker or ask Slurm for more CPUs"
        )


def _slots(counts: list[tuple[NodeInfo, int]], *, gpu: bool) -> tuple[Slot, ...]:
    slots = []
    rank = 0
    for node, k in counts:
        for local in range(k):
            slots.append(Slot(rank=rank, local_rank=local, node=node, device=f"cuda:{local}" if gpu else "cpu"))
            rank += 1
    return tuple(slots)
