"""How the recipe spreads its model over the ranks, and what that costs each rank in memory.

``--strategy ddp`` keeps a whole copy of the model, its gradients and its optimizer state on every rank
and all-reduces the gradients (DistributedDataParallel). ``--strategy fsdp`` shards all three over the
ranks with FSDP2 (``raytrain.shard``): each unit (a ResNet's residual block, a ViT's encoder block) is
gathered whole only while it computes, in bfloat16 on a GPU, and its gradients are reduce-scattered in
float32. Its checkpoints are sharded too, every rank writing its own part (``raytrain.save_sharded``).

The estimate counts what does not depend on the batch: parameters and gradients in float32, the
optimizer's state (SGD's momentum: one float32 per parameter; AdamW's two moments: two), DDP's gradient
buckets, and FSDP's gathered units (the largest, twice for the one prefetched, plus its gradients).
Activations come on top, so a run whose estimate already exceeds a GPU's memory cannot fit.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain.errors import UserError

if TYPE_CHECKING:
    from torch import nn

    from raytrain.recipe.config import FitConfig

DDP, FSDP = "ddp", "fsdp"
STRATEGIES = (DDP, FSDP)
_FP32 = 4


def blocks(net: nn.Module) -> list[nn.Module]:
    """The units FSDP2 shards one at a time: a torchvision ResNet's residual blocks, a ViT's encoder
    blocks, the stages of a model built on a ``features`` sequence (MobileNet, EfficientNet, ConvNeXt,
    VGG, ...); none for any other model, which is then sharded as one unit."""
    from torch import nn

    layers = [getattr(net, f"layer{i}", None) for i in range(1, 5)]
    if all(isinstance(layer, nn.Sequential) for layer in layers):
        return [block for layer in layers for block in layer]  # type: ignore[union-attr]
    encoder = getattr(net, "encoder", None)
    if isinstance(getattr(encoder, "layers", None), nn.Sequential | nn.ModuleList):
        return list(encoder.layers)  # type: ignore[union-attr]
    features = getattr(net, "features", None)
    if isinstance(features, nn.Sequential):
        return [m for m in features if any(True for _ in m.parameters())]
    return []


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Accumulation: gradients are reduced over the ranks only on a batch that ends in an optimizer
    step (``sync``), under either strategy."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if sync:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:  # one rank: nothing to reduce
        yield


@dataclass(frozen=True)
class Estimate:
    """What a model costs, in elements and bytes; ``per_rank`` spreads it over ``world`` ranks."""

    model: str
    params: int  # elements
    largest_unit: int  # elements of the largest unit FSDP2 gathers whole
    optimizer_slots: int  # float32 tensors the optimizer keeps per parameter
    compute_bytes: int  # bytes per element a gathered unit computes in
    trainable: int | None = None  # elements that train (--freeze-backbone: the head's); None: all

    def per_rank(self, strategy: str, world: int) -> dict[str, int]:
        full = _FP32 * self.params
        grads = _FP32 * (self.params if self.trainable is None else self.trainable)
        if strategy == DDP:
            buckets = grads if world > 1 else 0
            return {
                "parameters": full,
                "gradients": grads,
                "gradient buckets": buckets,
                "optimizer state": self.optimizer_slots * grads,
            }
        gathered = 2 * self.largest_unit * self.compute_bytes + _FP32 * self.largest_unit

        def share(n: int) -> int:
            return -(-n // world)

        return {
            "parameters": share(full),
            "gradients": share(grads),
            "optimizer state": share(self.optimizer_slots * grads),
            "gathered units": gathered,
        }

    def total(self, strategy: str, world: int) -> int:
        return sum(self.per_rank(strategy, world).values())


def estimate(cfg: FitConfig, gpu: bool) -> Estimate:
    """The memory ``cfg``'s model needs, counted on a model built on torch's meta device (no memory,
    no weights)."""
    import torch

    from raytrain.recipe import models, weights

    assert cfg.data.num_classes is not None
    with torch.device("meta"):
        net = models.build(cfg.model.name, cfg.data.num_classes)
    params = sum(p.numel() for p in net.parameters())
    units = [sum(p.numel() for p in b.parameters()) for b in blocks(net)]
    rest = params - sum(units)
    slots = 2 if cfg.optim.optimizer == "adamw" else (1 if cfg.optim.momentum > 0 else 0)
    compute = 2 if gpu and cfg.optim.amp else _FP32
    head = set(weights.head(net)) if cfg.model.freeze_backbone else None
    trainable = None if head is None else sum(p.numel() for n, p in net.named_parameters() if n in head)
    return Estimate(cfg.model.name, params, max([*units, rest]), slots, compute, trainable)


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def lines(est: Estimate, chosen: str, world: int, only_chosen: bool = False) -> list[str]:
    """The estimate per rank under each strategy (or the chosen one only), the chosen one marked."""
    out = [f"memory per rank, estimated ({est.model}: {est.params / 1e6:.1f} M parameters; activations not counted):"]
    for strategy in (chosen,) if only_chosen else STRATEGIES:
        parts = [f"{k} {size(v)}" for k, v in est.per_rank(strategy, world).items() if v]
        mark = "  <- --strategy" if strategy == chosen else ""
        out.append(f"  {strategy:<4}  {size(est.total(strategy, world))} = {', '.join(parts)}{mark}")
    return out


def check_fits(est: Estimate, chosen: str, world: int, gpu_bytes: int | None) -> None:
    """Refuse a GPU run whose model state alone exceeds a GPU's memory (``gpu_bytes``; None: unknown)."""
    if gpu_bytes is None or est.total(chosen, world) <= gpu_bytes:
        return
    have, sharded = size(gpu_bytes), est.total(FSDP, world)
    what = f"{est.model}'s parameters, gradients and optimizer state alone"
    if chosen == DDP and sharded <= gpu_bytes:
        raise UserError(
            f"--strategy ddp needs about {size(est.total(DDP, world))} per GPU for {what}, more than a GPU's "
            f"{have}: use --strategy fsdp (about {size(sharded)} per GPU over {world} workers; see --dry-run)"
        )
    raise UserError(
        f"{what} need about {size(sharded)} per GPU even sharded over {world} workers (--strategy fsdp), more "
        f"than a GPU's {have}: use --strategy fsdp with more --workers, or a smaller --model"
    )


def gpu_memory(timeout_s: float = 10.0) -> int | None:
    """The memory of this node's smallest GPU, in bytes, as ``nvidia-smi`` reports it (within ``timeout_s``:
    a wedged GPU can hold it in the kernel for good, and it is then left behind, not waited for); read on the
    driver's node, the allocation's nodes being alike. None where it cannot tell."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        mib = [int(v) for v in out.split()] if proc.returncode == 0 else []
    except subprocess.TimeoutExpired:
        proc.kill()  # not waited for: see above
        return None
    except ValueError:  # "[N/A]", say
        return None
    return min(mib) * 2**20 if mib else None
