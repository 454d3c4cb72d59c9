"""Streamed decoding at Linux's idle scheduling policy (``raytrain/recipe/data/idle.py``): on a thread of its
own, in the order asked for, nothing made ahead, errors and early closes passed on, and the Ray worker's own
thread left as it was."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raytrain.recipe.config import DataConfig
from raytrain.recipe.data import idle, pipeline, source
from tests.conftest import image_table, write_parquet

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


@pytest.fixture
def fresh_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module's idle thread made anew in the test (under whatever the test patched), and shut down
    after it, before the process's own thread is put back."""
    monkeypatch.setattr(idle, "_pool", None)
    yield
    if idle._pool is not None:
        idle._pool.shutdown(wait=True)


def _probe(n: int, made: list[int], closed: list[bool]) -> Iterator[tuple[int, int, int]]:
    """``n`` items, each the scheduling policy and thread it was made on; ``made`` counts them as made."""
    try:
        for i in range(n):
            made.append(i)
            yield i, os.sched_getscheduler(0), threading.get_ident()
    finally:
        closed.append(True)


def test_items_are_made_one_at_a_time_on_an_idle_thread_in_order(
    fresh_thread: None, caplog: pytest.LogCaptureFixture
) -> None:
    before = os.sched_getscheduler(0)
    made: list[int] = []
    closed: list[bool] = []
    with caplog.at_level("WARNING", logger=idle.__name__):
        out = idle.stepped(_probe(4, made, closed))
        first = next(out)
    assert made == [0]  # nothing made ahead of what was asked for
    assert not [r for r in caplog.records if r.name == idle.__name__]  # the policy was taken: nothing said
    rest = list(out)
    assert [i for i, _, _ in [first, *rest]] == [0, 1, 2, 3]
    assert {policy for _, policy, _ in [first, *rest]} == {os.SCHED_IDLE}
    assert threading.get_ident() not in {thread for _, _, thread in [first, *rest]}
    assert os.sched_getscheduler(0) == before  # the caller's thread is left as it was


def test_an_error_reaches_the_caller_and_an_early_close_closes_the_items() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("a damaged image")

    out = idle.stepped(failing())
    assert next(out) == 1
    with pytest.raises(ValueError, match="a damaged image"):
        next(out)

    def timing_out() -> Iterator[int]:  # a storage read that timed out: raised, not taken for a wait's end
        raise TimeoutError("the file system did not answer")
        yield 0

    with pytest.raises(TimeoutError, match="did not answer"):
        next(idle.stepped(timing_out()))

    made: list[int] = []
    closed: list[bool] = []
    out2 = idle.stepped(_probe(10, made, closed))
    next(out2)
    out2.close()  # the pass ended early: its task's generator is closed, on the idle thread
    idle._thread().submit(lambda: None).result(timeout=10)  # the close was queued ahead of this
    assert closed == [True] and made == [0]


def test_an_interrupt_reaches_a_caller_waiting_on_a_step_that_has_not_ended() -> None:
    """Ray cancels a task by interrupting its thread (``_thread.interrupt_main``), which a thread blocked on a
    lock takes only when the lock is released: the task must end then, not once the running step ends."""
    import _thread

    release, ended = threading.Event(), threading.Event()

    def slow() -> Iterator[int]:
        _thread.interrupt_main()  # while the caller waits for this step
        release.wait(timeout=10)
        ended.set()
        yield 1

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a Ray worker, not an ignored SIGINT
    try:
        with pytest.raises(KeyboardInterrupt):
            next(idle.stepped(slow()))
    finally:
        signal.signal(signal.SIGINT, before)
    assert not ended.is_set()  # taken while the step was still running
    release.set()
    idle._thread().submit(lambda: None).result(timeout=10)


