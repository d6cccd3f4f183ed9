"""``hetero export``: a trained run's model for serving, and deltas between two of its checkpoints.

An export directory holds:

* ``manifest.json`` - the format, ``kind`` (``"full"`` or ``"delta"``), ``source``: what the
  export is of (the run's id, the step and the SHA-256 digest of every exported row,
  :func:`tables_digest`), for a delta ``base``: the same of the older checkpoint it applies to,
  the checkpoints' paths (information only: nothing is decided by a path), and per table (qualified name): its table and feature names, pooling, width, whether
  it is dynamic, its row count and a dynamic table's default row;
* ``tables/<name>.parquet`` - one row per key (a dynamic table's raw int64 keys) or id (a fixed
  table's rows), sorted: columns ``key`` (int64) and ``embedding`` (``fixed_size_list<float32>[D]``);
  in a delta, the rows added or changed since the older checkpoint, and
  ``tables/<name>.tombstones.parquet`` (column ``key``) the keys evicted since;
* ``dense.pt2`` - the rest of the model, a ``torch.export`` program whose inputs are the tables'
  lookups (``{table name: (B, D) float32}``, pooled as the model pools) and the dense features;
* ``record.pt`` - the run record (model, encoding, reader settings), so that a file is encoded
  and read as training read it.

:func:`apply_delta` turns an older full export and a delta into the newer full export (the
same tables and program as exporting the newer checkpoint). It decides that a delta fits an
export by content: the digest of the export's rows as read from its files must be the delta's
``base`` digest, and the result's must be its ``source`` digest. Each directory is written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hetero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hetero.checkpoint.io import naming_write, remove_left_by_dead
from hetero.embedding import HostEmbedding, HostEmbeddingCollection, host_tables
from hetero.record import RECORD_KEY, RunRecord
from hetero.serving.delta import delta_of
from hetero.serving.restore import restore_model, run_record, tier_scratch
from hetero.serving.tables import (
    DENSE, FORMAT_VERSION, MANIFEST, RECORD, TableRows, publish, tables_digest, write_table,
)



def model_tables(model: nn.Module) -> dict[str, TableRows]:
    """Every host table of ``model`` by qualified name (rows copied to float32)."""
    out = {}
    for name, t in host_tables(model).items():
        if t.keymap is None:
            rows = np.arange(t.config.num_embeddings, dtype=np.int64)
            out[name] = TableRows(rows, _rows_of(t, rows), None)
            continue
        rows, keys = t.keymap.keys()
        order = np.argsort(keys, kind="stable")
        held = _rows_of(t, np.append(rows[order], t.config.num_embeddings))  # (and the default row, last)
        out[name] = TableRows(keys[order], held[:-1], held[-1].copy())
    return out


def identity(state: dict[str, Any], tables: dict[str, TableRows]) -> dict[str, Any]:
    """What an export is of: the checkpoint's run id (``None``: one written before hetero kept
    one), its step, and the digest of the rows exported from it."""
    return {"run": state.get("run_uid"), "step": int(state.get("position", {}).get("global_step", -1)),
            "tables_digest": tables_digest(tables)}


def _rows_of(t: HostEmbedding, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (int64, the table's own numbers) of ``t``, copied to float32: from memory, or
    from the SSD tier (its cache where cached, else its file; the cache is left as it is)."""
    g = t.group
    if not g.ssd_here:
        return t.weight.detach()[torch.from_numpy(rows)].float().numpy()
    return g.ssd_rows().cache.read(rows + g.local_start(t), ("weight",))["weight"].float().numpy()


class LookupInputs(nn.Module):
    """Stands for a table collection in the exported program: its lookups are the program's inputs."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names
        self.tables = dict.fromkeys(names)  # (what a model asks of its collection: the tables, in order)

    def start(self, features: object) -> None:
        """Nothing to start ahead (:meth:`HostEmbeddingCollection.start`): the lookups are inputs."""

    def forward(self, lookups: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: lookups[n] for n in self.names}


def dense_program(model: nn.Module, num_dense: int) -> torch.export.ExportedProgram:
    """``model`` (restored, in evaluation mode; its collections are replaced) as a ``torch.export``
    program of its tables' lookups and dense features, the batch dimension dynamic."""
    dims = {}
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if isinstance(child, HostEmbeddingCollection):
                dims.update({t.name: t.config.embedding_dim for t in child.tables.values()})
                setattr(parent, attr, LookupInputs(list(child.tables)))
    batch = torch.export.Dim("batch", min=1)
    example = ({n: torch.zeros(4, d) for n, d in dims.items()}, torch.zeros(4, num_dense))
    shapes = ({n: {0: batch} for n in dims}, {0: batch})
    return torch.export.export(model, example, dynamic_shapes=shapes)


