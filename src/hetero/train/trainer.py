"""The training loop: host tables + sparse optimizers, device MLP + dense optimizer.

One step: forward (host lookups, rows to the device, device compute), logistic loss, backward
(sparse gradients land on the host), a finiteness check of the loss, then the dense and sparse
optimizer steps. Checkpoints hold everything needed to continue bit for bit: model (tables
included), optimizer states, the data position ``(epoch, batch)``, the RNG states and the history.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetero import ps
from hetero.checkpoint import CheckpointError, check_model_compatible, load_checkpoint, save_checkpoint
from hetero.checkpoint.io import write_text_atomic
from hetero.checkpoint.sharded import load_sharded, read_bytes, resolve, save_sharded
from hetero.data.tabular import Batch, EvalData, TrainingData
from hetero.embedding import Prefetcher, dense_parameters
from hetero.optim import SparseOptimizer
from hetero.optim.host_state import AveragesReplicas
from hetero.parallel import (
    DataParallelGroup, DistributedSparse, ParallelDims, ParallelPlan, check_replicas, full_model_state,
    full_optimizer_state, global_rank, global_shapes, load_full_optimizer_state, local_model_state, parallelize, rank,
    world_size,
)
from hetero.record import RECORD_KEY, check_record
from hetero.parallel.pipeline import Pipeline
from hetero.placement import copy_to
from hetero.train.checkpointing import (
    read_extra, sharded_state, stage_optimizer_state, whole_model_shapes, whole_model_state, whole_optimizer_state,
)
from hetero.train.config import CheckpointFormat, TrainConfig
from hetero.train.report import binary_metrics, write_report
from hetero.train.scalars import ScalarLog
from hetero.train.tier import TierCheckpoint

log = logging.getLogger("hetero")
FORMAT_VERSION = 1


class Trainer:
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
    ) -> None:
        if pipeline is not None and (config.checkpoint_format is CheckpointFormat.SHARDED or len(pipeline.modules) > 1):
            raise ValueError("a pipelined trainer runs one stage per rank and writes integrated checkpoints: use a "
                             "non-interleaved schedule and checkpoint_format=CheckpointFormat.INTEGRATED")
        bags = sorted(train.multi_hot)
        if pipeline is not None and bags:
            raise ValueError(f"a pipeline cuts each batch into micro-batches by rows, which cannot cut the multi-hot "
                             f"features {bags} (bags) yet: train them without a pipeline")
        self.model, self.dense_optimizer, self.pipeline = model, dense_optimizer, pipeline
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
        self.sparse_optimizers = {k: ps.PSSparse(o) if self.remote else
                                  DistributedSparse(o, group=self.dp) if self.dp.active else o
                                  for k, o in sparse_optimizers.items()}
        # The optimizers themselves (unwrapped): their state, checks and hyper-parameters.
        self.sparse_optimizer_objects: dict[str, SparseOptimizer] = dict(sparse_optimizers)
        self.train, self.valid, self.test, self.config = train, valid, test, config
        self.run_dir = Path(run_dir)
        self.checkpoint_path = self.run_dir / config.checkpoint_format.file_name
        self.device = next(p.device for p in dense_parameters(model))
        self.epoch, self.batch, self.global_step = 0, 0, 0
        self.losses: list[float] = []
        self.history: dict[str, list] = {"epoch": [], "valid_auc": [], "valid_logloss": []}
        self.train_seconds, self.train_samples = 0.0, 0
        self.best_path = self.run_dir / config.checkpoint_format.best_name
        self.best: dict[str, Any] = {"score": None, "epoch": 0, "stopped": False}  # early stopping's record
        self.on_step = on_step
        self.record, self.run_files = record, dict(run_files or {})
        self.scalars = ScalarLog(self.run_dir / "tensorboard") if config.tensorboard and global_rank() == 0 else None
        self._identity = train.identity()  # read once (a dataset's checksum is a pass over it)
        self.tier = TierCheckpoint(model, self.run_dir, rank(), world_size())  # tables on the SSD tier, if any
        if self.tier and config.checkpoint_format is CheckpointFormat.SHARDED:
            raise ValueError("tables on the SSD tier are checkpointed as the tier's snapshots beside an integrated "
                             "checkpoint: use checkpoint_format=CheckpointFormat.INTEGRATED")

    def state_dict(self, tables: bool = True) -> dict[str, Any]:
        """Everything needed to continue bit for bit, tensors whole (the integrated layout).

        ``tables=False`` leaves out the model and the sparse optimizers' row state (what the
        sharded layout stores as tensors of its own) and needs no collective.
        """
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        state = {"format_version": FORMAT_VERSION, "run": self.run_identity()}
        if self.record is not None:
            state[RECORD_KEY] = self.record
        dense = full_optimizer_state(self.dense_optimizer)  # operator-parallel shards gathered
        if tables:
            state["model"] = full_model_state(self.model)  # row-sharded tables gathered whole (collective)
        if self.pipeline is not None:  # the stages' parts gathered whole on pp rank 0, the writer (None elsewhere)
            state["model"] = whole_model_state(self.pipeline.group, state["model"])
            dense = whole_optimizer_state(self.pipeline.group, dense)
        state.update({
            "dense_optimizer": dense,
            "sparse_optimizers": {k: o.state_dict(include_state=tables) for k, o in self.sparse_optimizers.items()},
            "position": {"epoch": self.epoch, "batch": self.batch, "global_step": self.global_step},
            "rng": rng,
            "losses": torch.tensor(self.losses, dtype=torch.float64),
            "history": self.history,
            "throughput": {"train_seconds": self.train_seconds, "train_samples": self.train_samples},
            "best": dict(self.best),
        })
        return state

    def run_identity(self) -> dict[str, Any]:
        """What names the samples behind a data position: the batching config and the training
        data (:meth:`TrainingData.identity`). Saved in checkpoints; a resume that differs is refused."""
        return dict(self._identity)

    def check_resumable(self, state: Mapping[str, Any], path: Path) -> None:
        """Check, changing nothing, that ``state`` (a :meth:`state_dict`) continues this run.

        Raises:
            CheckpointError: another batching or training data (naming the setting, both values and
                the fix), another model, or optimizers that do not fit.
        """
        saved, ours = state.get("run"), self.run_identity()
        if saved is None:
            raise CheckpointError(f"checkpoint {path} holds no run configuration (written before hetero saved one); "
                                  f"its data position cannot be checked: start a new run")
        names = {"batch_size": ("global batch size", "--batch-size"), "seed": ("seed", "--seed"),
                 "shuffle": ("shuffle", "the batching config"), "drop_last": ("drop_last", "the batching config")}
        for key, (what, flag) in names.items():
            if saved.get(key) != ours[key]:
                raise CheckpointError(
                    f"checkpoint {path} was saved with {what} {saved.get(key)} and this run has {ours[key]} ({flag}): "
                    f"its data position (epoch {state['position']['epoch']}, batch {state['position']['batch']}) would "
                    f"name other samples{' and the seed draws another data split' if key == 'seed' else ''}; resume "
                    f"with {flag} {saved.get(key)}")
        data = sorted(k for k in set(saved) | set(ours) if k not in names and saved.get(k) != ours.get(k))
        if data:
            show = lambda run: ", ".join(f"{k} {run.get(k)!r}" for k in data)  # noqa: E731
            raise CheckpointError(
                f"checkpoint {path} was trained on other data ({show(saved)}; this run has {show(ours)}): another "
                f"data file, vocabulary, split{', world size' if 'world_size' in data else ''} or stream setting; "
                f"resume with the data it was saved with")
        if "model" in state:
            check_model_compatible(global_shapes(self.model), state["model"], path)
        groups, saved_groups = self.dense_optimizer.param_groups, state["dense_optimizer"]["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
            raise CheckpointError(f"checkpoint {path}: the dense optimizer's parameter groups differ from this run's")
        for k, opt in self.sparse_optimizer_objects.items():
            if k not in state["sparse_optimizers"]:
                raise CheckpointError(f"checkpoint {path} has no sparse optimizer {k!r}")
            try:
                opt.check_state_dict(state["sparse_optimizers"][k])
            except ValueError as e:
                raise CheckpointError(f"checkpoint {path}: {e}") from e
        if self.record is not None:  # the run record last: whatever the checks above do not name (a transform,
            check_record(state, self.record, path)  # the reader settings)

    def _hyper_parameters(self) -> dict[str, dict[str, Any]]:
        out = {f"dense_optimizer group {i}": {k: v for k, v in g.items() if k != "params"}
               for i, g in enumerate(self.dense_optimizer.param_groups)}
        out.update({f"sparse optimizer {k!r}": dict(o.hyper) for k, o in self.sparse_optimizer_objects.items()})
        return out

    def _restore_hyper_parameters(self, ours: dict[str, dict[str, Any]]) -> None:
        """After a load: this run's hyper-parameters win over the checkpoint's (a resume with lower
        learning rates is the fix for a diverged run), each change logged once."""
        targets = {f"dense_optimizer group {i}": g for i, g in enumerate(self.dense_optimizer.param_groups)}
        targets.update({f"sparse optimizer {k!r}": o.hyper for k, o in self.sparse_optimizer_objects.items()})
        for where, values in ours.items():
            group = targets[where]
            for key, value in values.items():
                if group.get(key) != value:
                    log.info("hetero: resume: %s %s = %r (this run's; the checkpoint had %r)", where, key, value,
                             group.get(key))
                    group[key] = value

    def _stage_view(self, state: Mapping[str, Any], path: Path) -> dict[str, Any]:
        """A whole model's checkpoint cut to this pipeline stage's parameters and dense optimizer
        state (collectives over pp; every rank raises alike, before any changes)."""
        group = self.pipeline.group
        check_model_compatible(whole_model_shapes(group, global_shapes(self.model)), state["model"], path)
        try:
            dense = stage_optimizer_state(group, state["dense_optimizer"], self.dense_optimizer.state_dict())
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from e
        own = self.model.state_dict()
        return {**state, "model": {k: v for k, v in state["model"].items() if k in own}, "dense_optimizer": dense}

    def load_state_dict(self, state: Mapping[str, Any], path: Path) -> None:
        """Restore a :meth:`state_dict` after :meth:`check_resumable` (nothing is changed when
        that raises); without ``"model"`` (the sharded layout) the tables and the model were
        loaded in place already. This run's hyper-parameters are kept (logged where they differ)."""
        if self.pipeline is not None:
            state = self._stage_view(state, path)
        self.check_resumable(state, path)
        tier = self.tier.check(state.get("tier"), path)  # every snapshot read and checked before anything changes
        ours = self._hyper_parameters()
        if "model" in state:
            self.model.load_state_dict(local_model_state(self.model, state["model"]))  # this rank's rows of sharded tables
        load_full_optimizer_state(self.dense_optimizer, state["dense_optimizer"])
        for k, opt in self.sparse_optimizers.items():
            opt.load_state_dict(state["sparse_optimizers"][k])
        self._restore_hyper_parameters(ours)
        pos = state["position"]
        self.epoch, self.batch, self.global_step = pos["epoch"], pos["batch"], pos["global_step"]
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.losses = state["losses"].tolist()
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.train_seconds = state["throughput"]["train_seconds"]
        self.train_samples = state["throughput"]["train_samples"]
        self.best = dict(state.get("best", {"score": None, "epoch": 0, "stopped": False}))  # (older checkpoints)
        self.tier.restore(tier)

    def save(self, path: Path | None = None) -> Path:
        """Write the checkpoint in ``config.checkpoint_format`` to ``path`` (default: the run's
        checkpoint); every rank calls it."""
        path = path or self.checkpoint_path
        if global_rank() == 0:
            for name, text in self.run_files.items():  # the run's readable files, with every checkpoint
                write_text_atomic(self.run_dir / name, text)
        if self.config.checkpoint_format is CheckpointFormat.SHARDED:
            if self.remote:
                self.ps_job.request_checkpoint(save=True, path=path)  # the servers write their shards
            return save_sharded(sharded_state(self), path)
        # Every rank builds the state (it gathers row-sharded tables: a collective; a pipeline's
        # stages gather on rank 0 alone); rank 0 writes and the others wait until the file is complete.
        state = self.state_dict()
        if self.tier:  # the SSD tier's rows: snapshots in a directory every rank names alike before any writes
            directory = self.tier.new_directory(path, self.global_step)
            self.dp.barrier()
            state["tier"] = self.tier.save(directory)
            self.dp.barrier()  # every rank's snapshots complete before the file names them
        if global_rank() == 0:
            save_checkpoint(state, path)
            if self.tier:
                self.tier.clean(path, state["tier"])  # (the earlier saves' snapshots: no file names them now)
        self.dp.barrier()
        return path

    def has_checkpoint(self) -> bool:
        if self.config.checkpoint_format is CheckpointFormat.SHARDED:
            try:
                resolve(self.checkpoint_path)
                return True
            except CheckpointError:
                return False
        return self.checkpoint_path.is_file()

    def resume(self, path: Path | None = None) -> None:
        """Continue from the run directory's checkpoint (or ``path``), saved at any world size.

        Raises:
            CheckpointError: absent, truncated or missing a shard, or saved from another model
                config; nothing is changed then.
        """
        path = path or self.checkpoint_path
        if self.config.checkpoint_format is CheckpointFormat.SHARDED:
            # Validate before touching anything: the run's record first (a small read), then
            # load_sharded checks shards and shapes before it writes into the model.
            # (Each rank reads the record alone: in a parameter-server job the servers are not
            # loading yet, so no collective may run here.)
            self.check_resumable(read_extra({"extra": read_bytes(path, "extra")}), path)
            template = sharded_state(self, blob=False)
            if self.remote:
                self.ps_job.request_checkpoint(save=False, path=path)  # the servers load their shards
            load_sharded(template, path)
            self.load_state_dict(read_extra(template), path)
        else:
            self.load_state_dict(load_checkpoint(path), path)
        log.info("hetero: resumed from %s at epoch %d, batch %d (step %d)",
                 path, self.epoch, self.batch, self.global_step)

    def _step(self, batch: Batch) -> float:
        for opt in self.sparse_optimizers.values():
            opt.zero_grad()
        self.dense_optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            value = self._pipelined_forward_backward(batch)
        else:
            logits = self.net(batch.features, batch.dense)
            # Weighted by the global batch, not averaged per rank: the last batch's shares are unequal
            # or empty, and N ranks must still equal one process (an empty share adds 0, not NaN).
            loss_sum = nn.functional.binary_cross_entropy_with_logits(logits, copy_to(batch.label, self.device),
                                                                      reduction="sum")
            loss = self.dp.batch_mean(loss_sum, batch.global_size)
            loss.backward()
            value = self.dp.mean(loss)  # sync point: the host needs the global loss to decide whether to step
        if not math.isfinite(value):
            where = (f"the last checkpoint {self.checkpoint_path} is intact: lower the learning rates or check the "
                     f"input, then --resume" if self.has_checkpoint() else
                     "no checkpoint was written yet: lower the learning rates or check the input and start again")
            raise FloatingPointError(
                f"loss is {value} at epoch {self.epoch}, batch {self.batch} (step {self.global_step + 1}); "
                f"training stopped before applying this step; {where}"
            )
        self.dense_optimizer.step()
        for opt in self.sparse_optimizers.values():
            opt.step()
        return value

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
            for batch in batches:
                t0 = time.perf_counter()
                steps_this_run += 1
                measured = self.scalars is not None and self.scalars.sampled(steps_this_run, self.batch,
                                                                             cfg.warmup_steps)
                loss = self.scalars.traffic(self.global_step + 1, lambda: self._step(batch), self.net, self.dp.size) \
                    if measured else self._step(batch)
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
                    self.scalars.step(self.global_step, loss, {"dense": self.dense_optimizer, **self.sparse_optimizer_objects},
                                      self.train_samples / self.train_seconds if self.train_seconds else None)
                if self.on_step is not None:
                    self.on_step(self)
                if cfg.max_steps is not None and self.global_step >= cfg.max_steps:
                    stop = True
                    break
            bar.close()
            improved = False
            if not stop:
                metrics = self.evaluate(self.valid)
                self.history["epoch"].append(self.epoch + 1)
                self.history["valid_auc"].append(metrics["auc"])
                self.history["valid_logloss"].append(metrics["logloss"])
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
        if best and self.best["epoch"] and self.best["epoch"] != self.epoch:
            # the test split is scored by the best epoch's model: restore its checkpoint, keeping
            # this run's record of what happened after it for the report
            record = (self.epoch, self.batch, self.global_step, self.losses, self.history, self.best)
            self.resume(self.best_path)
            self.epoch, self.batch, self.global_step, self.losses, self.history, self.best = record
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
            "stopped_early": self.best["stopped"],
        }
        return write_report(self.run_dir, self.losses, metrics)


def weighted_bce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The logistic loss of a pipelined micro-batch: ``logits (b,)``, ``target (b, 2)`` holding
    the label and the sample's loss weight (see :meth:`Trainer._pipelined_forward_backward`);
    the mean of weight x loss over the micro-batch."""
    loss = nn.functional.binary_cross_entropy_with_logits(logits, target[:, 0], reduction="none")
    return (loss * target[:, 1]).mean()


def _fmt(metric: float | None) -> str:
    return "undefined" if metric is None else f"{metric:.4f}"
