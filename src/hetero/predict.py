"""``hetero predict``: a trained run's checkpoint scoring a schema-described file, streamed.

A run trained from a schema (``hetero train --config``) keeps beside its checkpoints what
scoring needs: ``encoding.json`` + ``vocabularies.parquet`` (the fitted schema:
:func:`hetero.data.encode.save_encoding`) and ``model.json`` (:class:`ModelRecord`). Prediction
streams the file in blocks (:func:`hetero.data.stream.encoded_blocks`), memory bounded as in
training; under torchrun each rank scores its shard (:func:`hetero.data.stream.file_shards`)
and rank 0 joins the parts in file order. The output (Parquet, or CSV by the suffix) has one row
per input row: ``score`` (the predicted probability, float64) and, when the file has the label
column, ``label`` (0/1 by the schema's rule).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from hetero.checkpoint import CheckpointError, check_model_compatible, load_checkpoint
from hetero.data.encode import load_encoding
from hetero.data.readers import ReaderConfig, file_columns
from hetero.data.stream import StreamConfig, encoded_blocks, file_shards
from hetero.data.tabular import FeatureRole
from hetero.models.dlrm import DLRM, DLRMConfig
from hetero.models.wide_deep import FeatureSlot, WideDeep, WideDeepConfig

MODEL_FILE = "model.json"


@dataclasses.dataclass(frozen=True)
class ModelRecord:
    """What rebuilds a run's model for scoring (written by ``hetero train`` as ``model.json``).

    Attributes:
        kind: the model (``"wide_deep"``, ``"dlrm"``).
        config: the model config's fields (e.g. :class:`WideDeepConfig`'s).
        num_dense: dense input features.
    """

    kind: str
    config: dict
    num_dense: int

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (MODEL_FILE + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")
        os.replace(tmp, directory / MODEL_FILE)

    @staticmethod
    def load(directory: Path) -> "ModelRecord":
        path = directory / MODEL_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{directory} has no {MODEL_FILE}: score the run directory of a `hetero train "
                                    f"--config` job (runs trained before hetero saved one cannot be scored this way)")
        return ModelRecord(**json.loads(path.read_text()))


def predict(checkpoint: str | Path, data: str | Path, out: str | Path, reader: ReaderConfig = ReaderConfig(),
            batch_size: int = 8192, rank: int = 0, world_size: int = 1) -> Path | None:
    """Score ``data`` with ``checkpoint`` (an integrated checkpoint of a schema run) into ``out``.

    With ``world_size`` > 1 (every rank calls it, torch.distributed initialised), rank ``r``
    scores its byte shard into ``out.part-r``; rank 0 then joins the parts in order into ``out``.
    Returns ``out`` on rank 0, ``None`` on the others.

    Raises:
        FileNotFoundError: no checkpoint, no ``encoding.json``/``model.json`` beside it, or no data.
        CheckpointError: a sharded checkpoint (merge it: ``hetero checkpoint merge``), or one
            that does not fit the recorded model.
        ValueError: the data lacks a feature column (naming the file's columns), or a bad value
            (file, line, column, value).
    """
    import pyarrow as pa

    checkpoint, data, out = Path(checkpoint), Path(data), Path(out)
    if checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint} is a sharded checkpoint: merge it into one file with `hetero checkpoint "
                              f"merge {checkpoint} merged.pt` and score that")
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    if out.suffix not in (".parquet", ".csv"):
        raise ValueError(f"--out {out}: give a .parquet or .csv file")
    run = checkpoint.parent
    encoding, record = load_encoding(run), ModelRecord.load(run)
    names = file_columns(data, reader)
    labelled = encoding.schema.label.column in names
    if not labelled:  # rows to score, no labels: the output has no label column
        encoding = dataclasses.replace(encoding, schema=encoding.schema.unlabelled())
    model = _model(encoding.specs(), record)
    state = load_checkpoint(checkpoint)["model"]
    check_model_compatible(model.state_dict(), state, checkpoint)
    model.load_state_dict(state)
    model.eval()
    shard = file_shards(data, reader, world_size)[rank] if world_size > 1 else None
    part = out if world_size == 1 else out.with_name(f"{out.name}.part-{rank}")
    scores, labels = [], []
    with torch.no_grad():
        for block in encoded_blocks(data, encoding, reader, shard, StreamConfig(block_bytes=1 << 22)):
            for b in block.batches(batch_size):
                scores.append(torch.sigmoid(model(b.features, b.dense)).double())
                labels.append(b.label)
    columns = {"score": torch.cat(scores).numpy() if scores else torch.zeros(0, dtype=torch.float64).numpy()}
    if labelled:
        columns["label"] = torch.cat(labels).numpy().astype("int8") if labels else torch.zeros(0).numpy().astype("int8")
    as_csv = out.suffix == ".csv"
    _write(pa.table(columns), part, as_csv)
    if world_size == 1:
        return out
    torch.distributed.barrier()  # every part written
    if rank != 0:
        return None
    parts = [out.with_name(f"{out.name}.part-{r}") for r in range(world_size)]
    _write(pa.concat_tables([_read(p, as_csv) for p in parts]), out, as_csv)
    for p in parts:
        p.unlink()
    return out


def _model(specs: tuple, record: ModelRecord) -> WideDeep | DLRM:
    slots = [FeatureSlot(f.name, f.vocab_size, f.multi_hot, wide=f.role is not FeatureRole.DEEP,
                         deep=f.role is not FeatureRole.WIDE) for f in specs]
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record.config.items()}
    if record.kind == "dlrm":
        return DLRM(slots, record.num_dense, DLRMConfig(**fields))
    if record.kind == "wide_deep":
        return WideDeep(slots, record.num_dense, WideDeepConfig(**fields))
    raise ValueError(f"{MODEL_FILE}: model {record.kind!r} cannot be scored here (known: 'wide_deep', 'dlrm')")


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


def _read(path: Path, as_csv: bool):  # noqa: ANN202 - a pyarrow Table
    import pyarrow.csv as csv
    import pyarrow.parquet as pq

    return csv.read_csv(path) if as_csv else pq.read_table(path)
