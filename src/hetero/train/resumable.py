"""The trainer's checkpoints (:class:`TrainerCheckpoints`, a part of :class:`hetero.train.trainer.Trainer`):
what a checkpoint holds, the checks a resume passes before anything changes, and the two formats'
save and load.

Integrated (``checkpoint.pt``, :func:`hetero.checkpoint.save_checkpoint`): every tensor whole,
written by rank 0 (row-sharded tables gathered); tables on the SSD tier beside it as the tier's
snapshots (:mod:`hetero.train.tier`). Sharded (``checkpoint.dcp``, DCP): each rank its blocks
(:mod:`hetero.train.checkpointing`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetero.checkpoint import CheckpointError, check_model_compatible, load_checkpoint, save_checkpoint
from hetero.checkpoint.io import write_text_atomic
from hetero.checkpoint.sharded import load_sharded, read_bytes, resolve, save_sharded
from hetero.parallel import (
    full_model_state, full_optimizer_state, global_rank, global_shapes, load_full_optimizer_state, local_model_state,
)
from hetero.parallel.env import DataParallelGroup
from hetero.parallel.checkpoint_state import check_key_ranks, restore_keymaps
from hetero.placement.memory import returning_freed_memory
from hetero.record import RECORD_KEY, check_record
from hetero.train.checkpointing import (
    read_extra, sharded_state, stage_optimizer_state, whole_model_shapes, whole_model_state, whole_optimizer_state,
)
from hetero.train.config import CheckpointFormat

log = logging.getLogger("hetero")
FORMAT_VERSION = 1


def new_run_uid(dp: DataParallelGroup) -> str:
    """A new run's id: 32 hex digits, random on rank 0 of ``dp`` and the same on its every rank
    (a broadcast, collective). Checkpoints carry it (``run_uid``), a resume keeps it, and an
    export names its checkpoint by it, the step and its rows' digest (:mod:`hetero.serving.export`)."""
    uid = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8).clone()
    if dp.active:
        dist.broadcast(uid, group=dp.host_group(), group_src=0)  # (a host tensor: the gloo group)
    return bytes(uid.tolist()).hex()


class TrainerCheckpoints:
    """The checkpoint methods of :class:`~hetero.train.trainer.Trainer`, which sets the attributes
    they use (its model, optimizers, position, history, run directory, ``tier`` and config)."""

    def state_dict(self, tables: bool = True) -> dict[str, Any]:
        """Everything needed to continue bit for bit, tensors whole (the integrated layout).

        ``tables=False`` leaves out the model and the sparse optimizers' row state (what the
        sharded layout stores as tensors of its own) and needs no collective.
        """
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        state = {"format_version": FORMAT_VERSION, "run": self.run_identity(), "run_uid": self.run_uid}
        if self.record is not None:
            state[RECORD_KEY] = self.record
        dense = full_optimizer_state(self.optimizers.dense)  # operator-parallel shards gathered
        if tables:
            state["model"] = full_model_state(self.model)  # row-sharded tables gathered whole (collective)
        if self.pipeline is not None:  # the stages' parts gathered whole on pp rank 0, the writer (None elsewhere)
            state["model"] = whole_model_state(self.pipeline.group, state["model"])
            dense = whole_optimizer_state(self.pipeline.group, dense)
        state.update({
            "dense_optimizer": dense,
            "sparse_optimizers": self.optimizers.sparse_state_dict(include_state=tables),
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
        groups, saved_groups = self.optimizers.dense.param_groups, state["dense_optimizer"]["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
            raise CheckpointError(f"checkpoint {path}: the dense optimizer's parameter groups differ from this run's")
        for k, opt in self.optimizers.sparse.items():
            if k not in state["sparse_optimizers"]:
                raise CheckpointError(f"checkpoint {path} has no sparse optimizer {k!r}")
            try:
                opt.check_state_dict(state["sparse_optimizers"][k])
            except ValueError as e:
                raise CheckpointError(f"checkpoint {path}: {e}") from e
        if self.record is not None:  # the run record last: whatever the checks above do not name (a transform,
            check_record(state, self.record, path)  # the reader settings)

    def _restore_hyper_parameters(self, ours: dict[str, dict[str, Any]]) -> None:
        """After a load: this run's hyper-parameters win over the checkpoint's (a resume with lower
        learning rates is the fix for a diverged run), each change logged once."""
        self.optimizers.set_hyper_parameters(ours, lambda where, key, value, old: log.info(
            "hetero: resume: %s %s = %r (this run's; the checkpoint had %r)", where, key, value, old))

    def _stage_view(self, state: Mapping[str, Any], path: Path) -> dict[str, Any]:
        """A whole model's checkpoint cut to this pipeline stage's parameters and dense optimizer
        state (collectives over pp; every rank raises alike, before any changes)."""
        group = self.pipeline.group
        check_model_compatible(whole_model_shapes(group, global_shapes(self.model)), state["model"], path)
        try:
            dense = stage_optimizer_state(group, state["dense_optimizer"], self.optimizers.dense.state_dict())
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
        ours = self.optimizers.hyper_parameters()
        if "model" in state:
            self.model.load_state_dict(local_model_state(self.model, state["model"]))  # this rank's rows of sharded tables
        load_full_optimizer_state(self.optimizers.dense, state["dense_optimizer"])
        self.optimizers.load_sparse_state_dict(state["sparse_optimizers"])
        self._restore_hyper_parameters(ours)
        pos = state["position"]
        self.epoch, self.batch, self.global_step = pos["epoch"], pos["batch"], pos["global_step"]
        self.run_uid = state.get("run_uid", self.run_uid)  # (a checkpoint of an older hetero has none: a new id)
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
            with returning_freed_memory():
                return save_sharded(sharded_state(self), path)
        # Every rank builds the state (it gathers row-sharded tables: a collective; a pipeline's
        # stages gather on rank 0 alone); rank 0 writes and the others wait until the file is complete.
        with returning_freed_memory():  # (the copies below: one-off, back to the system when freed)
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
            del state
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
        self.load(path)
        log.info("hetero: resumed from %s at epoch %d, batch %d (step %d)",
                 path, self.epoch, self.batch, self.global_step)

    def load(self, path: Path) -> None:
        """:meth:`resume` from ``path``, without saying so (the trainer loads its best epoch's
        checkpoint to score the test split: no resume)."""
        if self.config.checkpoint_format is CheckpointFormat.SHARDED:
            # Validate before touching anything: the run's record first (a small read), then
            # load_sharded checks shards and shapes before it writes into the model.
            # (Each rank reads the record alone: in a parameter-server job the servers are not
            # loading yet, so no collective may run here.)
            extra = read_extra({"extra": read_bytes(path, "extra")})
            self.check_resumable(extra, path)
            check_key_ranks(self.model, extra["layout"], path)
            template = sharded_state(self, blob=False)
            if self.remote:
                self.ps_job.request_checkpoint(save=False, path=path)  # the servers load their shards
            load_sharded(template, path)
            restore_keymaps(self.model, template, path)  # (the maps' arrays were loaded into copies)
            self.load_state_dict(read_extra(template), path)
        else:
            self.load_state_dict(load_checkpoint(path), path)
