"""Serving a trained run: its model rebuilt from a checkpoint (``hetero predict``), exported as a
``torch.export`` program and Parquet tables with deltas between checkpoints (``hetero export``),
and an export scoring as the model did (``docs/dynamic-tables.md``)."""

from hetero.serving.delta import apply_delta
from hetero.serving.export import export
from hetero.serving.tables import read_manifest
from hetero.serving.model import ExportedModel

__all__ = ["ExportedModel", "apply_delta", "export", "read_manifest"]
