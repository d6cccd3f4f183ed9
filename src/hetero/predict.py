"""``hetero predict``: a trained run's checkpoint scoring a schema-described file, streamed.

Everything scoring needs comes from the checkpoint's run record (:mod:`hetero.record`): the
model, the fitted encoding and the reader settings the run read its files with - so a file is
read and encoded exactly as training read it, wherever the checkpoint lies (a merged
``model.pt`` too). Prediction streams the file in blocks (memory bounded as in training); under
torchrun each rank scores its shard (:func:`hetero.data.shards.file_shards`) and rank 0 joins the
parts in file order. The output (Parquet, or CSV by the suffix) has one row per input row: the
``id_column``'s value if one is named, ``score`` (the predicted probability, float64) and, when
the file has the label column, ``label`` (0/1 by the schema's rule); the returned metrics then
hold the file's AUC and log loss.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.checkpoint import CheckpointError, load_checkpoint
from hetero.data.readers import ReaderConfig, file_columns, reader_to_dict, record_batches
from hetero.data.shards import file_shards
from hetero.record import reader_settings
from hetero.serving.export import MANIFEST, RECORD
from hetero.serving.model import ExportedModel
from hetero.serving.restore import restore_model, run_record
from hetero.train.report import binary_metrics


def predict(checkpoint: str | Path, data: str | Path, out: str | Path, reader: ReaderConfig | None = None,
            batch_size: int = 8192, rank: int = 0, world_size: int = 1,
            id_column: str | None = None) -> tuple[Path, dict[str, float | None]] | None:
    """Score ``data`` with ``checkpoint`` (an integrated checkpoint of a schema run, or a full
    ``hetero export`` directory of one: :class:`~hetero.serving.ExportedModel`) into ``out``.

    ``reader``: ``None`` reads ``data`` with the run's own reader settings (its record); a
    config given must equal them, join paths apart (a job file that locates the side tables).
    With ``world_size`` > 1 (every rank calls it, torch.distributed initialised), rank ``r``
    scores its shard; rank 0 then joins the parts in order into ``out``. Returns ``out`` and the
    metrics (``rows``; ``auc`` and ``logloss`` when the file has labels) on rank 0, ``None`` on
    the others.

    Raises:
        FileNotFoundError: no checkpoint or no data.
        CheckpointError: a sharded checkpoint (merge it: ``hetero checkpoint merge``), one
            without a run record, or one that does not fit its recorded model.
        ValueError: a reader that reads the file otherwise than the run did (naming the
            setting), the data lacks a feature column or ``id_column`` (naming the file's
            columns), or a bad value (file, line, column, value).
    """
    checkpoint, data, out = Path(checkpoint), Path(data), Path(out)
    exported = checkpoint.is_dir() and (checkpoint / MANIFEST).is_file()  # (hetero export's directory)
    if checkpoint.is_dir() and not exported:
        raise CheckpointError(f"{checkpoint} is a sharded checkpoint: merge it into one file with `hetero checkpoint "
                              f"merge {checkpoint} merged.pt` and score that")
    if not exported and not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    if out.suffix not in (".parquet", ".csv"):
        raise ValueError(f"--out {out}: give a .parquet or .csv file")
    state = load_checkpoint(checkpoint / RECORD if exported else checkpoint)
    record = run_record(checkpoint, state)
    reader = _reader(record.reader, reader, checkpoint)
    encoding = record.encoding
    names = file_columns(data, reader)
    labelled = encoding.schema.label.column in names
    schema = dataclasses.replace(encoding.schema, drop=())  # a dropped column need not be in a file to score
    if not labelled:  # rows to score, no labels: the output has no label column
        schema = schema.unlabelled()
    encoding = dataclasses.replace(encoding, schema=schema)
    if exported:  # its tables and program (the run record told how to read and encode the file)
        return _score(ExportedModel(checkpoint), encoding, schema, data, reader, out, batch_size, rank, world_size,
                      id_column, labelled)
    with tempfile.TemporaryDirectory(dir=checkpoint.parent, prefix=".hetero-predict-") as scratch:
        # tables the run kept on the SSD tier are read from its snapshots there (linked into a scratch
        # store beside the checkpoint: the same file system)
        model = restore_model(checkpoint, state, record, encoding.specs(), Path(scratch))
        del state
        return _score(model, encoding, schema, data, reader, out, batch_size, rank, world_size, id_column, labelled)


def _score(model, encoding, schema, data: Path, reader: ReaderConfig, out: Path, batch_size: int, rank: int,  # noqa: ANN001
           world_size: int, id_column: str | None, labelled: bool) -> tuple[Path, dict[str, float | None]] | None:
    import pyarrow as pa

    shard = file_shards(data, reader, world_size)[rank] if world_size > 1 else None
    extra = (id_column,) if id_column is not None and id_column not in schema.columns else ()
    scores, labels, ids = [], [], []
    with torch.no_grad():
        for batch in record_batches(data, schema, reader, extra=extra, shard=shard, block_bytes=1 << 22):
            block = encoding.encode(batch, str(data))
            if id_column is not None:
                ids.append(batch.column(id_column))
            for b in block.batches(batch_size):
                scores.append(torch.sigmoid(model(b.features, b.dense)).double())
                labels.append(b.label)
    columns: dict[str, Any] = {}
    if id_column is not None:
        columns[id_column] = pa.chunked_array(ids, type=ids[0].type) if ids else pa.array([], pa.string())
    columns["score"] = torch.cat(scores).numpy() if scores else np.zeros(0)
    if labelled:
        columns["label"] = (torch.cat(labels).numpy() if labels else np.zeros(0)).astype("int8")
    table = pa.table(columns)
    if world_size > 1:  # each rank's part as Parquet (typed even when empty), joined on rank 0
        part = out.with_name(f"{out.name}.part-{rank}.parquet")
        _write(table, part, as_csv=False)
        torch.distributed.barrier()  # every part written
        if rank != 0:
            return None
        parts = [out.with_name(f"{out.name}.part-{r}.parquet") for r in range(world_size)]
        table = pa.concat_tables([_read(p) for p in parts])
        for p in parts:
            p.unlink()
    _write(table, out, as_csv=out.suffix == ".csv")
    metrics: dict[str, float | None] = {"rows": table.num_rows}
    if labelled:
        m = binary_metrics(table.column("label").to_numpy(), table.column("score").to_numpy())
        metrics.update({"auc": m["auc"], "logloss": m["logloss"]})
    return out, metrics


def _reader(saved: ReaderConfig, given: ReaderConfig | None, checkpoint: Path) -> ReaderConfig:
    """The reader a file is scored with: the run's, or ``given`` if it reads files alike."""
    if given is None:
        return saved

    a, b = reader_settings(reader_to_dict(saved)), reader_settings(reader_to_dict(given))
    for key in a:
        if a[key] != b[key]:
            raise ValueError(f"the job file's [data] {key} = {b[key]!r} reads files otherwise than the run did ({a[key]!r}, "
                             f"recorded in {checkpoint}): hetero predict reads every file as its run did; drop --config, "
                             f"or give a job file with the run's [data] settings")
    return given


def _write(table, path: Path, as_csv: bool) -> None:  # noqa: ANN001 - a pyarrow Table
    """``table`` to ``path`` atomically (a temporary name, then a rename)."""
    import pyarrow.csv as csv
    import pyarrow.parquet as pq

    tmp = path.with_name(path.name + ".tmp")
    if as_csv:
        csv.write_csv(table, tmp)
    else:
        pq.write_table(table, tmp)
    os.replace(tmp, path)


def _read(path: Path):  # noqa: ANN202 - a pyarrow Table
    import pyarrow.parquet as pq

    return pq.read_table(path)
