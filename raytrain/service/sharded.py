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

The same background write and copy serve a whole model's checkpoint, written by rank 0 alone (``save_whole``:
the built-in recipe's epoch checkpoints of a model that is not sharded).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import posixpath
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

EXTRA = "extra.json"  # rank 0's ``extra`` (JSON values: epoch, step, ...), in each sharded checkpoint
REPORT_MARGIN_S = 10.0  # of the time the job has left, kept for Ray Train's report of the last save


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


def dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's (and optimizer's) state as DCP saves and loads it: sharded tensors stay sharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


@dataclass
class _Write:
    """One save of this rank's shard: DCP writes it into ``staging`` in a background thread (from a copy
    in host memory), then Ray Train's upload thread copies it into the run's storage."""

    future: Future[Any]
    staging: str
    started: float  # time.monotonic()
    copied: threading.Event = field(default_factory=threading.Event)  # in storage and recorded, or failed
    written_s: float | None = None  # how long the write took, once done

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._done)

    def _done(self, _: Future[Any]) -> None:
        self.written_s = time.monotonic() - self.started

    def ended(self) -> None:
        """It will not be copied: its staging goes once the write has ended, and nothing waits for it."""
        self.future.add_done_callback(functools.partial(_remove, self.staging))
        self.copied.set()


_writes: list[_Write] = []  # this rank's saves whose copy into storage is not known to be done, oldest first
_group: Any = None  # the gloo group the background writes coordinate in
_abandoned: str | None = None  # rank 0: the line that said the last save was abandoned
_copy_s: float | None = None  # how long this rank's last copy into the run's storage took
_dropped: str | None = None  # the last save's checkpoint directory, when this rank's copy into it failed
_not_whole: str | None = None  # rank 0: that directory, when any rank's copy into it failed
_copied_into: str | None = None  # the checkpoint directory this rank's last copy went into
STAGING_PREFIX = "rt-shard-"  # then the staging process's pid@host and a dash: a dead one's is swept


class _CopyWhenWritten:
    """The upload step Ray Train runs for an asynchronous save (``checkpoint_upload_mode=ASYNC``, in its
    upload thread): wait until DCP has written this rank's shard, copy it into the run's storage as Ray
    Train itself does, and record the rank's part of the checkpoint (``raytrain.service.checksums``)."""

    staged = "this rank's shard"  # what the staging directory holds, for the message of a failed write
    every_rank = True  # every rank writes part of the checkpoint (``checksums.Part.every_rank``)

    def __init__(self, write: _Write, storage: Any, last: bool = False) -> None:
        self.write = write
        self.storage = storage
        self.last = last  # the last save: a copy that fails is this save's end, not the run's

    def __call__(self, checkpoint: Any, dir_name: str) -> Any:
        from raytrain import ray_internals
        from raytrain.service import checksums

        global _copy_s, _copied_into
        _copied_into = dir_name
        try:
            self.write.future.result()
        except BaseException as exc:  # a failed write fails the run, as a failed upload does
            self.write.ended()
            raise RuntimeError(
                f"writing {self.staged} into {self.write.staging} failed ({type(exc).__name__}: {exc}); it is "
                "staged whole in TMPDIR: if that disk is full, point RAYTRAIN_TMPDIR at a node-local disk with room "
                "for it"
            ) from exc
        # A failed copy is retried by Ray Train (its retry wraps this call): the staging stays until then.
        upload = ray_internals.upload_under_way(own_copy=True)
        began = time.monotonic()
        try:
            persisted = self.storage.persist_current_checkpoint(checkpoint, dir_name)
        except Exception as exc:
            if not self.last:
                raise
            return self._drop(checkpoint, dir_name, exc)
        _copy_s = time.monotonic() - began
        if upload is not None:
            checksums.record_upload(upload, every_rank=self.every_rank)  # a sharded save: none may lack its part
        self.write.copied.set()
        return persisted

    def abandon(self) -> None:
        """Its report did not go through: nothing waits for it, and its staging goes once its write has ended."""
        self.write.ended()

    def _drop(self, checkpoint: Any, dir_name: str, exc: Exception) -> Any:
        """The last save's copy failed on this rank (a full or failing filesystem): what it copied goes
        again, and it records no part, so no file of its shard stands in storage cut short and the
        checkpoint is not whole (the next start passes it over and names it); the report goes on, so
        the job ends as it would."""
        global _dropped
        import ray.train
        from ray.train import Checkpoint

        from raytrain import uri

        fs, dest = self.storage.storage_filesystem, self.storage.build_checkpoint_path_from_name(dir_name)
        for root, _, files in os.walk(checkpoint.path):
            for name in files:
                relative = os.path.relpath(os.path.join(root, name), checkpoint.path)
                with contextlib.suppress(Exception):
                    fs.delete_file(posixpath.join(dest, relative))
        self.write.ended()
        _dropped = dir_name
        rank: object = "?"
        with contextlib.suppress(Exception):  # outside a Ray Train worker there is no rank to name
            rank = ray.train.get_context().get_world_rank()
        print(
            f"raytrain: last save abandoned: rank {rank} "
            f"could not copy it into the run's storage ({uri.first_line(exc)}); the run resumes from its newest "
            "checkpoint before it",
            flush=True,
        )
        return Checkpoint(dest, fs)


