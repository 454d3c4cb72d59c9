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
_JOIN_S = 5.0  # how long a consumer that leaves waits for the thread (a daemon) to stop


def prefetched(items: Iterator[T], depth: int, device: torch.device) -> Iterator[T]:
    """``items``, made by a thread of their own up to ``depth`` ahead; its error is raised here. Leaving the
    loop early (a preempted epoch) stops the thread once it has its next item, closing ``items``; it is
    not waited for longer than ``_JOIN_S`` (a streamed pass that is left may never give another). On a GPU
    the thread works on ``device``: a new thread's current CUDA device is otherwise GPU 0, whatever the
    rank's."""
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
            if device.type == "cuda" and device.index is not None:
                import torch

                torch.cuda.set_device(device)
            for item in items:
                if not put(item):
                    close = getattr(items, "close", None)
                    if close is not None:
                        close()  # a generator's own clean-up (Ray's iterator: its thread) runs now
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
        thread.join(timeout=_JOIN_S)
