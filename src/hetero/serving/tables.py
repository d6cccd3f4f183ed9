"""An export's tables (:class:`TableRows`) and files: each table a Parquet file of sorted keys
and rows (and a fixed table's raw feature values), its content digest (:class:`TablesDigest`: what
names an export and a delta's base), the manifest and the atomic publish of a directory."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 2  # 2: source and base identities (1: paths; still scored, never a delta's base)
READABLE = (1, 2)
MANIFEST, DENSE, RECORD = "manifest.json", "dense.pt2", "record.pt"


@dataclasses.dataclass
class TableRows:
    """One table's rows as exported: ``keys`` ``(n,)`` int64 sorted, ``rows`` ``(n, D)`` float32,
    and a dynamic table's default row ``(D,)`` (``None`` for a fixed table, whose keys are ids)."""

    keys: np.ndarray
    rows: np.ndarray
    default: np.ndarray | None


class TablesDigest:
    """The SHA-256 of a set of exported tables, fed table by table in sorted name order: per
    table its name, key count, width, keys (int64), rows (float32) and default row."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._last = ""

    def add(self, name: str, rows: TableRows) -> None:
        assert name > self._last, "tables are fed in sorted name order"
        self._last = name
        keys = np.ascontiguousarray(rows.keys, np.int64)
        weight = np.ascontiguousarray(rows.rows, np.float32)
        width = weight.shape[1] if weight.ndim == 2 else 0
        self._h.update(f"{name}\0{keys.shape[0]}\0{width}\0".encode())
        self._h.update(memoryview(keys).cast("B"))
        self._h.update(memoryview(weight.reshape(-1)).cast("B"))
        if rows.default is not None:
            self._h.update(memoryview(np.ascontiguousarray(rows.default, np.float32)).cast("B"))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def tables_digest(tables: dict[str, TableRows]) -> str:
    """:class:`TablesDigest` of ``tables`` (qualified name -> rows)."""
    d = TablesDigest()
    for name in sorted(tables):
        d.add(name, tables[name])
    return d.hexdigest()


def publish(tmp: Path, out: Path) -> None:
    """The complete directory ``tmp`` becomes ``out`` (one rename), with the permissions the umask
    gives a new directory (``mkdtemp`` made it private)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)
    os.replace(tmp, out)


def read_manifest(directory: Path) -> dict[str, Any]:
    """An export directory's manifest.

    Raises:
        FileNotFoundError: no manifest there (naming what writes one).
        ValueError: another format version.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: give a directory `hetero export` wrote")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") not in READABLE:
        raise ValueError(f"{path}: export format {manifest.get('format_version')}; this hetero reads {READABLE}")
    return manifest


def write_table(path: Path, keys: np.ndarray, rows: np.ndarray | None, values: np.ndarray | None = None) -> None:
    """Keys (and rows, ``(n, D)`` float32; and ``values``, ``(n,)`` the raw feature value of each
    key, ``None`` where it has none) as a Parquet file: ``key``, ``embedding``, ``value``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"key": pa.array(keys, pa.int64())}
    if rows is not None:
        flat = pa.array(np.ascontiguousarray(rows, np.float32).reshape(-1), pa.float32())
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(flat, rows.shape[1])
    if values is not None:
        columns["value"] = pa.array(values.tolist(), pa.string())
    pq.write_table(pa.table(columns), path)


def read_table(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """What :func:`write_table` wrote: keys ``(n,)`` int64, rows ``(n, D)`` float32 (``None``: none)."""
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=[c for c in ("key", "embedding") if c in pq.read_schema(path).names])
    keys = t.column("key").to_numpy()
    if "embedding" not in t.column_names:
        return keys, None
    emb = t.column("embedding").combine_chunks()
    return keys, emb.values.to_numpy().reshape(len(keys), emb.type.list_size)


def read_values(path: Path) -> np.ndarray | None:
    """The ``value`` column :func:`write_table` wrote (object ``(n,)``: text or ``None``), if any."""
    import pyarrow.parquet as pq

    if "value" not in pq.read_schema(path).names:
        return None
    return np.array(pq.read_table(path, columns=["value"]).column("value").to_pylist(), dtype=object)
