"""An export directory as a scoring model (:class:`ExportedModel`): the tables' lookups in
numpy/torch, the dense part the exported program - no hetero table, optimizer or checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from hetero.serving.tables import DENSE, read_manifest, read_table
from hetero.serving.program import load_program


class ExportedModel:
    """What ``hetero export`` wrote in ``directory`` (a full export), called as the trained model
    is: ``model(features, dense)`` -> ``(B,)`` float32 logits, ``features`` as the run's encoding
    makes them (``(B,)`` int64 ids or keys, or ``(ids, offsets)`` bags), ``dense`` ``(B, K)``.

    A dynamic table's key without a row reads its default row, as in training; a fixed table's
    ids index its rows. Bags are pooled as the model pools (sum or mean; an empty bag gives zeros).

    Raises:
        ValueError: a delta (apply it to its full export first: :func:`hetero.serving.apply_delta`).
        UnsafeProgramError: a ``dense.pt2`` that holds code or pickled objects
            (:func:`hetero.serving.program.load_program`).
    """

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        manifest = read_manifest(directory)
        if manifest["kind"] != "full":
            raise ValueError(f"{directory} is a delta export: apply it to the full export of {manifest['since']} "
                             f"(hetero.serving.apply_delta), then score with that")
        self.manifest = manifest
        self.program = load_program(directory / DENSE).module()  # (checked: no code from the file runs)
        self.tables = {}
        for name, t in manifest["tables"].items():
            keys, rows = read_table(directory / "tables" / f"{name}.parquet")
            default = np.asarray(t["default"] if t["dynamic"] else np.zeros(t["dim"]), np.float32)[None]
            # the rows, then the row a key without one reads: a dynamic table's default row
            self.tables[t["table"]] = (t, keys, torch.from_numpy(np.concatenate([rows, default])))

    def rows_of(self, table: str, ids: Tensor) -> Tensor:
        """Rows of ``ids`` (int64) in ``table``'s weight: a key's row, or the last (the default row)."""
        t, keys, weight = self.tables[table]
        x = ids.numpy()
        if not t["dynamic"]:
            return torch.from_numpy(np.where((x >= 0) & (x < keys.shape[0]), x, keys.shape[0]))
        at = np.minimum(np.searchsorted(keys, x), max(keys.shape[0] - 1, 0))
        found = (keys[at] == x) if keys.shape[0] else np.zeros(x.shape, bool)
        return torch.from_numpy(np.where(found, at, keys.shape[0]))

    def __call__(self, features: Mapping[str, Tensor | tuple[Tensor, Tensor]], dense: Tensor) -> Tensor:
        lookups = {}
        for table, (t, _, weight) in self.tables.items():
            x = features[t["feature"]]
            if isinstance(x, tuple):  # bags: ids and offsets
                ids, offsets = x
                lookups[table] = F.embedding_bag(self.rows_of(table, ids), weight, offsets, mode=t["pooling"],
                                                 include_last_offset=True)
            else:
                lookups[table] = F.embedding(self.rows_of(table, x), weight)
        return self.program(lookups, dense)
