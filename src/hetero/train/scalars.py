"""TensorBoard scalars of a run (``RUN_DIR/tensorboard``), beside ``metrics.json``,
``losses.csv`` and ``curves.png``: what PyTorch users open first.

Written by rank 0 alone with ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard``
package's event-file format): per step ``train/loss``, each optimizer's ``lr/<name>`` and, once
past warm-up, ``train/samples_per_s``; per epoch ``valid/auc`` and ``valid/logloss``; at the end
``test/auc`` and ``test/logloss``; per step, each dynamic table's keys admitted, rows evicted and
lookups of its default row in the step, and its rows (``dynamic/<table>/...``). Steps are global
steps, so a resumed run continues its curves.

Traffic is measured on sampled steps (the first after warm-up, and each epoch's first: counting
every op through a dispatch mode would slow every step): ``traffic/h2d_bytes`` and
``traffic/d2h_bytes`` (the copies the step's training thread makes; none where the device is the
host), ``traffic/dense_allreduce_bytes`` (what rank 0 receives in DDP's all-reduce of the dense
gradients, counted from their bytes: its reducer runs in C++, out of a dispatch mode's sight) and
``traffic/collective_bytes`` (that plus what rank 0 receives in the collectives the step issues
from Python: the host tables' sparse exchange, ZeRO's). See
:class:`hetero.parallel.comm.TrafficCounter` for what a dispatch mode cannot see.
Thread contract: the training thread only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from hetero.dynamic import DynamicStats
from hetero.parallel.comm import Collective, TrafficCounter, collective_bytes


class ScalarLog:
    """A run's TensorBoard event file, opened on first use, flushed at each epoch's end.

    Args:
        log_dir: the event files' directory (``RUN_DIR/tensorboard``).
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None
        self._dynamic: dict[str, DynamicStats] = {}  # each dynamic table's counts at the last step logged

    def _w(self):  # noqa: ANN202 - a SummaryWriter
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when a run logs

            self._writer = SummaryWriter(str(self.log_dir))
        return self._writer

    def step(self, step: int, loss: float, optimizers: Mapping[str, object], samples_per_s: float | None) -> None:
        """One training step's scalars: its loss, each optimizer's learning rate (``lr`` of its
        first parameter group, or its config's), and the steady-state samples per second."""
        w = self._w()
        w.add_scalar("train/loss", loss, step)
        for name, opt in optimizers.items():
            lr = _lr(opt)
            if lr is not None:
                w.add_scalar(f"lr/{name}", lr, step)
        if samples_per_s is not None:
            w.add_scalar("train/samples_per_s", samples_per_s, step)

    def dynamic_tables(self, step: int, stats: Mapping[str, DynamicStats]) -> None:
        """Each dynamic table's step: ``dynamic/<table>/admitted``, ``evicted`` and
        ``default_lookups`` since the previous call (the first: since :meth:`dynamic_start`), and
        the ``rows`` held."""
        w = self._w()
        for name, now in stats.items():
            before = self._dynamic.get(name, DynamicStats())
            for key in ("admitted", "evicted", "default_lookups"):
                w.add_scalar(f"dynamic/{name}/{key}", getattr(now, key) - getattr(before, key), step)
            w.add_scalar(f"dynamic/{name}/rows", now.rows, step)
            self._dynamic[name] = dataclasses.replace(now)

    def dynamic_start(self, stats: Mapping[str, DynamicStats]) -> None:
        """The dynamic tables' counts as this run (or its resumption) begins."""
        self._dynamic = {name: dataclasses.replace(s) for name, s in stats.items()}

    @staticmethod
    def sampled(steps_this_run: int, batch: int, warmup_steps: int) -> bool:
        """Whether this step's traffic is measured: the first after warm-up, each epoch's first."""
        return steps_this_run == warmup_steps + 1 or (batch == 0 and steps_this_run > 1)

    def traffic(self, step: int, run: Callable[[], float], net: nn.Module, replicas: int) -> float:
        """Run one training step (``run``) under a :class:`TrafficCounter`; log its bytes
        (``net``: the model as trained, DDP's wrapper included; ``replicas``: its ranks). Returns
        the step's loss."""
        with TrafficCounter() as counter:
            loss = run()
        dense = 0.0
        if isinstance(net, nn.parallel.DistributedDataParallel):  # the reducer's all-reduce (C++: unseen)
            skip = set(getattr(net, "parameters_to_ignore", ()))
            dense = collective_bytes(Collective.ALL_REDUCE, sum(
                p.numel() * p.element_size() for n, p in net.module.named_parameters()
                if p.requires_grad and n not in skip), replicas)
        w = self._w()
        w.add_scalar("traffic/h2d_bytes", counter.h2d_bytes, step)
        w.add_scalar("traffic/d2h_bytes", counter.d2h_bytes, step)
        w.add_scalar("traffic/dense_allreduce_bytes", dense, step)
        w.add_scalar("traffic/collective_bytes", counter.total_bytes + dense, step)
        return loss

    def metrics(self, prefix: str, step: int, metrics: Mapping[str, float | None]) -> None:
        """``prefix/auc`` and ``prefix/logloss`` at ``step`` (an undefined AUC is left out); flushed."""
        w = self._w()
        for key in ("auc", "logloss"):
            if metrics.get(key) is not None:
                w.add_scalar(f"{prefix}/{key}", metrics[key], step)
        w.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _lr(optimizer: object) -> float | None:
    """An optimizer's learning rate: torch's (its first group's), else its config's ``lr``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        lr = optimizer.param_groups[0]["lr"] if optimizer.param_groups else None
        return float(lr) if lr is not None else None
    lr = getattr(getattr(optimizer, "config", None), "lr", None)
    return float(lr) if lr is not None else None
