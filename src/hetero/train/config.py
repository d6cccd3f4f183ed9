"""The training loop's configuration: what :class:`~hetero.train.trainer.Trainer` does and where
it writes its checkpoints."""

from __future__ import annotations

import dataclasses
import enum

from hetero.parallel import DataParallelConfig


class CheckpointFormat(enum.Enum):
    """``integrated``: one file with every tensor whole (rank 0 writes it); ``sharded``: a
    ``torch.distributed.checkpoint`` directory, each rank writing its part (see
    :mod:`hetero.train.checkpointing`). Both load at any world size."""

    INTEGRATED = "integrated"
    SHARDED = "sharded"

    @property
    def file_name(self) -> str:
        """The run's checkpoint, written at each epoch's end (and every ``checkpoint_every`` steps)."""
        return "checkpoint.pt" if self is CheckpointFormat.INTEGRATED else "checkpoint.dcp"

    @property
    def best_name(self) -> str:
        """The best epoch's checkpoint (``TrainConfig.keep_best``)."""
        return "best.pt" if self is CheckpointFormat.INTEGRATED else "best.dcp"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How a :class:`~hetero.train.trainer.Trainer` trains.

    Attributes:
        epochs: passes over the training split.
        checkpoint_every: steps between checkpoints; 0: at the end of each epoch only.
        max_steps: stop (with a checkpoint) after this many steps in total; ``None``: no limit.
        eval_batch_size: samples per evaluation forward.
        progress: show a progress bar.
        prefetch: prepare the next batch's lookups on a worker thread
            (:class:`hetero.embedding.Prefetcher`).
        warmup_steps: first steps of each run left out of samples/s (kernel compilation).
        checkpoint_format: the :class:`CheckpointFormat`.
        data_parallel: DDP or, under ZeRO 2/3, the model's own sharding.
        patience: early stopping - training ends after this many epochs without a better
            validation score (the AUC; minus the log loss where the AUC is undefined); 0 never
            stops early.
        keep_best: also write the best epoch's checkpoint (``best.pt`` / ``best.dcp``) and score
            the test split with it; implied by ``patience``.
        tensorboard: write TensorBoard scalars under ``RUN_DIR/tensorboard``
            (:class:`hetero.train.scalars.ScalarLog`).
    """

    epochs: int = 5
    checkpoint_every: int = 0
    max_steps: int | None = None
    eval_batch_size: int = 8192
    progress: bool = True
    prefetch: bool = False
    warmup_steps: int = 10
    checkpoint_format: CheckpointFormat = CheckpointFormat.INTEGRATED
    data_parallel: DataParallelConfig = DataParallelConfig()
    patience: int = 0
    keep_best: bool = False
    tensorboard: bool = False
