"""A user's function that checkpoints with ``raytrain.save_whole``, run with ``raytrain fit --train-func
tests.user_code.whole_save:train_func``. Config: epochs.

Rank 0's write of each checkpoint waits until the training thread has gone on past ``save_whole``, and has
changed every weight meanwhile; it fails the run after 60 s otherwise. So the run ends well only where the
save was written in the background from a copy, and each checkpoint's weights sum to the ``weight_sum``
its epoch reported.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray.train
import torch
import torch.nn.functional as F

import raytrain

_gone_on: dict[int, threading.Event] = {}  # by epoch: set by the training thread once save_whole returned


def _write(directory: str, state: dict[str, Any]) -> None:
    epoch = int(state["epoch"])
    if not _gone_on[epoch].wait(60):
        raise RuntimeError(f"epoch {epoch}'s save waited for its own write: save_whole did not return first")
    torch.save(state, os.path.join(directory, "state.pt"))


def train_func(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    net = model.module if hasattr(model, "module") else model
    for epoch in range(1, int(config["epochs"]) + 1):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        weights = sum(float(p.sum()) for p in net.state_dict().values())
        _gone_on[epoch] = threading.Event()
        state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
        metrics = {"epoch": epoch, "loss": float(loss), "weight_sum": weights}
        raytrain.save_whole(state, metrics=metrics, name=f"epoch_{epoch:04d}", write=_write)
        with torch.no_grad():  # training goes on changing the live weights the state names
            for p in net.parameters():
                p.add_(1.0)
        _gone_on[epoch].set()