class _WriteThenCopy(_CopyWhenWritten):
    """The upload step of a whole (not sharded) model's save (``save_whole``): rank 0's files written into
    the staging directory from the state's copy in host memory, here in Ray Train's upload thread, then
    copied into the run's storage and recorded as ``_CopyWhenWritten`` does."""

    staged = "the checkpoint"
    every_rank = False  # rank 0's alone

    def __init__(self, write_files: Callable[[str], None], write: _Write, storage: Any) -> None:
        super().__init__(write, storage)
        self.write_files: Callable[[str], None] | None = write_files  # holds the state's copy until written

    def __call__(self, checkpoint: Any, dir_name: str) -> Any:
        write_files, self.write_files = self.write_files, None  # the copy goes once written: Ray Train keeps
        if write_files is not None and not self.write.future.done():  # this call until the report is taken
            try:  # once: Ray Train retries a failed upload with this same call
                write_files(self.write.staging)
            except BaseException as exc:  # raised again by the copy step, which fails the run with it
                _settle(self.write.future, exc)
            else:
                _settle(self.write.future, None)
            del write_files
        return super().__call__(checkpoint, dir_name)

    def abandon(self) -> None:
        """As ``_CopyWhenWritten.abandon``: this step, which would write the files, is not run, so the write
        ends here."""
        _settle(self.write.future, None)
        super().abandon()


def _settle(future: Future[Any], outcome: BaseException | None) -> None:
    """End a write's future that no writer thread ends (a whole save's), if nothing has ended it yet."""
    with contextlib.suppress(futures.InvalidStateError):
        if outcome is None:
            future.set_result(None)
        else:
            future.set_exception(outcome)


def _save_group() -> Any:
    """The gloo group the background writes coordinate in, made by every rank at its first save: never
    the training's own group, whose collectives go on meanwhile from the training thread."""
    global _group
    import torch.distributed as dist

    if _group is None and dist.is_available() and dist.is_initialized():
        _group = dist.new_group(backend="gloo")
    return _group


