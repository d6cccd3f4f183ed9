"""Training loop, evaluation and reports."""

from hetero.train.trainer import CheckpointFormat, Trainer, TrainConfig

__all__ = ["CheckpointFormat", "TrainConfig", "Trainer"]
