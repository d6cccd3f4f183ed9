"""Serving a trained run: its model rebuilt from a checkpoint (``hetero predict``), exported as a
``torch.export`` program and Parquet tables with deltas between checkpoints (``hetero export``),
and an export scoring as the model did (``docs/dynamic-tables.md``)."""

from hetero.serving.export import apply_delta, export, read_manifest
from hetero.serving.model import ExportedModel

__all__ = ["ExportedModel", "apply_delta", "export", "read_manifest"]