def begin_write(state: dict[str, Any], directory: str, group: Any) -> Future[Any]:
    """Copy ``state`` (DCP's state dict of this rank) into host memory, which is all that blocks the
    caller, and write it into ``directory`` in DCP's background thread, coordinated in ``group`` (a gloo
    group, or None without a process group): the future ends when every rank's files are written."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import async_save

    # The state is staged in host memory already: no copy-ahead from the device in the write's thread
    # (whose CUDA calls would go to GPU 0, not this rank's).
    writer = FileSystemWriter(directory, single_file_per_rank=True, per_thread_copy_ahead=0)
    # The stager async_save makes for itself when given only a path: one copy into fresh host memory.
    # Without it the writer stages (allocate, then copy: 2.6x the blocked time, bench/sharded_save.py).
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        response = async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
    except BaseException:
        stager.close()  # its staged copy is not left for the cycle collector
        raise
    future = response if isinstance(response, Future) else response.upload_completion
    future.add_done_callback(lambda _: stager.close())
    return future


AddFiles = Callable[[str], None]  # rank 0 writes files of its own into a sharded checkpoint's directory


def _start_write(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None,
    add_files: AddFiles | None = None,
) -> _Write:
    """Stage this rank's shard in host memory (what blocks training) and write it in the background."""
    import ray.train

    # In TMPDIR: on a raytrain cluster the job's private dir on the node, removed with the job. A worker
    # killed before its write ended leaves its staging there until then: the next save sweeps it.
    _sweep_staging()
    staging = tempfile.mkdtemp(prefix=_staging_prefix(os.getpid()))
    started = time.monotonic()
    if ray.train.get_context().get_world_rank() == 0:
        with open(os.path.join(staging, EXTRA), "w") as f:
            json.dump(extra or {}, f)
        if add_files is not None:
            add_files(staging)
    future = begin_write(dcp_state(model, optimizer), staging, _save_group())
    return _Write(future=future, staging=staging, started=started)


def _staging_prefix(pid: int) -> str:
    """The staging directories of process ``pid`` on this host (a TMPDIR shared by nodes holds others')."""
    return f"{STAGING_PREFIX}{pid}@{socket.gethostname()}-"


def _sweep_staging() -> None:
    """Remove, in a background thread, the staging directories in TMPDIR of this user's processes on this
    host that are gone (workers killed by a failure Ray Train restarted from), so that restarts cannot
    fill the node's disk with dead writes. Ranks of one node may sweep at once: a directory another has
    just removed is passed over."""
    import psutil

    def dead(name: str) -> bool:
        pid = name.removeprefix(STAGING_PREFIX).partition("@")[0]
        return pid.isdigit() and name.startswith(_staging_prefix(int(pid))) and not psutil.pid_exists(int(pid))

    def sweep() -> None:
        with os.scandir(tempfile.gettempdir()) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if (
                        dead(entry.name)
                        and entry.is_dir(follow_symlinks=False)
                        and entry.stat(follow_symlinks=False).st_uid == os.getuid()
                    ):
                        shutil.rmtree(entry.path, ignore_errors=True)

    threading.Thread(target=sweep, name="raytrain-staging-sweep", daemon=True).start()


