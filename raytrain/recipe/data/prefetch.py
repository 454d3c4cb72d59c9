"""Batches made ahead of the training step by a thread of their own: the in-memory feed's cut and augmented
batches (``memory.batches``), and the streamed feed's batches from Ray Data (``shards.batches``)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


def prefetched(items: Iterator[T], depth: int, device: torch.device) -> Iterator[T]:
    """``items``, made by a thread of their own up to ``depth`` ahead; its error is raised here. Leaving the
    loop early (a preempted epoch) stops the thread. On a GPU the thread works on ``device``: a thread's
    CUDA calls (pinning, copies) otherwise go to GPU 0, where they would make a context of their own."""
    box: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                box.put(item, timeout=0.1)  # wakes to see a consumer that left
                return True
        return False

    def run() -> None:
        try:
            if device.type == "cuda":
                import torch

                torch.cuda.set_device(device)
            for item in items:
                if not put(item):
                    return
            put(_END)
        except BaseException as exc:  # handed to the consumer, which raises it
            put(_Failed(exc))

    thread = threading.Thread(target=run, name="raytrain-batches", daemon=True)
    thread.start()
    try:
        while (item := box.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()
