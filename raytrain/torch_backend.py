"""Ray Train's torch backend with torch's rendezvous port taken from the job's port block.

Ray Train lets rank 0 pick any free port for torch.distributed's TCPStore. Inside a
``slurm/ray_cluster.sbatch`` job every node's Ray exports the block reserved for this job
(``RAYTRAIN_TORCH_PORTS=first-last``), so the rendezvous port is chosen from that range instead and cannot
collide with another job on the node. Without the variable (a local run) Ray's own choice stands.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

PORTS_ENV = "RAYTRAIN_TORCH_PORTS"


def address_and_port() -> tuple[str, int]:
    """Run on rank 0: this node's IP and a free port from the job's torch range (else any free port)."""
    import ray
    from ray.train._internal.utils import get_address_and_port

    spec = os.environ.get(PORTS_ENV)
    if not spec:
        return get_address_and_port()  # type: ignore[no-any-return]
    first, last = (int(p) for p in spec.split("-"))
    for port in range(first, last + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return ray.util.get_node_ip_address(), port
    raise RuntimeError(f"no free port for torch's rendezvous in {PORTS_ENV}={spec}: every one is in use")


class _PinnedPortBackend(_TorchBackend):  # type: ignore[misc]
    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        # Ray's on_start asks worker 0 for (address, port) through this module-level name; swap it for the
        # duration of the call. It runs in the Ray Train controller, which drives one run at a time.
        import ray.train.torch.config as ray_torch_config

        original = ray_torch_config.get_address_and_port
        ray_torch_config.get_address_and_port = address_and_port
        try:
            super().on_start(worker_group, backend_config)
        finally:
            ray_torch_config.get_address_and_port = original


@dataclass
class PinnedPortTorchConfig(TorchConfig):  # type: ignore[misc]
    """``TorchConfig`` whose rendezvous port comes from the job's port block."""

    @property
    def backend_cls(self) -> type[_TorchBackend]:
        return _PinnedPortBackend
