"""TensorBoard scalars of a run (``RUN_DIR/tensorboard``), beside ``metrics.json``,
``losses.csv`` and ``curves.png``: what PyTorch users open first.

Written by rank 0 alone with ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard``
package's event-file format): per step ``train/loss``, each optimizer's ``lr/<name>`` and, once
past warm-up, ``train/samples_per_s``; per epoch ``valid/auc`` and ``valid/logloss``; at the end
``test/auc`` and ``test/logloss``. Steps are global steps, so a resumed run continues its curves.
Thread contract: the training thread only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch


class ScalarLog:
    """A run's TensorBoard event file, opened on first use, flushed at each epoch's end.

    Args:
        log_dir: the event files' directory (``RUN_DIR/tensorboard``).
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None

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
