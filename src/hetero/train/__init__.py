"""Training loop, evaluation and reports."""

from hetero.train.config import CheckpointFormat, TrainConfig
from hetero.train.trainer import Trainer

__all__ = ["CheckpointFormat", "TrainConfig", "Trainer"]
