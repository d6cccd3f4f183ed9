"""``hetero predict``: a trained run's checkpoint scoring a schema-described file, streamed.

Everything scoring needs comes from the checkpoint's run record (:mod:`hetero.record`): the
model, the fitted encoding and the reader settings the run read its files with - so a file is
read and encoded exactly as training read it, wherever the checkpoint lies (a merged
``model.pt`` too). Prediction streams the file in blocks (memory bounded as in training); under
torchrun each rank scores its shard (:func:`hetero.data.shards.file_shards`) and rank 0 joins the
parts in file order. The output (Parquet, or CSV by the suffix) has one row per input row, in
input order: the ``id_column``'s value if one is named (as the file has it: a line format's
text, exactly; a Parquet file's type), ``score`` (the predicted probability, float64) and, when
the file has the label column, ``label`` (0/1 by the schema's rule); the returned metrics then
hold the file's AUC and log loss. A row the run's reader settings skip as bad (``on_bad_rows =
"skip"``) keeps its place with a null score and label, counted (``bad_rows``); a row of another
field count cannot keep its place and is an error naming it. The output is written block by
block (:class:`ScoreWriter`): resident memory is flat in the row count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.checkpoint import CheckpointError, load_checkpoint
from hetero.checkpoint.io import naming_write, remove_left_by_dead
from hetero.data.reader_config import ReaderConfig, reader_from_dict, reader_to_dict
from hetero.data.readers import file_columns, record_batches
from hetero.data.rows import BAD_ROW, BadRowCount
from hetero.data.shards import file_shards
from hetero.record import RunRecord, reader_settings
from hetero.serving.tables import MANIFEST, RECORD
from hetero.serving.model import ExportedModel
from hetero.serving.restore import restore_model, run_record, tier_scratch
from hetero.train.report import StreamingBinaryMetrics


def predict(checkpoint: str | Path, data: str | Path, out: str | Path, reader: ReaderConfig | None = None,
            batch_size: int = 8192, rank: int = 0, world_size: int = 1,
            id_column: str | None = None,
            cache_bytes: int | None = None) -> tuple[Path, dict[str, float | None]] | None:
    """Score ``data`` with ``checkpoint`` (an integrated checkpoint of a schema run, or a full
    ``hetero export`` directory of one: :class:`~hetero.serving.ExportedModel`) into ``out``.

    ``cache_bytes``: the row cache of each table group a run kept on the SSD tier (``None``: the
    tier's default; any size scores: a batch of more rows is read in pieces).
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
    reader = _reader(_file_reader(record, data), reader, checkpoint)
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
    # tables the run kept on the SSD tier are read from its snapshots, linked into a scratch store on
    # the checkpoint's file system (none is made for tables in memory)
    with tier_scratch(checkpoint, state, out.parent) as scratch:
        model = restore_model(checkpoint, state, record, encoding.specs(), scratch, cache_bytes)
        del state
        return _score(model, encoding, schema, data, reader, out, batch_size, rank, world_size, id_column, labelled)


def _score(model, encoding, schema, data: Path, reader: ReaderConfig, out: Path, batch_size: int, rank: int,  # noqa: ANN001
           world_size: int, id_column: str | None, labelled: bool) -> tuple[Path, dict[str, float | None]] | None:
    """Score ``data`` (this rank's shard) block by block, each block written as it is scored."""
    import pyarrow as pa

    shard = file_shards(data, reader, world_size)[rank] if world_size > 1 else None
    extra = (id_column,) if id_column is not None and id_column not in schema.columns else ()
    bad = BadRowCount(mark=True)  # a bad row stays in place: a null score (one output row per input row)
    target = out.with_name(f"{out.name}.part-{rank}.parquet") if world_size > 1 else out
    tally = _Tally(labelled)
    with ScoreWriter(target, as_csv=world_size == 1 and out.suffix == ".csv") as sink, torch.no_grad():
        for batch in record_batches(data, schema, reader, extra=extra, shard=shard, block_bytes=1 << 22, bad=bad,
                                    text=extra):
            flags = batch.column(BAD_ROW).to_numpy(zero_copy_only=False)
            good = pa.RecordBatch.from_arrays([batch.column(c) for c in batch.schema.names if c != BAD_ROW],
                                              names=[c for c in batch.schema.names if c != BAD_ROW])
            good = good.filter(pa.array(~flags)) if flags.any() else good
            block = encoding.encode(good, str(data))
            probs, labels = [], []
            for b in block.batches(batch_size):
                probs.append(torch.sigmoid(model(b.features, b.dense)).double().numpy())
                labels.append(b.label.numpy())
            columns: dict[str, Any] = {}
            if id_column is not None:
                columns[id_column] = batch.column(id_column)  # every row's, bad ones too, as the file has it
            columns["score"] = _placed(np.concatenate(probs) if probs else np.zeros(0), flags, pa.float64())
            if labelled:
                columns["label"] = _placed((np.concatenate(labels) if labels else np.zeros(0)).astype(np.int8), flags,
                                           pa.int8())
            table = pa.table(columns)
            if world_size == 1:
                tally.add(table)
            sink.write(table)
    if world_size > 1:  # each rank's part (Parquet, typed even when empty), streamed into ``out`` on rank 0
        import pyarrow.parquet as pq

        torch.distributed.barrier()  # every part written
        if rank != 0:
            return None
        parts = [out.with_name(f"{out.name}.part-{r}.parquet") for r in range(world_size)]
        with ScoreWriter(out, as_csv=out.suffix == ".csv") as sink:
            for part in parts:
                for piece in pq.ParquetFile(part).iter_batches(batch_size=1 << 16):
                    table = pa.Table.from_batches([piece])
                    tally.add(table)
                    sink.write(table)
        for p in parts:
            p.unlink()
    return out, tally.metrics()


def _placed(values: np.ndarray, flags: np.ndarray, kind) -> Any:  # noqa: ANN001, ANN401 - pyarrow types
    """``values`` of the good rows at their places among ``flags.size`` rows, a bad row null."""
    import pyarrow as pa

    if not flags.any():
        return pa.array(values, kind)
    full = np.zeros(flags.shape[0], dtype=values.dtype)
    full[~flags] = values
    return pa.array(full, kind, mask=flags)


class _Tally:
    """What predict reports of the rows written: their count, the bad rows (a null score) and,
    for a labelled file, AUC and log loss over the scored rows (memory flat in the row count)."""

    def __init__(self, labelled: bool) -> None:
        self.rows, self.bad, self.labelled = 0, 0, labelled
        self.scores = StreamingBinaryMetrics()

    def add(self, table) -> None:  # noqa: ANN001 - a pyarrow Table
        score = table.column("score")
        self.rows, self.bad = self.rows + table.num_rows, self.bad + score.null_count
        if self.labelled:
            valid = score.is_valid().to_numpy(zero_copy_only=False)
            self.scores.add(table.column("label").to_numpy(zero_copy_only=False)[valid],
                            score.to_numpy(zero_copy_only=False)[valid])

    def metrics(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"rows": self.rows, "bad_rows": self.bad}
        if self.labelled:
            out.update(self.scores.metrics())
        return out


def _file_reader(record: RunRecord, data: Path) -> ReaderConfig:
    """How the run read ``data``: its validation or test file's own reader settings where ``data``
    is that file (``valid_path`` / ``test_path`` as a table: Avazu's header-less ``test.csv``),
    else the run's (its training file's)."""
    recorded = record.config.get("data", {})
    for key in ("valid_path", "test_path"):
        entry = recorded.get(key)
        if isinstance(entry, dict) and Path(entry["path"]).resolve() == data.resolve():
            own = {k: v for k, v in entry.items() if k != "path"}
            return reader_from_dict({**reader_to_dict(record.reader), **own})
    return record.reader


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


class ScoreWriter:
    """Scores written as they come (a Parquet row group, or CSV lines, per :meth:`write`) into a
    temporary file beside ``path``, renamed over ``path`` when the context closes without error;
    removed on any error. Opened (its directory made, the file created) on entry, before anything
    is scored. A failed write names the file and the cause (``ENOSPC``, ``EFBIG``, ``EIO``).

    Raises:
        OSError: the directory or file cannot be made or written, naming it.
    """

    def __init__(self, path: Path, as_csv: bool) -> None:
        self.path, self.as_csv = path, as_csv
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.writer = None

    def __enter__(self) -> "ScoreWriter":
        with naming_write(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            remove_left_by_dead(self.path.parent, f".{self.path.name}.tmp-")  # (a killed predict's)
            self.tmp.touch()
        return self

    def write(self, table) -> None:  # noqa: ANN001 - a pyarrow Table
        import pyarrow.csv as csv
        import pyarrow.parquet as pq

        with naming_write(self.path):
            if self.writer is None:
                self.writer = (csv.CSVWriter if self.as_csv else pq.ParquetWriter)(str(self.tmp), table.schema)
            self.writer.write_table(table)

    def __exit__(self, kind, error, trace) -> None:  # noqa: ANN001
        try:
            if kind is None:
                with naming_write(self.path):
                    if self.writer is None:  # no rows: an empty file of the columns' types
                        import pyarrow as pa

                        self.write(pa.table({"score": pa.array([], pa.float64())}))
                    self.writer.close()
                    os.replace(self.tmp, self.path)
                    return
            if self.writer is not None:
                with contextlib.suppress(Exception):
                    self.writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)
