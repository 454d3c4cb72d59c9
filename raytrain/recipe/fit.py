"""``raytrain fit``: the built-in recipe as a ``raytrain.Workload``.

Image classification from Parquet with a torchvision model: the data and the model are checked before
anything starts, the checkpoints are the recipe's own (verified, with fallback past damaged ones), and
each epoch is one line. Everything else (placement, the cluster, the run directory, preemption, progress,
result.json) is raytrain's service, reached through its public API only.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import raytrain
from raytrain import fsio, uri
from raytrain.contracts.result import RunResult
from raytrain.recipe import checkpoint_files, models, weights
from raytrain.recipe.config import EMBEDDED_DATA, OPTIONS, FitConfig, LoopConfig, ResumeAt
from raytrain.recipe.data import augment, digits, source
from raytrain.recipe.metrics import HISTORY_KEYS, RESULT_KEYS, EpochMetrics, epoch_line

if TYPE_CHECKING:  # imported where it is used: the CLI loads this module
    from raytrain.recipe.data import pipeline


def _data_threads(plan: raytrain.Plan) -> int:
    """Threads a rank decodes and augments the share it holds with: the CPUs it has, at least one."""
    return max(1, int(plan.cpus_per_worker))


@dataclass(frozen=True)
class ImageClassifier(raytrain.Workload):
    """``cfg`` as the CLI built it; ``src``, the checked data, once ``prepare`` has run."""

    kind = "fit"
    own_dirs = checkpoint_files.OWN_DIRS
    checks_contents = True  # every file's hash is in the checkpoint's meta.json
    whole_for_one = True  # ``shards`` reads through the iterator API alone
    cfg: FitConfig
    src: source.DataSource | None = None
    init: weights.Matched | None = None  # the --weights' tensors that fit the model

    def train_func(self) -> Callable[..., Any]:
        return _train_worker

    def prepare(self, storage: raytrain.Storage) -> ImageClassifier:
        cfg = self.cfg
        columns = {"image_column": cfg.data.image_column, "label_column": cfg.data.label_column}
        if cfg.data.uri == EMBEDDED_DATA:
            src = source.inspect(digits.ensure(storage.fs, storage.root), filesystem=storage.fs, **columns)
        else:
            src = source.inspect(cfg.data.uri, **columns)
        models.check(cfg.model.name)
        data = dataclasses.replace(  # a new DataConfig: the data's augmentation hint is checked as --augment is
            cfg.data,
            image_size=cfg.data.image_size or src.image_size or 224,
            num_classes=src.num_classes,
            classes=src.classes,
            augment=cfg.data.augment or src.augment or augment.DEFAULT,
        )
        resolved = dataclasses.replace(cfg, data=data)
        matched = weights.check(resolved.model, src.num_classes)
        return dataclasses.replace(self, cfg=resolved, src=src, init=matched)

    def _src(self) -> source.DataSource:
        assert self.src is not None, "prepare() first"
        return self.src

    def experiment(self) -> dict[str, Any]:
        return self.cfg.experiment()

    def settings(self) -> dict[str, Any]:
        return self.cfg.to_dict()

    def describe(self) -> list[str]:
        src, data = self._src(), self.cfg.data
        held_out = f"~{data.val_fraction:.0%} held out by hash"
        split = f"{src.val_rows} in its {src.val_split} split" if src.val_files else held_out
        names = ", ".join((data.classes or ())[:5]) + (", ..." if len(data.classes or ()) > 5 else "")
        classes = f"{src.num_classes} classes" + (f" ({src.classes_from}: {names})" if src.classes_from else "")
        own = " (their own size)" if src.image_size_measured and data.image_size == src.image_size else ""
        unlabelled = f"; {src.unlabelled} rows have no label and are left out" if src.unlabelled else ""
        aug = data.augmentation()
        extra = [x for x in (aug.auto and f"auto-augment {aug.auto}", aug.erase and f"random erase {aug.erase:g}") if x]
        lines = [
            f"data: {src.uri}: {src.train_rows} rows ({split}), {classes}, images at {data.image_size}px{own}"
            f"{unlabelled}; training augmentation: {' + '.join([aug.preset, *extra])}"
        ]
        if self.init is not None:
            frozen = "; backbone frozen" if self.cfg.model.freeze_backbone else ""
            lines.append(self.init.line(self.cfg.model.weights or "") + frozen)
        return lines

    def check_workers(self, workers: int) -> None:
        from raytrain.recipe.data import pipeline

        rows = pipeline.train_rows(self._src(), self.cfg.data.val_fraction)
        if rows < workers and not self.cfg.data.synthetic:
            raise raytrain.UserError(
                f"--data {self._src().uri} has about {rows} training rows, fewer than the {workers} workers: "
                f"every worker needs at least one row; use --workers {max(1, rows)} or more data"
            )

    def check_plan(self, plan: raytrain.Plan, *, dry_run: bool) -> list[str]:
        """The model's memory per rank under each strategy (printed by a dry run; a GPU run or a sharded
        one prints its own), and a GPU run whose model state alone exceeds a GPU's memory refused (the
        fewest workers an elastic run may shrink to counted). Data too large for the ranks to hold
        streams: a plan that leaves its reads no whole CPU is refused (judged once Ray has said how much
        object store each node has: the plan made before a local Ray starts does not know it)."""
        from raytrain.recipe import strategy

        if self.cfg.data.stream:
            plan.check_data_cpus("--stream sends the data")
        elif all(n.object_store_bytes for n in plan.nodes) and not self._in_memory(plan):
            plan.check_data_cpus("the data is more than the ranks may hold in memory, so it streams")
        chosen = self.cfg.model.strategy
        data = [self._data_line(plan)] if dry_run else []
        if not (dry_run or plan.use_gpu or chosen == strategy.FSDP):
            return []  # sizing the model costs the driver a second of torchvision: only when it can matter
        est = strategy.estimate(self.cfg, plan.use_gpu)
        if plan.use_gpu:
            gpu_bytes = strategy.gpu_memory()
            for world in sorted({plan.min_workers or plan.workers, plan.workers}):  # elastic: at either end
                strategy.check_fits(est, chosen, world, gpu_bytes)
        return data + strategy.lines(est, chosen, plan.workers, only_chosen=not dry_run)

    def _data_line(self, plan: raytrain.Plan) -> str:
        """Where the data is decoded and with how many CPUs, as a dry run says it: by the ranks (``memory``),
        or by Ray Data's tasks on the CPUs the workers leave on each node (``pipeline``)."""
        cpus_left = plan.cpus_left()
        left = ", ".join(f"{n.hostname} {cpus_left[n.node_id]:g}" for n in plan.nodes)
        threads = _data_threads(plan)
        held = f"held by the ranks, each decoding its share once with {threads} thread{'s' * (threads != 1)}"
        streamed = f"streamed, Ray Data's tasks decoding on the CPUs the workers leave ({left})"
        known = all(n.object_store_bytes for n in plan.nodes)  # not before a local Ray starts
        if self.cfg.data.stream or (known and not self._in_memory(plan)):
            flag = " (--stream)" if self.cfg.data.stream else ""
            kept = "; validation's rows kept by the ranks after its first pass" if self._hold_val(plan) else ""
            return f"data: {streamed}{flag}{kept}"
        if not known:
            return f"data: {held} if it fits their memory, else {streamed}"
        return f"data: {held}"

    def intact(self, fs: Any, path: str) -> bool:
        return checkpoint_files.verify(fs, path)

    def _resume_from(self, run: raytrain.RunDir) -> checkpoint_files.Found | None:
        """The checkpoint the run resumes from: the service's (Ray Train's index, checked), or the newest
        complete one on disk for a run whose index and manifests are gone."""
        if run.resume.latest:
            return checkpoint_files.found_at(run.fs, run.resume.latest)
        return checkpoint_files.latest(run.fs, run.path) if run.existed else None

    def resume_note(self, run: raytrain.RunDir) -> str | None:
        found = self._resume_from(run)
        if found is None:
            return None
        done = f"epoch {found.epoch} of {self.cfg.optim.epochs} done"
        if self._mid_epoch(found):
            trained = found.meta["trained_rows"]
            done += f"; epoch {found.epoch + 1} goes on with the rows it has not trained ({trained} were)"
        return f"resuming from {posixpath.basename(found.path)} ({done})"

    def nothing_to_do(self, run: raytrain.RunDir) -> str | None:
        found = self._resume_from(run)
        if found is None or found.epoch < self.cfg.optim.epochs or found.batches_done:
            return None
        return (
            f"nothing to do: run {run.name!r} already completed {found.epoch} epochs; raise --epochs to train further"
        )

    @staticmethod
    def _memory_budget(plan: raytrain.Plan) -> int:
        """The most decoded bytes the ranks may hold themselves: each node's ranks hold their share of the
        data, within a quarter of that node's object store (the memory Ray was told the node can spare)."""
        ranks = plan.ranks_per_node
        return min(node.object_store_bytes * plan.workers // (4 * ranks[node.node_id]) for node in plan.nodes)

    def _in_memory(self, plan: raytrain.Plan) -> bool:
        from raytrain.recipe.data import pipeline

        if self.cfg.data.stream:
            return False
        return pipeline.fits_in_memory(self._src(), self.cfg.data.image_size or 0, self._memory_budget(plan))

    def _hold_val(self, plan: raytrain.Plan) -> bool:
        """Whether the ranks keep streamed validation rows after their first pass: when twice those fit the
        budget (a rank holds the pass's batches and their concatenation at once, as the pass ends)."""
        from raytrain.recipe.data import pipeline

        data = self.cfg.data
        size = data.image_size or 0
        return 2 * pipeline.val_bytes(self._src(), size, data.val_fraction) <= self._memory_budget(plan)

    def loop_config(self, placed: raytrain.Placed) -> LoopConfig:
        from raytrain.recipe.data import memory

        cfg, run = self.cfg, placed.run
        found = self._resume_from(run)
        data = cfg.data
        assert data.image_size is not None
        held = memory.Spec(self._src(), data.image_size, data.val_fraction, cfg.optim.seed, data.augmentation())
        return LoopConfig(
            config=cfg,
            run_fs=run.fs,
            run_dir=run.path,
            resume=ResumeAt(found.path, self._mid_epoch(found)) if found is not None else None,
            memory=held if self._in_memory(placed.plan) else None,
            hold_val=self._hold_val(placed.plan),
            data_threads=_data_threads(placed.plan),
            steps_per_epoch=self._steps_per_epoch(placed.plan.workers),
            init_weights=self._init_weights() if found is None else None,
        )

    def _init_weights(self) -> Any:
        """The --weights (their tensors that fit) for a run that starts afresh, in Ray's object store: rank 0
        takes them from there, and DDP hands them to the other ranks."""
        if self.init is None:
            return None
        import ray

        return ray.put(self.init.state)

    @staticmethod
    def _mid_epoch(found: checkpoint_files.Found) -> bool:
        """Whether a checkpoint was taken mid-epoch and records the rows that epoch trained."""
        return found.batches_done > 0 and "trained_crc32" in found.meta

    def datasets(self, placed: raytrain.Placed) -> dict[str, Any]:
        """Ray Data's streamed datasets; none when the ranks hold the data themselves (``loop_config``)."""
        from raytrain.recipe.data import idle, pipeline

        if self._in_memory(placed.plan):
            return {}
        cfg = self.cfg
        assert cfg.data.image_size is not None
        streams = pipeline.Streams(
            self._src(),
            image_size=cfg.data.image_size,
            val_fraction=cfg.data.val_fraction,
            aug=cfg.data.augmentation(),
            data_cpus=placed.plan.data_cpus(),
            decode_priority=idle.resolve(cfg.data.decode_priority, use_gpu=placed.plan.use_gpu),
        )
        if cfg.data.synthetic:
            return {pipeline.VAL: streams.val()}
        found = self._resume_from(placed.run)
        datasets = {
            pipeline.TRAIN: TrainFromNewest(
                streams, cfg.optim.seed, placed.run.fs, placed.run.path, first_streamed_epoch(found)
            ),
            pipeline.VAL: streams.val(),
        }
        if found and self._mid_epoch(found):  # the rest of the epoch it stopped in, an order of its own
            trained = checkpoint_files.trained_rows(placed.run.fs, found)
            assert trained is not None  # a mid-epoch checkpoint's meta records its rows
            datasets[pipeline.TRAIN_REST] = streams.rest(pipeline.epoch_seed(cfg.optim.seed, found.epoch), trained)
        return datasets

    def _steps_per_epoch(self, workers: int) -> int:
        """About how many batches each rank trains per epoch (the hash split's share is estimated)."""
        from raytrain.recipe.data import pipeline

        rows = pipeline.train_rows(self._src(), self.cfg.data.val_fraction)
        return max(1, math.ceil((rows // workers) / self.cfg.optim.batch_size))

    def report_line(self, report: raytrain.Report, index: int) -> str:
        return epoch_line(cast(EpochMetrics, report.rank0))

    def after_report(self, report: raytrain.Report, run: raytrain.RunDir) -> str | None:
        """Keep a copy of the checkpoint with the best validation accuracy, whatever --keep rotates out."""
        if report.checkpoint is None or report.rank0.get(checkpoint_files.SCORE) is None:
            return None
        try:
            checkpoint_files.keep_best(run.fs, run.path, report.checkpoint)
        except OSError as exc:
            return f"best checkpoint: not copied ({uri.first_line(exc)}); the run goes on"
        return None

    def finish(self, result: RunResult, run: raytrain.RunDir) -> RunResult:
        """Progress by the recipe's own checkpoints (a mid-epoch one counts the epochs it completed)."""
        latest = checkpoint_files.latest(run.fs, run.path)
        best = checkpoint_files.best(run.fs, run.path)
        return dataclasses.replace(
            result,
            epochs_completed=latest.epoch if latest else 0,
            epochs=self.cfg.optim.epochs,
            last_checkpoint=latest.path if latest else None,
            best_checkpoint=best.path if best else None,
            final={k: result.final.get(k) for k in RESULT_KEYS} if result.history else {},
            history=[{k: m.get(k) for k in HISTORY_KEYS} for m in result.history],
        )

    def with_params(self, params: Mapping[str, Any]) -> ImageClassifier:
        return dataclasses.replace(self, cfg=self.cfg.with_options(params))

    def check_space(self, space: raytrain.SearchSpace) -> None:
        """Every parameter is an option of ``raytrain fit`` (by its name without dashes, as ``lr`` or
        ``batch_size``), drawn as its type allows, and the ends of each range are values it takes."""
        known = {o.param: o for o in OPTIONS}
        for p in space.params:
            option = known.get(p.name)
            if option is None:
                close = difflib.get_close_matches(p.name, known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise raytrain.UserError(
                    f"--param {p.name}: the built-in classifier has no such option{hint}: sweep its options by "
                    "their names without dashes (lr, batch_size, weight_decay, model, ...; raytrain fit -h lists them)"
                )
            if (why := option.sweepable_by(p.kind)) is not None:
                raise raytrain.UserError(f"--param {p}: {why}")
        super().check_space(space)

    def streams(self, plan: raytrain.Plan) -> bool:
        """Known once Ray has said how much object store each node has (else: not known, so not assumed)."""
        return all(n.object_store_bytes for n in plan.nodes) and not self._in_memory(plan)

    def metrics(self) -> tuple[str, ...]:
        return (*HISTORY_KEYS, "lr")

    def sweep_clock(self) -> tuple[str, int | None]:
        return "epoch", self.cfg.optim.epochs

    def done_line(self, result: RunResult) -> str:
        nodes = len({p.hostname for p in result.placement})
        best = f" (best: {posixpath.basename(result.best_checkpoint)})" if result.best_checkpoint else ""
        return (
            f"done: {result.epochs_completed} epochs, val_acc {100 * (result.final.get('val_acc') or 0):.1f}%{best}, "
            f"{result.world_size} worker{'s' if result.world_size != 1 else ''} on {nodes} node(s), "
            f"{result.wall_time_s:.0f} s"
        )


@dataclass(frozen=True)
class TrainFromNewest:
    """The training dataset as Ray Train is handed it: made again each time Ray Train starts the workers
    (a callable, which Ray Train calls in its controller then), seeded by the epoch its first pass trains,
    read from the run's newest complete checkpoint at that moment (``first_streamed_epoch``).

    Ray Data numbers a dataset's executions from 0 in each copy of it, and Ray Train hands every worker
    group a new copy: one dataset made by the driver gave a group restarted after a failure, or resized,
    the orders of the attempt's first epochs again (seeded by the epoch the driver resumed at).

    The first group starts where the driver resumed (``resumed``: from the checkpoint it checked whole).
    For a later one, the newest checkpoint is the one the workers start from: raytrain's service callback,
    which Ray Train calls first, has registered any whole checkpoint Ray Train did not collect. Where they
    differ (the newest is damaged, and the workers fall back past it), the epochs get orders under another
    key, which a later restart may give another epoch again; every row is still trained once an epoch.
    Storage that fails or does not answer within ``_LOOK_S`` leaves the seed at ``resumed`` rather than
    holding up or failing the workers' start (their own read of the checkpoint reports the storage).

    Built in the controller, under its Ray Data context, not the driver's: raytrain puts Ray Data's
    settings in every Ray process's environment (``contracts.env``), and ``Streams`` sets the rest on the
    dataset itself."""

    streams: pipeline.Streams  # the run's data
    seed: int
    run_fs: Any
    run_dir: str
    resumed: int  # ``first_streamed_epoch`` of the checkpoint the driver resumed from
    calls: list[int] = dataclasses.field(default_factory=lambda: [0], compare=False, repr=False)  # groups started

    def __call__(self) -> Any:
        from raytrain.recipe.data import pipeline

        self.calls[0] += 1
        try:
            newest = functools.partial(checkpoint_files.latest, self.run_fs, self.run_dir)
            epoch = self.resumed if self.calls[0] == 1 else first_streamed_epoch(fsio.bounded(newest, _LOOK, _LOOK_S))
        except (OSError, ValueError, raytrain.UserError) as exc:  # fsio.StorageError is a UserError
            print(
                f"raytrain: the newest checkpoint could not be read ({uri.first_line(exc)}): the training data's "
                f"order is keyed on epoch {self.resumed + 1}, where the run resumed",
                flush=True,
            )
            epoch = self.resumed
        return self.streams.train(pipeline.epoch_seed(self.seed, epoch))


_LOOK, _LOOK_S = "looking for the newest checkpoint", 15.0


def first_streamed_epoch(found: checkpoint_files.Found | None) -> int:
    """The epoch (from 0) that the training dataset's first pass trains after resuming from ``found``: its
    next one, after a mid-epoch checkpoint that records its rows (the rest of the epoch is a dataset of
    its own, seeded by that epoch, ``TRAIN_REST``); else the epoch it resumes in."""
    if found is None:
        return 0
    return found.epoch + 1 if ImageClassifier._mid_epoch(found) else found.epoch


def _train_worker(config: LoopConfig) -> None:
    """Each worker's training. Named here, not in ``train_loop``: Ray Train's controller unpickles the run's
    config, this reference with it, and importing ``train_loop`` there would load torch (3 s of CPU) in a
    process that never trains."""
    from raytrain.recipe.train_loop import train_worker

    train_worker(config)
