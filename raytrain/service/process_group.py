"""torch's process group for raytrain's runs, set up without torch in Ray Train's controller.

Ray's ``TorchConfig`` lives in a module that imports torch, and the Train controller unpickles it with the
run and calls its backend before the first worker starts: 3 s of CPU on every run (10% of a start on a
2-core node), in a process that never trains. ``ProcessGroup`` names the same settings and sets the group up
as Ray's torch backend does: NCCL on GPUs, else gloo, over ``env://``, with torchrun's variables, each
worker's CUDA device picked, and every node's GPUs visible to its workers. Every step that touches torch
runs in the workers, as Ray's own functions (``raytrain.ray_internals``). (A ``--train-func`` whose module
imports torch still brings it into the controller, which unpickles the function's reference.)

The rendezvous port comes from the job's port block (``RAYTRAIN_TORCH_PORTS``), so that it cannot collide
with another job's on a shared node, and rank 0 claims it by name (``raytrain.socket_names``) until its
process ends, so that two runs of the job starting at once on one node cannot pick the same port before
either's torch has bound it. A script's own ``TorchConfig`` gets its port the same way: the service
callback points Ray's backend at ``address_and_port``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from typing import Any

from ray.train.backend import Backend, BackendConfig

from raytrain import ray_internals, socket_names
from raytrain.contracts import env

log = logging.getLogger(__name__)


# A rendezvous port's name: this prefix and the port. Held by the rank 0 that took the port, until it exits.
NAME_PREFIX = "raytrain-torch-"
_claims: list[socket.socket] = []


def address_and_port() -> tuple[str, int]:
    """Run on rank 0: this node's IP and a free port from the job's torch range (else Ray's own choice),
    claimed for the life of this worker process."""
    import ray

    spec = env.TORCH_PORTS.get()
    if not spec:
        return ray_internals.ray_address_and_port()
    first, last = (int(p) for p in spec.split("-"))
    for port in range(first, last + 1):
        try:
            claim = socket_names.bind(f"{NAME_PREFIX}{port}")
            if claim is None:
                continue  # another run's rank 0 took it, and its torch may not have bound it yet
        except OSError:
            claim = None  # this node forbids socket names: the probe alone
        if not socket_names.port_free(port):
            if claim is not None:
                claim.close()
            continue
        if claim is not None:
            _claims.append(claim)
        return ray.util.get_node_ip_address(), port
    raise RuntimeError(f"no free port for torch's rendezvous in {env.TORCH_PORTS.name}={spec}: every one is in use")


@dataclasses.dataclass
class ProcessGroup(BackendConfig):  # type: ignore[misc]
    """``TorchTrainer(torch_config=...)`` for raytrain's runs: ``backend`` (nccl, gloo), and the timeout of
    the group's operations."""

    backend: str
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type[Backend]:
        return _TorchBackend

    @property
    def train_func_context(self) -> Any:
        return ray_internals.torch_train_func_context()  # read in the driver, which has torch

    @property
    def framework(self) -> Any:
        return ray_internals.torch_framework()

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class _TorchBackend(Backend):  # type: ignore[misc]
    share_cuda_visible_devices = True  # as Ray's: NCCL on a node sees every GPU its workers hold

    def on_start(self, worker_group: Any, backend_config: ProcessGroup) -> None:
        import ray

        addr, port = worker_group.execute_single(0, address_and_port)
        worker_group.execute(ray_internals.torch_env_on_worker, addr=addr, port=port)
        size = len(worker_group)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    ray_internals.torch_process_group_on_worker,
                    backend=backend_config.backend,
                    world_rank=rank,
                    world_size=size,
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(size)
            ]
        )

    def on_shutdown(self, worker_group: Any, backend_config: ProcessGroup) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        closing = worker_group.execute_async(
            ray_internals.torch_shutdown_on_worker, destroy_process_group=len(worker_group) > 1
        )
        timeout_s = ray_internals.torch_shutdown_timeout_s()
        try:
            ray.get(closing, timeout=timeout_s)
        except GetTimeoutError:
            log.warning("torch's process group did not close within %d s", timeout_s)
