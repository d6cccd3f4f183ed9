"""Rows as a reader hands them on: text cast to the schema's types, a bad row named (file, line,
column, value) or skipped and counted, a rank's byte range of a file, the file's line numbers."""

from __future__ import annotations

import dataclasses
import enum
import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("hetero")


class BadRows(enum.Enum):
    """What a reader does with a row it cannot use: a field count other than the file's, or a
    dense/threshold-label value that is not a number."""

    ERROR = "error"  # stop, naming the file, row, column and value
    SKIP = "skip"  # leave the row out and count it (BadRowCount), the first one named in the log


BAD_ROW = "__hetero_bad_row__"  # the flag column of a reader that marks bad rows (BadRowCount.mark)


@dataclasses.dataclass
class BadRowCount:
    """Rows skipped under ``BadRows.SKIP``: how many, and the first one's description.

    ``mark``: keep every row a reader can split into columns, a bad one flagged ``True`` in a bool
    column :data:`BAD_ROW` (its values as read, or null) instead of left out - what ``hetero
    predict`` reads with, so that its output has one row per input row; a row it cannot split
    (another field count) is then an error naming it."""

    rows: int = 0
    first: str = ""
    mark: bool = False

    def add(self, rows: int, what: str) -> None:
        if rows and not self.rows:
            self.first = what
            log.warning("hetero: %s bad rows (on_bad_rows = skip); the first: %s",
                        "marking" if self.mark else "skipping", what)
        self.rows += rows


COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")  # a line file's suffixes pyarrow decompresses as it reads


def compressed(path: Path) -> bool:
    """Whether ``path`` is a compressed line file (by its suffix: :data:`COMPRESSED`)."""
    return path.suffix.lower() in COMPRESSED


def open_data(path: Path, start: int = 0):  # noqa: ANN201 - a binary file object
    """``path`` opened for binary reading at byte ``start`` of its (decompressed) text: a
    compressed file is decompressed as it is read (pyarrow's codecs), its first ``start`` bytes
    read and dropped (a compressed stream cannot seek)."""
    if not compressed(path):
        f = open(path, "rb")  # noqa: SIM115 - the caller closes it
        f.seek(start)
        return f
    import pyarrow as pa

    f = pa.input_stream(str(path), compression="detect")
    while start > 0:
        start -= len(f.read(min(start, 1 << 24)))
    return f


def data_end(path: Path) -> int:
    """The end of ``path``'s text in bytes (a compressed file's: unknown until read, so as large as any)."""
    import sys

    return sys.maxsize if compressed(path) else path.stat().st_size


class ByteRange(io.RawIOBase):
    """``size`` bytes of an open file from its position: one rank's shard of a CSV file."""

    def __init__(self, f: io.BufferedReader, size: int) -> None:
        self.f, self.left = f, size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        n = self.f.readinto(memoryview(buffer)[: min(len(buffer), self.left)])
        self.left -= n
        return n


class LineCounter:
    """The file's line number of a shard's row (error messages only: it counts the lines before
    the shard on first use)."""

    def __init__(self, path: Path, start: int) -> None:
        self.path, self.start, self.before = path, start, -1

    def line(self, row: int) -> int:
        if self.before < 0:
            self.before = 0
            with open_data(self.path) as f:
                left = self.start
                while left > 0:
                    chunk = f.read(min(left, 1 << 24))
                    self.before, left = self.before + chunk.count(b"\n"), left - len(chunk)
        return self.before + row + 1


@dataclasses.dataclass(frozen=True)
class ValueRule:
    """What a column's values must be beyond their type (checked as rows are read; a row that
    breaks it is named - file, line, column, value - or skipped and counted, as a value that is
    not a number is).

    Attributes:
        column: the column.
        allowed: text values allowed, compared stripped and case-folded (a label's positive and
            negative values; a missing value compares as ``""``); ``None``: any.
        finite: numbers must be finite: ``NaN``, ``inf`` and ``-inf`` break the rule.
        fill: with ``finite``, a non-finite number reads as this instead (a schema's fill).
        whole: a column of floats (a Parquet file's) must hold whole numbers: ids stored as floats
            (a dynamic feature's keys, read as their text).
        fix: the advice the error gives.
    """

    column: str
    allowed: tuple[str, ...] | None = None
    finite: bool = False
    fill: float | None = None
    whole: bool = False
    fix: str = ""


