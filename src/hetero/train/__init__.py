"""Training loop, evaluation and reports."""

from hetero.train.trainer import Trainer, TrainConfig

__all__ = ["TrainConfig", "Trainer"]
