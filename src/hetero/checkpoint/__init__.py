"""Checkpoint files: atomic writes, validated loads."""

from hetero.checkpoint.io import CheckpointError, check_model_compatible, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "check_model_compatible", "load_checkpoint", "save_checkpoint"]