@pytest.mark.parametrize(
    "refusal",
    [PermissionError("a sandbox's seccomp"), TypeError("a sched_param this interpreter does not take")],
    ids=["refused", "not callable so"],
)
def test_where_the_policy_is_refused_items_are_still_made_and_it_is_said(
    refusal: Exception, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_thread: None
) -> None:
    def refused(*args: Any) -> None:
        raise refusal

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    with caplog.at_level("WARNING", logger=idle.__name__):
        made = [i for i, _, _ in idle.stepped(_probe(3, [], []))]
        made += [i for i, _, _ in idle.stepped(_probe(2, [], []))]
    assert made == [0, 1, 2, 0, 1]
    said = [r.getMessage() for r in caplog.records if r.name == idle.__name__]
    assert len(said) == 1 and f"not the idle one --decode-priority chose ({refusal})" in said[0]


def test_where_the_platform_has_no_idle_policy_auto_is_normal_and_idle_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_thread: None
) -> None:
    monkeypatch.delattr(os, "SCHED_IDLE")  # as on macOS
    assert idle.resolve(idle.AUTO, use_gpu=False) == idle.NORMAL
    with caplog.at_level("WARNING", logger=idle.__name__):
        assert [i for i, _, _ in idle.stepped(_probe(2, [], []))] == [0, 1]
    said = [r.getMessage() for r in caplog.records if r.name == idle.__name__]
    assert len(said) == 1 and "no SCHED_IDLE" in said[0] and "--decode-priority normal" in said[0]


@pytest.mark.ray
def test_in_a_ray_task_the_items_are_made_idle_and_the_workers_thread_stays_normal(ray_local: object) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def task() -> tuple[list[tuple[int, int, int]], int, int]:
        seen = list(idle.stepped(_probe(3, [], [])))
        return seen, os.sched_getscheduler(0), threading.get_ident()

    seen, policy, thread = ray.get(task.remote())
    assert [i for i, _, _ in seen] == [0, 1, 2]
    assert {p for _, p, _ in seen} == {os.SCHED_IDLE} and thread not in {t for _, _, t in seen}
    assert policy == os.SCHED_OTHER  # the worker process runs its next task at the normal policy


@pytest.mark.ray
def test_the_streamed_pipeline_decodes_at_the_policy_it_is_given(
    ray_local: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[bool] = []
    made = pipeline._ReadDecode

    def recorded(*args: Any) -> pipeline._ReadDecode:
        task = made(*args)
        built.append(task.at_idle)
        return task

    monkeypatch.setattr(pipeline, "_ReadDecode", recorded)
    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", image_table(40))))
    for priority in (idle.IDLE, idle.NORMAL):
        streams = pipeline.Streams(src, image_size=8, val_fraction=0.2, decode_priority=priority)
        streams.train(), streams.val()
    assert built == [True, True, False, False]  # training's and validation's tasks, each way


def test_a_streamed_task_decodes_on_the_idle_thread_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def decode(table: Any, **how: Any) -> dict[str, Any]:
        seen.append(os.sched_getscheduler(0))
        return {"rows": len(table)}

    def reader(units: Any, **read: Any) -> Iterator[Any]:
        yield from (image_table(4), image_table(4))

    monkeypatch.setattr(pipeline, "decode", decode)
    for at_idle in (True, False):
        seen.clear()
        blocks = list(pipeline._ReadDecode(reader, 8, None, 4, at_idle)(image_table(1)))  # type: ignore[arg-type]
        assert blocks == [{"rows": 4}, {"rows": 4}]
        assert seen == [os.SCHED_IDLE if at_idle else os.sched_getscheduler(0)] * 2


def test_by_default_ranks_on_cpus_go_first_and_ranks_on_gpus_leave_decoding_as_linux_shares_it() -> None:
    default = DataConfig().decode_priority
    assert idle.resolve(default, use_gpu=False) == idle.IDLE
    assert idle.resolve(default, use_gpu=True) == idle.NORMAL
    for asked in (idle.IDLE, idle.NORMAL):
        assert idle.resolve(asked, use_gpu=True) == idle.resolve(asked, use_gpu=False) == asked


def test_the_pipeline_takes_a_resolved_priority_only(tmp_path: Path) -> None:
    src = source.inspect(str(write_parquet(tmp_path / "d.parquet", image_table(8))))
    with pytest.raises(ValueError, match="decode_priority is 'auto'"):  # not taken for normal
        pipeline.Streams(src, image_size=8, val_fraction=0.2, decode_priority=idle.AUTO)