def _wait_for_writes(timeout_s: float | None) -> bool:
    """Wait until this rank's earlier saves are in storage (or failed); False if ``timeout_s`` ran out."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    while _writes:
        left = None if end is None else max(0.0, end - time.monotonic())
        if not _writes[0].copied.wait(left):
            return False
        _writes.pop(0)
    return True


def wait_sharded(timeout_s: float | None = None) -> bool:
    """Block until this rank's saves so far are in the run's storage, written, copied and recorded
    (``save_sharded`` and ``save_whole`` return before that), or failed (which fails the run). False if
    ``timeout_s`` ran out first."""
    return _wait_for_writes(timeout_s)


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    metrics: dict[str, Any],
    extra: dict[str, Any] | None = None,
    name: str | None = None,
    add_files: AddFiles | None = None,
) -> bool:
    """Checkpoint a sharded model (and optimizer) from every rank and report it with ``metrics``, as one
    ``ray.train.report``. ``extra``: rank 0's JSON values to resume with (``load_sharded`` returns them);
    ``name``: the checkpoint directory's name (default: Ray Train's); ``add_files``: called on rank 0 with
    the checkpoint's local directory, to write files of its own into it (recorded and checked with the
    shards).

    Training is blocked only while the rank's shard is copied into host memory: DCP writes it in the
    background and Ray Train then copies it into the run's storage, while training goes on. One save is
    under way at a time: a save waits for the one before it (so does any ``ray.train.report`` meanwhile:
    Ray Train keeps reports in order). Once ``raytrain.ending_soon()`` has said the
    job ends, the save is the last one and is bounded by the time the job has left
    (``raytrain.ending_in()``, less ``REPORT_MARGIN_S``): it returns once it is in storage, or it is
    abandoned (the run resumes from its newest checkpoint before it) and rank 0 says so in a line.
    Returns False when it was abandoned."""
    import ray.train

    from raytrain.service import preemption

    _save_group()  # a collective of every rank: made before any of them can take another path
    left = preemption.ending_in()
    if left is not None:
        return _last_save(model, optimizer, metrics, extra, name, left, add_files)
    _wait_for_writes(None)
    write = _start_write(model, optimizer, extra, add_files)
    _report_async(write, _CopyWhenWritten(write, ray.train.get_context().get_storage()), metrics, name)
    return True


WriteState = Callable[[str, Any], None]  # writes a whole model's state into a checkpoint's directory


def save_whole(
    state: Any, *, metrics: dict[str, Any], name: str | None = None, write: WriteState | None = None
) -> None:
    """Checkpoint a model that is not sharded (one replica on every rank, as under DDP) and report it with
    ``metrics``, as one ``ray.train.report``; call it on every rank at the same point, with the same
    ``name`` (the checkpoint directory's; default: Ray Train's). Rank 0's ``state`` is saved, the other
    ranks report ``metrics`` alone (their ``state`` may be None).

    Training is blocked only while rank 0 copies ``state`` into host memory (rank 0's host holds that
    copy until it is written): ``write(directory, copy)`` (default: ``torch.save`` into ``state.pt``) then
    runs in Ray Train's upload thread, which copies the directory into the run's storage and records its
    files' sizes and CRC32s, while training goes on. One save is under way at a time, as with
    ``save_sharded``: this waits for the one before it first, and so does any ``ray.train.report`` made
    meanwhile (Ray Train keeps reports in order); ``raytrain.wait_sharded()`` waits for it. Once
    ``raytrain.ending_soon()`` has said the job ends, the save is written and in storage before this
    returns. A failed write or copy fails the run, as a failed upload does."""
    import ray.train

    from raytrain.service import preemption

    context = ray.train.get_context()
    if context.get_world_rank() != 0:
        ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
        return
    _wait_for_writes(None)
    _sweep_staging()
    staging = tempfile.mkdtemp(prefix=_staging_prefix(os.getpid()))
    writer = write or _torch_save
    if preemption.ending_reason() is not None:  # the job's last save: in storage when this returns
        drop = functools.partial(shutil.rmtree, staging, ignore_errors=True)
        try:
            writer(staging, state)
        except BaseException:
            drop()
            raise
        _report_staged(staging, metrics, name, drop, checkpoint_upload_mode=ray.train.CheckpointUploadMode.SYNC)
        return
    try:
        copy = host_copy(state)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    write_now = _Write(future=Future(), staging=staging, started=time.monotonic())

    def files(directory: str) -> None:
        writer(directory, copy)

    _report_async(write_now, _WriteThenCopy(files, write_now, context.get_storage()), metrics, name)


def _torch_save(directory: str, state: Any) -> None:
    import torch

    torch.save(state, os.path.join(directory, "state.pt"))


def host_copy(state: Any, _copies: dict[Any, Any] | None = None) -> Any:
    """``state`` with every tensor and array copied into host memory, for a save written in the background
    while training goes on changing the live tensors it names (a model's parameters, an optimizer's
    buffers); tensors that are the same memory seen alike (tied weights) share one copy, as ``torch.save``
    would store them once. Dicts (their type, ``_metadata`` and default factory kept), lists and tuples
    are rebuilt; anything else is kept as it is."""
    import copy

    import numpy as np
    import torch

    copies = {} if _copies is None else _copies
    if isinstance(state, torch.Tensor):  # tied weights: a state dict names each as a tensor of its own
        key: Any = (state.device, state.data_ptr(), state.dtype, tuple(state.shape), state.stride())
        if key not in copies:
            copies[key] = state.detach().to("cpu", copy=True)
        return copies[key]
    if isinstance(state, np.ndarray):
        return np.array(state, copy=True)
    if isinstance(state, dict):
        copied = copy.copy(state)  # its type, and what it holds besides its items (a state dict's _metadata)
        copied.clear()
        copied.update((key, host_copy(value, copies)) for key, value in state.items())
        return copied
    if isinstance(state, (list, tuple)):
        values = [host_copy(value, copies) for value in state]
        return type(state)(*values) if hasattr(state, "_fields") else type(state)(values)  # a namedtuple's fields
    return state


def _report_async(write: _Write, upload: _CopyWhenWritten, metrics: dict[str, Any], name: str | None) -> None:
    """Report ``write``'s checkpoint, which ``upload`` writes or waits for and copies into storage in Ray
    Train's upload thread; kept among the writes under way unless Ray Train skipped the report (a worker
    failed meanwhile: its upload never runs, and its staging goes once nothing writes it)."""
    from ray.train import CheckpointUploadMode

    how = {"checkpoint_upload_mode": CheckpointUploadMode.ASYNC, "checkpoint_upload_fn": upload}
    if _report_staged(write.staging, metrics, name, upload.abandon, **how):
        _writes.append(write)


def _report_staged(
    staging: str, metrics: dict[str, Any], name: str | None, drop: Callable[[], None], **how: Any
) -> bool:
    """``ray.train.report`` the checkpoint staged in ``staging`` (uploaded as ``how`` says, then removed);
    ``drop`` it if the report fails or Ray Train skips it (a worker failed meanwhile: nothing will upload
    it). True if it was reported."""
    import ray.train

    from raytrain import ray_internals

    before = ray_internals.reports_made()
    try:
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(staging),
            checkpoint_dir_name=name,
            delete_local_checkpoint_after_upload=True,
            **how,
        )
    except BaseException:
        drop()
        raise
    if before is not None and ray_internals.reports_made() == before:
        drop()
        return False
    return True


def _last_save(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    metrics: dict[str, Any],
    extra: dict[str, Any] | None,
    name: str | None,
    left: float,
    add_files: AddFiles | None = None,
) -> bool:
    """The save after the job said it ends: written, then copied into storage by Ray Train before this
    returns, if every rank can do both within ``left`` seconds less the margin; else abandoned."""
    global _abandoned, _copied_into, _dropped, _not_whole
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from raytrain import uri
    from raytrain.service.collectives import all_reduce

    device = ray.train.torch.get_device()
    start, budget = time.monotonic(), left - REPORT_MARGIN_S
    why = None
    write = None
    if not _wait_for_writes(max(0.0, budget)):
        why = "the save before it was still being written"
    elif budget - (time.monotonic() - start) <= 0:
        why = "no time was left to write it"
    # Every rank writes, or none does: DCP's write is a collective of all of them.
    if all_reduce({"ready": why is None}, device, dist.ReduceOp.MIN)["ready"] > 0:
        try:  # a failure here is this save's, not the run's: the job ends anyway, from the checkpoint before
            write = _start_write(model, optimizer, extra, add_files)
        except Exception as exc:
            why = f"it could not be staged ({uri.first_line(exc)})"
        if write is not None:
            futures.wait([write.future], timeout=max(0.0, budget - (time.monotonic() - start)))
            # Ray Train's copy into storage comes next: it is taken to last as long as this rank's last copy
            # did (the same bytes to the same storage), or, before any, as long as the write.
            if not write.future.done():
                why = f"it was not written within {budget:.0f} s"
            elif (failed := write.future.exception()) is not None:
                why = f"its write failed ({uri.first_line(failed)})"
            else:
                took = write.written_s or time.monotonic() - write.started
                copy = _copy_s if _copy_s is not None else took
                if (time.monotonic() - start) + copy > budget:
                    why = (
                        f"its write took {took:.0f} s, and its copy into storage (~{copy:.0f} s) would not end in time"
                    )
    fits = all_reduce({"fits": why is None}, device, dist.ReduceOp.MIN)["fits"] > 0
    if fits and write is not None:
        _dropped = _copied_into = None  # set by this save's copy, if it runs
        upload = _CopyWhenWritten(write, ray.train.get_context().get_storage(), last=True)
        skipped = not _report_staged(write.staging, metrics, name, upload.abandon, checkpoint_upload_fn=upload)
        # Registered all the same (Ray Train takes a report's checkpoint from any rank): every rank learns
        # whether one could not copy its part, and rank 0 says so, naming it, for the driver. A report Ray
        # Train skipped (a worker failed meanwhile) copied nothing: no checkpoint of it stands to pass over.
        flags = {"dropped": float(_dropped is not None), "skipped": float(skipped)}
        outcome = all_reduce(flags, device, dist.ReduceOp.MAX)
        if outcome["dropped"] == 0 and outcome["skipped"] == 0:
            return True
        if ray.train.get_context().get_world_rank() == 0:
            if outcome["dropped"] and _copied_into is not None:  # rank 0's copy ran: it names the directory
                _not_whole = _copied_into
                _abandoned = (
                    f"last save abandoned: a rank could not copy its part of {_not_whole} into the run's "
                    "storage; that checkpoint is not whole, and the run resumes from its newest checkpoint "
                    "before it"
                )
            else:
                _abandoned = (
                    "last save abandoned: Ray Train skipped its report on a rank (a worker failed meanwhile); "
                    "the run resumes from its newest checkpoint before it"
                )
                print(f"raytrain: {_abandoned}", flush=True)
        return False
    if write is not None:  # the background write may go on: its directory goes when it ends
        write.ended()
    if ray.train.get_context().get_world_rank() == 0:
        _abandoned = (
            f"last save abandoned: {why or 'another rank could not finish it in time'} (the job had "
            f"{max(left, 0):.0f} s left, {REPORT_MARGIN_S:.0f} s of them kept for the report); the run resumes "
            "from its newest checkpoint before it"
        )
        print(f"raytrain: {_abandoned}", flush=True)
    # Every rank reports, so Ray Train's count of reports stays aligned. (Should a save before it still be
    # copied, Ray Train's reports keep their order: this one waits for it, as the end of training does.)
    ray.train.report(metrics)
    return False


def _remove(directory: str, _: object) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def not_whole() -> str | None:
    """Rank 0: the last save's checkpoint directory, registered but not whole (a rank's copy failed)."""
    return _not_whole


def abandoned() -> str | None:
    """Rank 0: the line that said the last save was abandoned, if it was."""
    return _abandoned


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, checkpoint: Any = None
) -> dict[str, Any] | None:
    """Load the checkpoint Ray Train resumes the run from (or ``checkpoint``, a ``ray.train.Checkpoint``)
    into the model (and optimizer), resharded over the present ranks, whatever their number when it was
    saved; its ``extra``, or None when the run has no checkpoint (a new run)."""
    import ray.train
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    checkpoint = checkpoint or ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        state = dcp_state(model, optimizer)
        load(state, storage_reader=FileSystemReader(directory))
        with open(os.path.join(directory, EXTRA)) as f:
            extra = dict(json.load(f))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return extra


def full_weights(directory: str) -> dict[str, torch.Tensor]:
    """The whole model of a ``save_sharded`` checkpoint in the local directory ``directory``, gathered
    from every rank's shard into this one process, on the CPU (for evaluation and export, or to start
    another run from): the state dict of the model as it was before ``shard``."""
    import warnings

    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "torch.distributed is unavailable or uninitialized": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(keys={"model"}, storage_reader=FileSystemReader(directory))
    return dict(state["model"])
