"""Deltas between two exports of one run: the rows added or changed and the keys evicted
(:func:`delta_of`), and a delta applied to the full export it starts from (:func:`apply_delta`),
matched by content (:class:`~hetero.serving.tables.TablesDigest`), never by path."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hetero.serving.tables import (
    DENSE, MANIFEST, RECORD, TableRows, TablesDigest, publish, read_manifest, read_table, read_values, write_table,
)


def delta_of(old: TableRows, new: TableRows) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``new`` of the keys added or changed since ``old``, and the keys ``old`` has
    and ``new`` has not (tombstones)."""
    at = np.minimum(np.searchsorted(old.keys, new.keys), max(old.keys.shape[0] - 1, 0))
    known = (old.keys[at] == new.keys) if old.keys.shape[0] else np.zeros(new.keys.shape[0], bool)
    same = known.copy()
    same[known] = (old.rows[at[known]] == new.rows[known]).all(axis=1)
    gone = old.keys[~np.isin(old.keys, new.keys, assume_unique=True)]
    return np.flatnonzero(~same), gone


def apply_delta(base: str | Path, delta: str | Path, out: str | Path) -> dict[str, Any]:
    """The full export that ``delta`` (of checkpoints A -> B) makes of ``base`` (A's full export),
    written into the new directory ``out``: equal to B's full export. Returns its manifest.

    A delta fits an export by content, never by path: the digest of ``base``'s rows as read from
    its files must be the delta's ``base`` digest (A's rows), and the result's digest must be its
    ``source`` digest (B's rows); nothing is written otherwise.

    Raises:
        FileExistsError: ``out`` exists.
        ValueError: ``delta`` is not a delta, ``base`` not a full export, a delta of an older
            format (no base identity: export it again), other tables, or rows that are not the
            delta's base (naming both runs and steps), or a result that is not the delta's newer
            export (a damaged file).
    """
    base, delta, out = Path(base), Path(delta), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: give a new directory")
    b, d = read_manifest(base), read_manifest(delta)
    if b["kind"] != "full" or d["kind"] != "delta":
        raise ValueError(f"{delta} ({d['kind']}) does not apply to {base} ({b['kind']}): apply a delta to the full "
                         f"export of the checkpoint it starts from")
    if d.get("base") is None:
        raise ValueError(f"{delta} is a delta of export format {d['format_version']}, which does not record the "
                         f"checkpoint it starts from: export it again with this hetero")
    if sorted(b["tables"]) != sorted(d["tables"]):
        raise ValueError(f"{delta} has tables {sorted(d['tables'])}, {base} {sorted(b['tables'])}: the delta does "
                         f"not apply to this export")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        (tmp / "tables").mkdir()
        tables, had, made = {}, TablesDigest(), TablesDigest()
        for name in sorted(d["tables"]):
            entry = d["tables"][name]
            old_file, new_file = base / "tables" / f"{name}.parquet", delta / "tables" / f"{name}.parquet"
            keys, rows = read_table(old_file)
            had.add(name, TableRows(keys, rows, _default(b["tables"][name])))
            new_keys, new_rows = read_table(new_file)
            gone, _ = read_table(delta / "tables" / f"{name}.tombstones.parquet")
            keep = ~np.isin(keys, np.concatenate([gone, new_keys]))
            keys, rows = np.concatenate([keys[keep], new_keys]), np.concatenate([rows[keep], new_rows])
            values = read_values(old_file), read_values(new_file)  # (a fixed table's raw values)
            values = None if values[0] is None or values[1] is None else np.concatenate([values[0][keep], values[1]])
            order = np.argsort(keys, kind="stable")
            keys, rows = keys[order], rows[order]
            made.add(name, TableRows(keys, rows, _default(entry)))
            write_table(tmp / "tables" / f"{name}.parquet", keys, rows, None if values is None else values[order])
            tables[name] = {k: v for k, v in entry.items() if k not in ("changed", "tombstones")}
        if had.hexdigest() != d["base"]["tables_digest"]:
            raise ValueError(f"{delta} starts from {_named(d['base'])} and {base} holds other rows "
                             f"({_named(b.get('source'))}): apply it to the full export of the checkpoint it starts "
                             f"from")
        if made.hexdigest() != d["source"]["tables_digest"]:
            raise ValueError(f"{delta} applied to {base} does not give the rows of {_named(d['source'])}: a file of "
                             f"either directory was changed after it was written; export again")
        for f in (DENSE, RECORD):
            shutil.copy(delta / f, tmp / f)
        manifest = {**d, "kind": "full", "base": None, "since": None, "tables": tables}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _default(entry: dict[str, Any]) -> np.ndarray | None:
    """A manifest table entry's default row (float32; ``None``: a fixed table)."""
    return None if entry.get("default") is None else np.asarray(entry["default"], np.float32)


def _named(ident: dict[str, Any] | None) -> str:
    if ident is None:
        return "an export of format 1 (no identity)"
    return f"run {ident['run']} at step {ident['step']} (rows {ident['tables_digest'][:12]})"