def export(checkpoint: str | Path, out: str | Path, since: str | Path | None = None) -> dict[str, Any]:
    """Write the export of ``checkpoint`` (an integrated checkpoint of a schema run) into the new
    directory ``out``: full, or with ``since`` (an older checkpoint of the same model) a delta.
    Returns the manifest.

    Raises:
        FileExistsError: ``out`` exists.
        CheckpointError: a checkpoint that is missing, damaged, sharded (merge it first) or of a
            run without a schema, or
            whose SSD tier snapshots are gone (an older checkpoint's, after a newer save of its run).
        ValueError: ``since`` of another model (naming the first difference).

    Tables a run kept on the SSD tier are read from its snapshots (linked into a scratch directory,
    :func:`~hetero.serving.restore.tier_scratch`, removed after): every exported row is held in
    memory while written. Nothing is written but ``out`` (and that scratch, for such tables).
    """
    checkpoint, out = Path(checkpoint), Path(out)
    for given in (checkpoint, *([] if since is None else [Path(since)])):
        if given.is_dir():
            raise CheckpointError(f"{given} is a sharded checkpoint: merge it into one file with `hetero checkpoint "
                                  f"merge {given} merged.pt` and export that")
    if out.exists():
        raise FileExistsError(f"--out {out} exists: give a new directory (an export is written whole, never over "
                              f"another)")
    state = load_checkpoint(checkpoint)
    record = run_record(checkpoint, state)
    with contextlib.ExitStack() as scratch:  # (the tier's snapshots linked in, for the restored models' lifetime)
        model = restore_model(checkpoint, state, record, record.encoding.specs(),
                              scratch.enter_context(tier_scratch(checkpoint, state, out.parent)))
        tables = model_tables(model)
        older, base = None, None
        if since is not None:
            old_state = load_checkpoint(since)
            old_record = run_record(Path(since), old_state)
            older = model_tables(restore_model(Path(since), old_state, old_record, old_record.encoding.specs(),
                                               scratch.enter_context(tier_scratch(Path(since), old_state, out.parent))))
            _check_same(older, tables, Path(since), checkpoint)
            base = identity(old_state, older)
        return _write(out, model, record, state, tables, older, base, checkpoint, since)


def _write(out: Path, model: nn.Module, record: RunRecord, state: dict[str, Any], tables: dict[str, TableRows],
           older: dict[str, TableRows] | None, base: dict[str, Any] | None, checkpoint: Path,
           since: str | Path | None) -> dict[str, Any]:
    """The export directory ``out`` of ``model`` and its ``tables`` (a delta against ``older``), atomic."""
    described = {name: _describe(t, tables[name]) for name, t in host_tables(model).items()}
    manifest = {"format_version": FORMAT_VERSION, "kind": "full" if older is None else "delta",
                "source": identity(state, tables), "base": base, "checkpoint": str(checkpoint),
                "since": None if since is None else str(since), "model": record.model.kind,
                "num_dense": record.model.num_dense, "tables": described}
    with naming_write(out):  # (a failed write names the export and the cause)
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_left_by_dead(out.parent, f".{out.name}.tmp-")  # (a killed export's)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
        _write_files(tmp, out, model, record, state, tables, older, described, manifest)
    return manifest


def _write_files(tmp: Path, out: Path, model: nn.Module, record: RunRecord, state: dict[str, Any],
                 tables: dict[str, TableRows], older: dict[str, TableRows] | None, described: dict[str, Any],
                 manifest: dict[str, Any]) -> None:
    try:
        (tmp / "tables").mkdir()
        for name, rows in tables.items():
            values = raw_values(record, described[name], rows)
            if older is None:
                write_table(tmp / "tables" / f"{name}.parquet", rows.keys, rows.rows, values)
                continue
            changed, gone = delta_of(older[name], rows)
            write_table(tmp / "tables" / f"{name}.parquet", rows.keys[changed], rows.rows[changed],
                        None if values is None else values[changed])
            write_table(tmp / "tables" / f"{name}.tombstones.parquet", gone, None)
            described[name]["changed"], described[name]["tombstones"] = int(changed.shape[0]), int(gone.shape[0])
        torch.export.save(dense_program(model, record.model.num_dense), str(tmp / DENSE))
        save_checkpoint({RECORD_KEY: state[RECORD_KEY]}, tmp / RECORD)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def raw_values(record: RunRecord, described: dict[str, Any], rows: TableRows) -> np.ndarray | None:
    """A fixed table's raw feature value of each of its ids (object ``(n,)``: the vocabulary's text;
    ``None`` for id 0, the out-of-vocabulary row), so a serving system looks rows up by the value it
    has; ``None`` for a table whose ids are no vocabulary's (hashed, bucketised, dynamic, crossed)."""
    vocab = record.encoding.vocabularies.get(described["feature"]) if rows.default is None else None
    if vocab is None:
        return None
    return np.array([None, *vocab], dtype=object)[rows.keys]


def _describe(table: nn.Module, rows: TableRows) -> dict[str, Any]:
    c = table.config
    return {"table": c.name, "feature": c.feature_name, "pooling": c.pooling.value, "dim": c.embedding_dim,
            "dynamic": rows.default is not None, "rows": int(rows.keys.shape[0]),
            "default": None if rows.default is None else rows.default.tolist()}


def _check_same(old: dict[str, TableRows], new: dict[str, TableRows], since: Path, checkpoint: Path) -> None:
    if sorted(old) != sorted(new):
        raise ValueError(f"--since {since} has tables {sorted(old)}, {checkpoint} {sorted(new)}: a delta is between "
                         f"two checkpoints of one model")
    for name in new:
        a, b = old[name], new[name]
        if (a.default is None) != (b.default is None) or a.rows.shape[1] != b.rows.shape[1]:
            raise ValueError(f"table {name!r} is of another kind or width in --since {since} than in {checkpoint}: a "
                             f"delta is between two checkpoints of one model")
