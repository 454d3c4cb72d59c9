"""Models sharded over the ranks (FSDP2's ``fully_shard``): shard one, checkpoint it from every rank, and
resume it at any world size, with the guarantees a rank-0 checkpoint has.

Call each on every rank at the same point, as ``ray.train.report``::

    model = raytrain.shard(model, blocks=model.layers)        # FSDP2 over all the run's ranks
    optimizer = torch.optim.AdamW(model.parameters())
    extra = raytrain.load_sharded(model, optimizer) or {}     # {} : no checkpoint yet, a new run
    ...
    raytrain.save_sharded(model, optimizer, metrics={"epoch": e, "loss": l}, extra={"epoch": e})

``save_sharded`` writes the rank's own shard with PyTorch's distributed checkpoint (DCP: a file per rank,
and the coordinator's ``.metadata`` from rank 0) into a local staging directory, and reports it with
``ray.train.report``: Ray Train copies every rank's files into one checkpoint directory of the run, each
rank records its files' sizes and CRC32s, and the checkpoint's manifest holds them all
(``raytrain.service.checksums``), so a checkpoint missing one rank's shard, or with one overwritten, is
passed over and named when the run resumes. ``load_sharded`` reads the checkpoint Ray Train hands the run
in place (a shared filesystem) and reshards it: DCP plans every rank's reads from the metadata, so a run
resumed with fewer or more workers (an elastic run that lost a node) goes on where it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

EXTRA = "extra.json"  # rank 0's ``extra`` (JSON values: epoch, step, ...), in each sharded checkpoint


def shard(model: torch.nn.Module, blocks: Iterable[torch.nn.Module] = (), *, bf16: bool | None = None) -> Any:
    """FSDP2 over every rank of the default process group: each of ``blocks`` (a transformer's layers, a
    ResNet's stages) is sharded as a unit, then the rest of the model, so parameters, gradients and
    optimizer state are spread over the ranks and one block at a time is gathered whole. ``bf16``: compute
    in bfloat16 and reduce gradients in float32 (default: on a GPU). On CPU (gloo, which has no averaging
    reduction) gradients are summed and then divided, so they equal DDP's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    gloo = dist.get_backend() == "gloo"
    mesh = init_device_mesh("cpu" if gloo else "cuda", (dist.get_world_size(),))
    on = (not gloo) if bf16 is None else bf16
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on else None
    units = [*blocks, model]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    if gloo:
        for unit in units:
            unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return model


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's (and optimizer's) state as DCP saves and loads it: sharded tensors stay sharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    metrics: dict[str, Any],
    extra: dict[str, Any] | None = None,
    name: str | None = None,
) -> None:
    """Checkpoint a sharded model (and optimizer) from every rank and report it with ``metrics``, as one
    ``ray.train.report``. ``extra``: rank 0's JSON values to resume with (``load_sharded`` returns them);
    ``name``: the checkpoint directory's name (default: Ray Train's). Returns once this rank's shard is in
    the run's storage."""
    import ray.train
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    rank = ray.train.get_context().get_world_rank()
    staging = tempfile.mkdtemp(prefix="rt-shard-")
    try:
        save(_state(model, optimizer), storage_writer=FileSystemWriter(staging, single_file_per_rank=True))
        if rank == 0:
            with open(os.path.join(staging, EXTRA), "w") as f:
                json.dump(extra or {}, f)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(staging),
            checkpoint_dir_name=name,
            delete_local_checkpoint_after_upload=True,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any] | None:
    """Load the checkpoint Ray Train resumes the run from into the model (and optimizer), resharded over
    the present ranks, whatever their number when it was saved; its ``extra``, or None when the run has
    no checkpoint (a new run)."""
    import ray.train
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        state = _state(model, optimizer)
        load(state, storage_reader=FileSystemReader(directory))
        with open(os.path.join(directory, EXTRA)) as f:
            extra = dict(json.load(f))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return extra
