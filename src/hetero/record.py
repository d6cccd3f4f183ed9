"""A run's record: everything that reads a trained run back, kept inside its checkpoints.

``hetero train`` builds one :class:`RunRecord` per run - the model (:class:`ModelRecord`), the
fitted encoding (schema, vocabularies, statistics), the reader settings its files were read
with, the resolved training configuration (optimizers, learning rates, every flag) and the plan
it applied - and the trainer writes it into every checkpoint it saves (integrated or sharded), in
the same atomic write as the weights. So a checkpoint cannot disagree with the files beside it:
there are none. ``hetero train --resume`` compares the checkpoint's record with the run's before
it loads anything (nothing on disk changes when it refuses), and ``hetero predict`` rebuilds the
model and reads the scored file from the record alone, wherever the checkpoint lies (a merged
``model.pt`` too).

In a checkpoint the record is :meth:`RunRecord.to_state`: JSON text and the vocabularies as
Parquet bytes in a ``uint8`` tensor (loadable with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hetero.checkpoint import CheckpointError
from hetero.data.encode import Encoding, encoding_document, encoding_from_document
from hetero.data.reader_config import ReaderConfig, reader_from_dict, reader_to_dict

FORMAT_VERSION = 1
RECORD_KEY = "run_record"  # the checkpoint's key
# what a resume must find equal (the configuration and plan may change: a resume with a new learning rate)
_RESUME_KEYS = ("model", "encoding", "reader")


@dataclasses.dataclass(frozen=True)
class ModelRecord:
    """What rebuilds a run's model.

    Attributes:
        kind: the model (``"wide_deep"``, ``"dlrm"``).
        config: the model config's fields (e.g. :class:`~hetero.models.wide_deep.WideDeepConfig`'s).
        num_dense: dense input features.
    """

    kind: str
    config: dict
    num_dense: int


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What reads a run back (see the module docstring).

    Attributes:
        model: the model's :class:`ModelRecord`.
        encoding: the fitted schema (``None``: a run on a built-in data set, which predict
            cannot score).
        reader: how the run's files were read (``hetero predict`` reads files so too).
        config: the resolved training configuration (every flag, JSON-able).
        plan: the applied plan (:meth:`hetero.planner.plan.Plan.to_dict`), if any.
    """

    model: ModelRecord
    encoding: Encoding | None
    reader: ReaderConfig
    config: Mapping[str, Any]
    plan: Mapping[str, Any] | None = None

    def to_state(self) -> dict[str, Any]:
        """The record as a checkpoint holds it (``torch.load(weights_only=True)`` reads it)."""
        import pyarrow.parquet as pq

        doc: dict[str, Any] = {"format_version": FORMAT_VERSION, "model": dataclasses.asdict(self.model),
                               "reader": reader_to_dict(self.reader), "config": dict(self.config),
                               "plan": None if self.plan is None else dict(self.plan), "encoding": None}
        vocab = torch.zeros(0, dtype=torch.uint8)
        if self.encoding is not None:
            doc["encoding"], table = encoding_document(self.encoding)
            buf = io.BytesIO()
            pq.write_table(table, buf)
            vocab = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        return {"json": json.dumps(doc, sort_keys=True), "vocabularies": vocab}

    @staticmethod
    def from_state(state: Mapping[str, Any], where: str | Path) -> "RunRecord":
        """The record of a checkpoint's state (:meth:`to_state`).

        Raises:
            ValueError: a record of another format (naming ``where``).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        doc = json.loads(state["json"])
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{where}: run record of format {doc.get('format_version')}; this hetero reads format "
                             f"{FORMAT_VERSION}")
        encoding = None
        if doc["encoding"] is not None:
            raw = state["vocabularies"].numpy().tobytes()
            table = pq.read_table(pa.BufferReader(raw)) if raw else None
            encoding = encoding_from_document(doc["encoding"], table, str(where))
        return RunRecord(ModelRecord(**doc["model"]), encoding, reader_from_dict(doc["reader"]), doc["config"],
                         doc["plan"])


def reader_settings(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A reader's settings (:func:`~hetero.data.reader_config.reader_to_dict`) that decide how a file
    reads, without its side tables' paths (they may lie elsewhere now: another ``--data-dir``)."""
    return {**doc, "joins": [{k: v for k, v in j.items() if k != "path"} for j in doc["joins"]]}


def record_differences(saved: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """What of a run's record (``ours``, :meth:`RunRecord.to_state`) differs from a checkpoint's
    (``saved``) in what a resume must keep: the model, the encoding (schema, vocabularies,
    statistics) and the reader settings (side tables' paths apart); one phrase per difference,
    empty when they agree."""
    a, b = json.loads(saved["json"]), json.loads(ours["json"])
    a["reader"], b["reader"] = reader_settings(a["reader"]), reader_settings(b["reader"])
    out = [f"{key} ({first_difference(a.get(key), b.get(key))})" for key in _RESUME_KEYS if a.get(key) != b.get(key)]
    if not torch.equal(saved["vocabularies"], ours["vocabularies"]):
        out.append("vocabularies (another fit of the training split)")
    return out


def first_difference(a: Any, b: Any, path: str = "", sides: tuple[str, str] = ("in the checkpoint", "in this run")
                     ) -> str:  # noqa: ANN401 - JSON values
    """Where two JSON values first differ: ``key.sub: <a> <sides[0]>, <b> <sides[1]>``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k), sides)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]", sides)
    return f"{path or 'value'}: {json.dumps(a)[:80]} {sides[0]}, {json.dumps(b)[:80]} {sides[1]}"


def check_record(state: Mapping[str, Any], ours: Mapping[str, Any], path: str | Path) -> None:
    """Check that a checkpoint's ``state`` holds this run's record ``ours`` (:meth:`RunRecord.to_state`)
    in what a resume must keep (:func:`record_differences`).

    Raises:
        CheckpointError: no record in the checkpoint, or one that differs (naming what).
    """
    if RECORD_KEY not in state:
        raise CheckpointError(f"checkpoint {path} holds no run record (written by an older hetero, or by a run without "
                              f"one): the data, encoding and model it was trained with cannot be checked; start a new run")
    differ = record_differences(state[RECORD_KEY], ours)
    if differ:
        raise CheckpointError(f"checkpoint {path} was trained with another {'; another '.join(differ)}: resume with the "
                              f"job it was saved with, or start a new run in another --run-dir")
