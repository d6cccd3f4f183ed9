"""The training loop: host tables + sparse optimizers, device MLP + dense optimizer.

One step: forward (host lookups, rows to the device, device compute), logistic loss, backward
(sparse gradients land on the host), a finiteness check of the loss, then the dense and sparse
optimizer steps. Checkpoints hold everything needed to continue bit for bit: model (tables
included), optimizer states, the data position ``(epoch, batch)``, the RNG states and the history
(:mod:`hetero.train.resumable`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetero import ps
from hetero.data.rows import BadRowCount
from hetero.data.tabular import Batch, EvalData, TrainingData
from hetero.embedding import Prefetcher, dense_parameters, drop_started_lookups, start_lookups
from hetero.embedding.prefetch import looked_up_at_step
from hetero.optim import SparseOptimizer
from hetero.optim.container import OptimizersContainer
from hetero.optim.host_state import AveragesReplicas
from hetero.parallel import (
    DataParallelGroup, DistributedSparse, ParallelDims, ParallelPlan, check_replicas, global_rank, parallelize, rank,
    world_size,
)
from hetero.parallel.pipeline import Pipeline
from hetero.parallel.step import train_step
from hetero.parallel.sharded_keys import dynamic_stats, sharded_keymaps
from hetero.placement import copy_to
from hetero.train.config import CheckpointFormat, TrainConfig
from hetero.train.report import binary_metrics, write_report
from hetero.train.resumable import TrainerCheckpoints, new_run_uid
from hetero.train.scalars import ScalarLog
from hetero.train.tier import TierCheckpoint

log = logging.getLogger("hetero")


class Trainer(TrainerCheckpoints):
    """Train a model whose ``forward(features, dense)`` returns logits, on a binary label.

    Args:
        model: already on its device (host tables stay on the host by construction).
        dense_optimizer: a ``torch.optim`` optimizer over ``dense_parameters(model)``.
        sparse_optimizers: name -> :class:`SparseOptimizer` (e.g. ``{"wide": FTRL, "deep": LazyAdam}``).
        train: the training batches (:class:`~hetero.data.tabular.TrainingData`: in memory, a
            prepared cache, or a stream); ``valid``/``test`` (:class:`~hetero.data.tabular.EvalData`):
            evaluated each epoch / at the end.
        run_dir: where the checkpoint, ``metrics.json``, ``losses.csv`` and ``curves.png`` go.
        on_step: called after every step (and its checkpoint, if one is due) with the trainer.
        pipeline: the model pipelined (:func:`hetero.parallel.pipeline.pipeline`, one stage per
            rank, every rank reading the whole batch); ``model`` is then this rank's stage and
            the optimizers hold its parameters and tables. A batch is cut into the pipeline's
            micro-batches; a short last batch is padded to the full size by repeating its first
            sample with loss weight 0 (its rows are in the batch already: no other row or
            parameter moves). The integrated checkpoint holds the whole model, as without a
            pipeline, and resumes at any pipeline degree.
        record: the run's record (:meth:`hetero.record.RunRecord.to_state`), written into every
            checkpoint; a resume from a checkpoint whose record differs in the model, encoding
            or reader settings is refused before anything is loaded.
        run_files: text files (name -> text, e.g. ``config.toml``) rank 0 writes atomically into
            ``run_dir`` with every checkpoint.
        dp: the data-parallel ranks (:class:`~hetero.parallel.env.DataParallelGroup`; default
            the whole job): DDP's, the sparse-gradient exchange's, the loss average's.
        ps_job: the parameter-server job (:class:`~hetero.ps.PSJob`) when the tables live on
            servers (this process is one of its workers; ``dp`` is then its workers' group).
        bad_rows: the count of rows its data's readers skipped as bad (reported as
            ``bad_rows``, and said in the last log line; ``None``: not counted, reported null).

    Raises:
        ValueError: a pipeline with the sharded checkpoint format, several stages per rank, or
            multi-hot features.
    """

    def __init__(
        self,
        model: nn.Module,
        dense_optimizer: torch.optim.Optimizer,
        sparse_optimizers: Mapping[str, SparseOptimizer],
        train: TrainingData,
        valid: EvalData,
        test: EvalData,
        config: TrainConfig,
        run_dir: str | Path,
        on_step: Callable[["Trainer"], None] | None = None,
        pipeline: Pipeline | None = None,
        record: Mapping[str, Any] | None = None,
        run_files: Mapping[str, str] | None = None,
        dp: DataParallelGroup = DataParallelGroup(),
        ps_job: ps.PSJob | None = None,
        bad_rows: BadRowCount | None = None,
    ) -> None:
        if pipeline is not None and (config.checkpoint_format is CheckpointFormat.SHARDED or len(pipeline.modules) > 1):
            raise ValueError("a pipelined trainer runs one stage per rank and writes integrated checkpoints: use a "
                             "non-interleaved schedule and checkpoint_format=CheckpointFormat.INTEGRATED")
        bags = sorted(train.multi_hot)
        if pipeline is not None and bags:
            raise ValueError(f"a pipeline cuts each batch into micro-batches by rows, which cannot cut the multi-hot "
                             f"features {bags} (bags) yet: train them without a pipeline")
        self.model, self.pipeline = model, pipeline
        # Data parallel over dp (nothing on one rank): DDP for the dense part; host tables replicated
        # (exchanged sparse gradients) or row-sharded (hetero.parallel.shard_rows, before the optimizers).
        self.dp, self.ps_job = (ps_job.dp, ps_job) if ps_job is not None else (dp, None)
        check_replicas(model, self.dp)  # ranks must start from identical replicated tables (same seed)
        # (an optimizer that averages its parameters' gradients itself - HostAdamW - keeps them out of DDP)
        own = dense_optimizer.replica_averaged_parameters() if isinstance(dense_optimizer, AveragesReplicas) else ()
        self.net = model if pipeline is not None else parallelize(model, ParallelDims.of_group(self.dp), ParallelPlan(
            dense=None, data_parallel=config.data_parallel, replica_host=frozenset(own))).net  # its step 7: DDP
        # Tables on parameter servers (hetero.ps): the optimizers' steps become pushes.
        self.remote = ps.remote_tables(model)
        if self.remote and self.ps_job is None:
            raise ValueError("the model's tables are on parameter servers: pass the job (ps_job=PSJob)")
        if self.remote and config.checkpoint_format is not CheckpointFormat.SHARDED:
            raise ValueError("tables on parameter servers are checkpointed by the servers, each its shard: use "
                             "checkpoint_format=CheckpointFormat.SHARDED (--checkpoint-format sharded)")
        # One container: the dense optimizer, the sparse ones and what steps them across the ranks
        # (the sparse-gradient exchange) or to the servers (pushes, first: the servers work meanwhile).
        self.optimizers = OptimizersContainer(
            dense=dense_optimizer, sparse=sparse_optimizers, remote=self.remote,
            steppers={k: ps.PSSparse(o) if self.remote else DistributedSparse(o, group=self.dp) if self.dp.active else o
                      for k, o in sparse_optimizers.items()})
        self.train, self.valid, self.test, self.config = train, valid, test, config
        self.run_dir = Path(run_dir)
        self.checkpoint_path = self.run_dir / config.checkpoint_format.file_name
        self.device = next(p.device for p in dense_parameters(model))
        self.epoch, self.batch, self.global_step = 0, 0, 0
        self.run_uid = new_run_uid(self.dp)  # names the run in its checkpoints and exports (a resume keeps it)
        self.losses: list[float] = []
        self.history: dict[str, list] = {"epoch": [], "valid_auc": [], "valid_logloss": [], "steps": []}
        self.train_seconds, self.train_samples = 0.0, 0
        self.best_path = self.run_dir / config.checkpoint_format.best_name
        self.best: dict[str, Any] = {"score": None, "epoch": 0, "stopped": False}  # early stopping's record
        self.on_step = on_step
        self.bad_rows = bad_rows
        self.record, self.run_files = record, dict(run_files or {})
        self.scalars = ScalarLog(self.run_dir / "tensorboard") if config.tensorboard and global_rank() == 0 else None
        self._identity = train.identity()  # read once (a dataset's checksum is a pass over it)
        self.tier = TierCheckpoint(model, self.run_dir, rank(), world_size())  # tables on the SSD tier, if any
        if self.tier and config.checkpoint_format is CheckpointFormat.SHARDED:
            raise ValueError("tables on the SSD tier are checkpointed as the tier's snapshots beside an integrated "
                             "checkpoint: use checkpoint_format=CheckpointFormat.INTEGRATED")

    def _step(self, batch: Batch, upcoming: Batch | None = None) -> float:
        def loss_fn(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
            # Weighted by the global batch, not averaged per rank: the last batch's shares are unequal
            # or empty, and N ranks must still equal one process (an empty share adds 0, not NaN).
            loss_sum = nn.functional.binary_cross_entropy_with_logits(logits, copy_to(label, self.device), reduction="sum")
            return self.dp.batch_mean(loss_sum, batch.global_size)

        # Tables on parameter servers: the next batch's pulls go out with this step's pushes.
        between = (lambda: start_lookups(self.model, upcoming.features)) if self.remote and upcoming is not None else None
        pipelined = (lambda: self._pipelined_forward_backward(batch)) if self.pipeline is not None else None
        # measure: sync point, the host needs the global loss to decide whether to step
        return train_step(self.net, [((batch.features, batch.dense), batch.label)], loss_fn, self.optimizers,
                          measure=self.dp.mean, check=self._check_finite, forward_backward=pipelined, between=between)

    def _check_finite(self, value: float) -> None:
        if not math.isfinite(value):
            where = (f"the last checkpoint {self.checkpoint_path} is intact: lower the learning rates or check the "
                     f"input, then --resume" if self.has_checkpoint() else
                     "no checkpoint was written yet: lower the learning rates or check the input and start again")
            raise FloatingPointError(
                f"loss is {value} at epoch {self.epoch}, batch {self.batch} (step {self.global_step + 1}); "
                f"training stopped before applying this step; {where}"
            )

    def _pipelined_forward_backward(self, batch: Batch) -> float:
        """Forward and backward of ``batch`` through the pipeline; the batch loss on every rank.
        The target is ``(B, 2)``: the label and a loss weight (1, or ``B / R`` for the ``R`` real
        samples of a padded last batch and 0 for its padding), which :func:`weighted_bce`
        applies: the micro-batches' losses sum to the mean over the real samples."""
        full, real = self.train.config.batch_size, len(batch)
        index = torch.cat([torch.arange(real), torch.zeros(full - real, dtype=torch.int64)])
        weight = torch.cat([torch.full((real,), full / real), torch.zeros(full - real)])
        features = {k: v if real == full else v[index] for k, v in batch.features.items()}
        dense, label = (batch.dense, batch.label) if real == full else (batch.dense[index], batch.label[index])
        target = copy_to(torch.stack([label.float(), weight], dim=1), self.device)
        return self.pipeline.step((), target, features=features, dense=dense)  # torch takes a mapping as a keyword

    def fit(self) -> dict[str, Any]:
        """Train from the current position to the end; return the metrics also written to ``metrics.json``.

        Raises:
            FloatingPointError: a NaN/Inf loss; nothing of that step is applied and no checkpoint
                is written after it.
        """
        from tqdm.auto import tqdm

        start = time.perf_counter()
        cfg, stop, steps_this_run = self.config, False, 0
        # a row-sharded dynamic table's counts are summed over the ranks: a collective every rank runs
        every_rank = bool(sharded_keymaps(self.model))
        at_step = looked_up_at_step(self.model) if cfg.prefetch else []
        if at_step:
            log.info("hetero: prefetch: dynamic tables %s are looked up at their step, not ahead", at_step)
        if self.scalars is not None or every_rank:
            stats = dynamic_stats(self.model)
            if self.scalars is not None:
                self.scalars.dynamic_start(stats)  # (a resumed run's counts so far)
        while self.epoch < cfg.epochs and not stop and not self.best["stopped"]:
            total = self.train.num_samples
            done = self.batch * self.train.config.batch_size
            bar = tqdm(total=total, initial=done if total is None else min(done, total),
                       unit="sample", unit_scale=True, desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
                       disable=not cfg.progress, leave=False)
            self.model.train()
            batches = self.train.epoch(self.epoch, start=self.batch)
            if cfg.prefetch:
                batches = Prefetcher(self.model, batches)
            # Tables on parameter servers: each step starts the next batch's lookups (one batch read
            # ahead), except for dynamic tables, whose key lookups count sightings and admit keys at
            # the servers: a batch never trained (max_steps) or trained again (a resume) would count twice.
            ahead = self.remote and not cfg.prefetch and self.pipeline is None and not looked_up_at_step(self.model)
            for batch, upcoming in _with_next(batches) if ahead else ((b, None) for b in batches):
                t0 = time.perf_counter()
                steps_this_run += 1
                measured = self.scalars is not None and self.scalars.sampled(steps_this_run, self.batch,
                                                                             cfg.warmup_steps)
                loss = self.scalars.traffic(self.global_step + 1, lambda: self._step(batch, upcoming), self.net,
                                            self.dp.size) if measured else self._step(batch, upcoming)
                if steps_this_run > cfg.warmup_steps and not measured:  # steady state: no compilation, no counting
                    self.train_seconds += time.perf_counter() - t0
                    self.train_samples += len(batch)
                self.losses.append(loss)
                self.batch += 1
                self.global_step += 1
                bar.update(len(batch))
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                if cfg.checkpoint_every and self.global_step % cfg.checkpoint_every == 0:
                    self.save()
                if self.scalars is not None:
                    self.scalars.step(self.global_step, loss, {"dense": self.optimizers.dense, **self.optimizers.sparse},
                                      self.train_samples / self.train_seconds if self.train_seconds else None)
                if self.scalars is not None or every_rank:
                    stats = dynamic_stats(self.model)
                    if self.scalars is not None:
                        self.scalars.dynamic_tables(self.global_step, stats)
                if self.on_step is not None:
                    self.on_step(self)
                if cfg.max_steps is not None and self.global_step >= cfg.max_steps:
                    stop = True
                    break
            if self.remote:  # the last step's pushes travel with the next pulls: send them now, every worker alike
                self.optimizers.flush()  # (a started pull of a batch not trained - max_steps - read and dropped)
                drop_started_lookups(self.model)
            bar.close()
            improved = False
            if not stop:
                try:
                    metrics = self.evaluate(self.valid)
                except Exception:  # the trained epoch is kept before the error goes up: a resume starts after it
                    self.epoch, self.batch = self.epoch + 1, 0
                    self.save()
                    raise
                self.history["epoch"].append(self.epoch + 1)
                self.history["valid_auc"].append(metrics["auc"])
                self.history["valid_logloss"].append(metrics["logloss"])
                self.history.setdefault("steps", []).append(self.global_step)  # (an older checkpoint's has none)
                rate = f"{self.train_samples / self.train_seconds:.0f} samples/s" if self.train_seconds else "rate after warm-up"
                log.info("hetero: epoch %d valid auc %s logloss %s (%s)", self.epoch + 1,
                         _fmt(metrics["auc"]), _fmt(metrics["logloss"]), rate)
                improved = self._track_best(metrics)
                if self.scalars is not None:
                    self.scalars.metrics("valid", self.global_step, metrics)
                self.epoch, self.batch = self.epoch + 1, 0
            self.save()
            if improved and (cfg.keep_best or cfg.patience):
                self.save(self.best_path)  # the state at the end of the best epoch
        return self._finish(time.perf_counter() - start)

    def _track_best(self, metrics: Mapping[str, float | None]) -> bool:
        """Record this epoch's validation score; whether it is the best so far. Sets
        ``best["stopped"]`` after ``patience`` epochs without a better one."""
        score = metrics["auc"] if metrics["auc"] is not None else -metrics["logloss"]
        if self.best["score"] is None or score > self.best["score"]:
            self.best.update(score=score, epoch=self.epoch + 1)
            return True
        if self.config.patience and self.epoch + 1 - self.best["epoch"] >= self.config.patience:
            self.best["stopped"] = True
            log.info("hetero: early stop after epoch %d: no better validation score in %d epochs (best: epoch %d)",
                     self.epoch + 1, self.config.patience, self.best["epoch"])
        return False

    @torch.no_grad()
    def evaluate(self, data: EvalData) -> dict[str, float]:
        self.model.eval()
        probs, labels = [], []
        forward = self.pipeline.forward if self.pipeline is not None else self.model  # (through the stages)
        for b in data.batches(self.config.eval_batch_size):
            probs.append(torch.sigmoid(forward(b.features, b.dense)).cpu())  # sync point: metrics run on the host
            labels.append(b.label)
        self.model.train()
        if not probs:
            raise ValueError("the evaluation data has no samples: give a validation/test file or split with rows")
        return binary_metrics(torch.cat(labels).numpy(), torch.cat(probs).numpy())

    def _finish(self, wall_seconds: float) -> dict[str, Any]:
        best = self.config.keep_best or self.config.patience
        # the run's dynamic tables as trained (before the best epoch's state is loaded to score the test
        # split); a collective where row-sharded: every rank runs it here
        dynamic = dynamic_stats(self.model)
        if best and self.best["epoch"] and self.best["epoch"] != self.epoch:
            # the test split is scored by the best epoch's model: restore its checkpoint, keeping
            # this run's record of what happened after it for the report
            record = (self.epoch, self.batch, self.global_step, self.losses, self.history, self.best)
            self.load(self.best_path)
            log.info("hetero: the test split is scored by the best epoch's model (epoch %d of %d, by validation AUC): "
                     "%s", self.best["epoch"], record[0], self.best_path)
            self.epoch, self.batch, self.global_step, self.losses, self.history, self.best = record
        scored = self.best["epoch"] if best and self.best["epoch"] else self.epoch
        test = self.evaluate(self.test)
        if self.scalars is not None:
            self.scalars.metrics("test", self.global_step, test)
            self.scalars.close()
        if global_rank() != 0:
            return {"test_auc": test["auc"], "test_logloss": test["logloss"]}
        metrics = {
            "test_auc": test["auc"],
            "test_logloss": test["logloss"],
            # steady state (see warmup_steps); null when the run was too short to measure one
            "samples_per_s": self.train_samples / self.train_seconds if self.train_seconds else None,
            "wall_time_s": wall_seconds,  # of this invocation (a resumed run counts from its restart)
            "steps": self.global_step,
            "epochs": self.epoch,
            "device": str(self.device),
            "world_size": self.dp.size,  # data-parallel ranks
            "pipeline_stages": 1 if self.pipeline is None else self.pipeline.num_stages,
            "checkpoint": str(self.checkpoint_path),
            "history": self.history,
            "best_epoch": self.best["epoch"] or None,  # of the validation score; the test split's model with keep_best
            "test_epoch": scored,  # the epoch whose model scored the test split
            "stopped_early": self.best["stopped"],
            # rows the readers skipped as bad (on_bad_rows = "skip"; a stream's: as read, each epoch)
            "bad_rows": None if self.bad_rows is None else self.bad_rows.rows,
            # each dynamic table's keys admitted, rows evicted, lookups of the default row, rows held
            "dynamic_tables": {name: vars(stats) for name, stats in dynamic.items()},
        }
        if self.remote:  # this worker's pulls sent ahead of their lookup: taken by it, or read and dropped
            clients = [c for opt in self.optimizers.steppers.values() for c in opt.clients]
            metrics["ps_started_pulls"] = {"taken": sum(c.starts_taken for c in clients),
                                           "dropped": sum(c.starts_dropped for c in clients)}
        if self.bad_rows is not None and self.bad_rows.rows:
            log.warning("hetero: %d rows skipped as bad (on_bad_rows = \"skip\"); the first: %s", self.bad_rows.rows,
                        self.bad_rows.first)
        return write_report(self.run_dir, self.losses, metrics)


def weighted_bce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The logistic loss of a pipelined micro-batch: ``logits (b,)``, ``target (b, 2)`` holding
    the label and the sample's loss weight (see :meth:`Trainer._pipelined_forward_backward`);
    the mean of weight x loss over the micro-batch."""
    loss = nn.functional.binary_cross_entropy_with_logits(logits, target[:, 0], reduction="none")
    return (loss * target[:, 1]).mean()


def _fmt(metric: float | None) -> str:
    return "undefined" if metric is None else f"{metric:.4f}"


def _with_next(batches: Iterable[Batch]) -> Iterator[tuple[Batch, Batch | None]]:
    """Each batch with the one after it (``None`` after the last)."""
    it = iter(batches)
    batch = next(it, None)
    while batch is not None:
        upcoming = next(it, None)
        yield batch, upcoming
        batch = upcoming