def typed_batch(batch: pa.RecordBatch, types: dict, wanted: list[str], path: Path, first: int,
                on_bad_rows: BadRows, bad: BadRowCount, lines: LineCounter | None = None,
                rules: tuple[ValueRule, ...] = (), marked: np.ndarray | None = None) -> pa.RecordBatch:
    """``batch`` with text columns cast to their types and ``rules`` applied; rows with a value
    that does not convert or breaks a rule are named (the error) or dropped and counted
    (``BadRows.SKIP``), or flagged in a :data:`BAD_ROW` column (``bad.mark``; ``marked``: rows
    the caller found bad already, ``(len(batch),)`` bool)."""
    import pyarrow as pa

    columns, drop, first_bad = {}, None, ""

    def flag(name: str, original: pa.Array, rows: np.ndarray, reason: str, fix: str) -> None:
        nonlocal drop, first_bad
        where = (f"{path}: {'line' if lines else 'row'} "
                 f"{lines.line(first + int(rows[0])) if lines else first + int(rows[0]) + 1}, column {name!r}: "
                 f"{original[int(rows[0])].as_py()!r} {reason}")
        if on_bad_rows is BadRows.ERROR:
            raise ValueError(f"{where}; {fix}, or set on_bad_rows = \"skip\"")
        mask = np.zeros(len(batch), dtype=bool)
        mask[rows] = True
        drop = mask if drop is None else drop | mask
        first_bad = first_bad or where

    for name in wanted:
        col = batch.column(name)
        if pa.types.is_floating(col.type) and any(r.whole and r.column == name for r in rules):
            x = col.to_numpy(zero_copy_only=False)
            rows = np.flatnonzero(np.isinf(x) | (np.isfinite(x) & (x != np.round(x))))
            if rows.size:
                fix = next(r.fix for r in rules if r.whole and r.column == name)
                flag(name, col, rows, "is not a whole number", fix)
        if name in types and col.type != types[name]:
            col, rows = _typed(col, types[name])
            if rows:
                flag(name, batch.column(name), np.asarray(rows), "is not a number",
                     "fix the value, declare the column categorical")
        columns[name] = col
    for rule in rules:
        if rule.column in columns:
            columns[rule.column] = _apply(rule, columns[rule.column], flag)
    out = pa.RecordBatch.from_pydict(columns)
    if drop is not None:
        bad.add(int((drop & ~marked).sum()) if marked is not None else int(drop.sum()), first_bad)
    if bad.mark:
        flags = np.zeros(len(batch), dtype=bool) if drop is None else drop
        return out.append_column(BAD_ROW, pa.array(flags if marked is None else flags | marked))
    if drop is not None:
        out = out.filter(pa.array(~drop))
    return out


def _apply(rule: ValueRule, col: pa.Array, flag) -> pa.Array:  # noqa: ANN001 - typed_batch's flag
    """``col`` under ``rule``: bad rows flagged, non-finite numbers filled."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if rule.finite:
        x = col.to_numpy(zero_copy_only=False)  # float64; a missing value is NaN here: masked by validity
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        broken = valid & ~np.isfinite(x)
        if broken.any():
            if rule.fill is None:
                flag(rule.column, col, np.flatnonzero(broken), "is not a finite number", rule.fix)
            else:
                col = pc.if_else(pa.array(broken), pa.scalar(float(rule.fill), pa.float64()), col)
    if rule.allowed is not None:
        text = normalized_text(col)
        outside = pc.invert(pc.is_in(text, value_set=pa.array(rule.allowed, pa.string())))
        rows = np.flatnonzero(outside.to_numpy(zero_copy_only=False))
        if rows.size:
            flag(rule.column, col, rows, f"is neither of {list(rule.allowed)}", rule.fix)
    return col


def normalized_text(col: pa.Array) -> pa.Array:
    """``col``'s values as text stripped and case-folded; a missing value is ``""``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = col.cast(pa.string()) if col.type != pa.string() else col
    return pc.utf8_lower(pc.utf8_trim_whitespace(text)).fill_null("")


def _typed(col: pa.Array, kind: pa.DataType) -> tuple[pa.Array, list[int]]:
    """``col`` (text) as ``kind`` (an empty field null), and the rows whose value does not
    convert (null in the result)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if kind in (pa.binary(), pa.string()) and not (pa.types.is_string(col.type) or pa.types.is_binary(col.type)):
        # numbers (a Parquet int64 id column) as their decimal text: 42 hashes as "42" does in a CSV file
        return col.cast(pa.string()).cast(kind), []
    try:
        return col.cast(kind), []
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    stripped = pc.utf8_trim_whitespace(col)
    stripped = pc.if_else(pc.equal(stripped, ""), None, stripped)  # an empty field is missing, not an error
    try:
        return stripped.cast(kind), []
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    values, rows = stripped.to_pylist(), []  # the error path only: find the rows
    for row, value in enumerate(values):
        try:
            float(value) if value is not None else None
        except ValueError:
            rows.append(row)
            values[row] = None
    return pa.array(values, type=pa.string()).cast(kind), rows
