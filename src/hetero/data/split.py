"""A file's rows as train / validation / test: a seeded random split, a split by a time column,
or files of their own (:class:`Split`); :func:`read_dataset` reads a file whole
(:mod:`hetero.data.readers`), splits it, fits the schema on the training rows only and encodes
the three parts (:mod:`hetero.data.encode`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from typing import TYPE_CHECKING

from hetero.data.encode import Encoding, fit
from hetero.data.rows import BadRowCount
from hetero.data.reader_config import ReaderConfig, inferred, with_format_separators
from hetero.data.readers import read_table
from hetero.data.schema import Schema
from hetero.data.tabular import TabularDataset

if TYPE_CHECKING:
    import pyarrow as pa


@dataclasses.dataclass(frozen=True)
class Split:
    """How a file's rows become train / validation / test.

    Attributes:
        fractions: the three parts' shares of the rows (positive, summing to 1): exact for a
            time split, in expectation for a random one (:meth:`assign`); two (train,
            validation) with a ``test_path`` alone: the test rows are that file's.
        time_column: ``None``: a random split, seeded; else the rows in this column's order
            (numbers, or ISO-8601 text), the earliest the training part and the latest the test
            part - no future row trains a model scored on the past.
        valid_path, test_path: the validation and test rows in files of their own (the first
            file then trains, whole; ``fractions`` and ``time_column`` are unused); or the test
            rows alone in ``test_path`` (``fractions``: the first file's train and validation).
        time_format: the time column's text as ``strptime`` reads it (``"%m/%d/%Y %H:%M"``:
            TalkingData's ``11/7/2017 9:30``); ``None``: numbers or ISO-8601 text.
        valid_reader, test_reader: how those files read, where not as the training file (Avazu's
            ``dev.csv`` and ``test.csv`` have no header); ``None``: as the training file.
    """

    fractions: tuple[float, float, float] | tuple[float, float] = (0.8, 0.1, 0.1)
    time_column: str | None = None
    valid_path: Path | None = None
    test_path: Path | None = None
    time_format: str | None = None
    valid_reader: ReaderConfig | None = None
    test_reader: ReaderConfig | None = None

    def __post_init__(self) -> None:
        fr = tuple(self.fractions)
        object.__setattr__(self, "fractions", fr)
        parts = 2 if self.test_path is not None and self.valid_path is None else 3
        if len(fr) != parts or any(f <= 0 for f in fr) or abs(sum(fr) - 1) > 1e-9:
            what = ("two positive fractions summing to 1 (train, validation: test_path holds the test rows)"
                    if parts == 2 else "three positive fractions summing to 1 (train, validation, test)")
            raise ValueError(f"split fractions {list(fr)}: give {what}")
        if self.valid_path is not None and self.test_path is None:
            raise ValueError("valid_path needs test_path: give the test rows' file too (or test_path alone, with "
                             "split = [train, validation] of the training file)")
        if self.time_format is not None and self.time_column is None:
            raise ValueError("time_format reads a time column: set time_column too, or drop time_format")

    def reader_of(self, part: str, base: ReaderConfig) -> ReaderConfig:
        """How the ``part`` (``"valid"``, ``"test"``) file reads: its own reader, else ``base``."""
        own = self.valid_reader if part == "valid" else self.test_reader
        return base if own is None else own

    def assign(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        """The random split's part (0 train, 1 validation, 2 test) of the next ``rows`` rows, in
        file order: one uniform draw of ``rng`` per row against the cumulative fractions. Draws
        continue across calls, so a file read in blocks is split as one read whole: the single
        definition of a random split, used in memory and by ``hetero data prepare``. Each part's
        share is its fraction in expectation.

        Returns:
            int64 ``(rows,)``.
        """
        return np.searchsorted(np.cumsum(self.fractions)[:-1], rng.random(rows), side="right")


def read_dataset(path: str | Path, schema: Schema, config: ReaderConfig = ReaderConfig(), split: Split = Split(),
                 seed: int = 0, bad: BadRowCount | None = None
                 ) -> tuple[TabularDataset, TabularDataset, TabularDataset, Encoding]:
    """``path`` split into train/validation/test by ``split`` (random ones seeded by ``seed``),
    the schema fitted on the training rows only, each part encoded; and the :class:`Encoding`.
    ``bad``: counts the rows of every file skipped as bad (``on_bad_rows = "skip"``).

    Raises:
        ValueError: as :func:`read_table` (also for the validation and test files).
    """
    import pyarrow.compute as pc

    schema = with_format_separators(schema, inferred(config, path))  # (as a job file's schema reads)
    if split.valid_path is not None:
        parts = [read_table(path, schema, config, bad=bad),
                 read_table(split.valid_path, schema, split.reader_of("valid", config), bad=bad),
                 read_table(split.test_path, schema, split.reader_of("test", config), bad=bad)]
        sources = [str(p) for p in (path, split.valid_path, split.test_path)]
    else:
        extra = (split.time_column,) if split.time_column is not None else ()
        table = read_table(path, schema, config, extra, bad=bad)
        n, fr = table.num_rows, split.fractions
        if split.time_column is not None:  # stable: rows of one time keep their file order
            times = table.column(split.time_column)
            if times.null_count:
                row = pc.indices_nonzero(pc.is_null(times))[0].as_py()
                raise ValueError(f"{path}: row {row + 1} has no value in the time column {split.time_column!r}; fill it "
                                 f"or drop the row")
            order = time_order(table.column(split.time_column), f"{path}", split.time_column, split.time_format)
            table = table.drop_columns([c for c in extra if c not in schema.columns])
            bounds = [0, *(round(n * float(np.sum(fr[:k]))) for k in range(1, len(fr))), n]
            parts = [table.take(order[a:b]) for a, b in zip(bounds, bounds[1:])]
        else:  # the rows of each part in file order (training shuffles them per epoch)
            which = split.assign(np.random.default_rng(seed), n)
            parts = [table.filter(which == k) for k in range(len(fr))]
        sources = [f"{path} ({part} split)" for part in ("training", "validation", "test")]
        if split.test_path is not None:  # the test rows: a file of their own
            parts.append(read_table(split.test_path, schema, split.reader_of("test", config), bad=bad))
            sources[2] = str(split.test_path)
    encoding = fit(schema, parts[0], sources[0])
    train, valid, test = (encoding.encode(t, source) for t, source in zip(parts, sources))
    return train, valid, test, encoding


def time_order(col: pa.Array | pa.ChunkedArray, source: str, name: str,
               time_format: str | None = None) -> np.ndarray:
    """The stable order of a time column's rows by the column's own type: numbers as numbers,
    ISO-8601 text (``2026-01-05``, ``2026-01-05T10:00:00``, with ``Z`` or an offset) as instants
    - never as text, where ``"10"`` sorts before ``"9"``; with ``time_format``, text as that
    ``strptime`` format reads it (pyarrow's ``strptime``).

    Raises:
        ValueError: a column that is neither numbers nor ISO-8601 timestamps, or a value the
            format does not read (naming ``source``, the column and the value).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    keys = None
    if time_format is not None:
        text = pc.utf8_trim_whitespace(col.cast(pa.string()))
        keys = pc.strptime(text, format=time_format, unit="s", error_is_null=True)
        if keys.null_count:
            row = pc.indices_nonzero(pc.is_null(keys))[0].as_py()
            raise ValueError(f"{source}: row {row + 1} of the time column {name!r} holds {text[row].as_py()!r}, which "
                             f"time_format = {time_format!r} does not read: fix the value or the format (strptime's "
                             f"codes: %Y-%m-%d %H:%M:%S)")
    elif pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_temporal(col.type):
        keys = col
    else:
        text = pc.utf8_trim_whitespace(col.cast(pa.string()))
        for kind in (pa.float64(), pa.timestamp("ns"), pa.timestamp("ns", tz="UTC")):
            try:
                keys = text.cast(kind)
                break
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
        if keys is None:
            odd = next(v for v in text.to_pylist() if not _number_or_instant(v))
            raise ValueError(f"{source}: time column {name!r} holds {odd!r}, neither a number nor an ISO-8601 "
                             f"timestamp (2026-01-05T10:00:00): a time split orders rows by time; give such a column")
    if pa.types.is_timestamp(keys.type) or pa.types.is_date(keys.type):
        keys = keys.cast(pa.int64()) if pa.types.is_timestamp(keys.type) else keys.cast(pa.int32())
    return np.asarray(keys.to_numpy(zero_copy_only=False)).argsort(kind="stable")


def _number_or_instant(value: str) -> bool:
    import datetime

    try:
        float(value)
        return True
    except ValueError:
        pass
    try:
        datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        return True
    except ValueError:
        return False
