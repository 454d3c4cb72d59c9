"""Epoch reports from the Ray Train controller to the driver, on a real local Ray."""

from __future__ import annotations

import threading

import pytest

pytestmark = pytest.mark.ray


def test_reports_arrive_in_order_and_end_quietly_when_their_queue_dies(ray_local: object) -> None:
    import ray
    from ray.exceptions import RayActorError

    from raytrain.service.progress import Report, Reports

    seen: list[Report] = []
    took_two = threading.Event()

    def on_report(report: Report) -> None:
        seen.append(report)
        if len(seen) == 2:
            took_two.set()

    with Reports(on_report) as reports:
        forward = reports.callback()
        for epoch in (1, 2):
            forward.after_report(None, [{"epoch": epoch}], None)
        assert took_two.wait(timeout=60)
        assert reports.queue.actor is not None
        ray.kill(reports.queue.actor)  # what a node going down does to the queue actor on it
        # ray.kill is asynchronous: let the pump find the queue gone before the block's end marker could
        # still reach a live queue.
        reports._thread.join(timeout=60)
        assert not reports._thread.is_alive()
    # The pump thread ended without a traceback, and leaving the block raised nothing.
    assert isinstance(reports.lost, RayActorError)
    assert [r.rank0["epoch"] for r in seen] == [1, 2] and reports.events.reports == seen
