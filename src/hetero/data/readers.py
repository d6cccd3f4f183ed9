"""Reading a user's file for a :class:`~hetero.data.schema.Schema`, on pyarrow: CSV/TSV (any
delimiter, with a header or named columns, quoted fields) and Parquet, into a ``pyarrow.Table``
of the schema's columns - categorical as strings (an empty field is null), dense as float64, the
label as text (positive values) or float64 (a threshold). Decoding is pyarrow's, multithreaded.

:func:`read_dataset` reads a file, splits it (seeded, random), fits the schema on the training
split and encodes all three (:mod:`hetero.data.encode`).

Reference: Apache Arrow's CSV and Parquet readers.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hetero.data.encode import Encoding, fit
from hetero.data.schema import Schema
from hetero.data.tabular import TabularDataset

if TYPE_CHECKING:
    import pyarrow as pa


class FileFormat(enum.Enum):
    """A file's format."""

    CSV = "csv"  # any delimiter: CSV, TSV, ...
    PARQUET = "parquet"


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    """How a file is read.

    Attributes:
        format: the :class:`FileFormat`.
        delimiter: CSV: the field separator (``"\\t"`` for TSV).
        header: CSV: the first line names the columns.
        column_names: CSV without a header: the columns' names, in file order.
        quote_char: CSV: the quote around fields holding the delimiter.
    """

    format: FileFormat = FileFormat.CSV
    delimiter: str = ","
    header: bool = True
    column_names: tuple[str, ...] = ()
    quote_char: str = '"'

    def __post_init__(self) -> None:
        object.__setattr__(self, "column_names", tuple(self.column_names))
        if self.format is FileFormat.CSV and not self.header and not self.column_names:
            raise ValueError("a CSV file without a header needs column_names: the columns' names in file order")
        if len(self.delimiter) != 1:
            raise ValueError(f"delimiter {self.delimiter!r}: give one character (e.g. ',' or '\\t')")


@dataclasses.dataclass(frozen=True)
class Split:
    """How a file's rows become train / validation / test.

    Attributes:
        fractions: the three parts' shares of the rows (positive, summing to 1).
        time_column: ``None``: a random split, seeded; else the rows in this column's order
            (numbers, or ISO-8601 text), the earliest the training part and the latest the test
            part - no future row trains a model scored on the past.
        valid_path, test_path: the validation and test rows in files of their own (the first
            file then trains, whole; ``fractions`` and ``time_column`` are unused).
    """

    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    time_column: str | None = None
    valid_path: Path | None = None
    test_path: Path | None = None

    def __post_init__(self) -> None:
        fr = tuple(self.fractions)
        object.__setattr__(self, "fractions", fr)
        if len(fr) != 3 or any(f <= 0 for f in fr) or abs(sum(fr) - 1) > 1e-9:
            raise ValueError(f"split fractions {list(fr)}: give three positive fractions summing to 1 (train, "
                             f"validation, test)")
        if (self.valid_path is None) != (self.test_path is None):
            raise ValueError("a split by files needs both valid_path and test_path")


def read_table(path: str | Path, schema: Schema, config: ReaderConfig = ReaderConfig(),
               extra: tuple[str, ...] = ()) -> pa.Table:
    """The schema's columns of ``path``, typed (see the module docstring), and the columns
    ``extra`` as pyarrow infers them (e.g. a time column).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a column the schema names is missing (naming the file's columns), or a dense
            or threshold-label value that is not a number (naming the file, row, column, value).
    """
    import pyarrow as pa
    import pyarrow.csv as csv
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    numeric = [d.column for d in schema.dense] + ([schema.label.column] if schema.label.threshold is not None else [])
    types = {c: pa.float64() if c in numeric else pa.string() for c in schema.columns}
    wanted = schema.columns + [c for c in extra if c not in schema.columns]
    if config.format is FileFormat.PARQUET:
        _check_extra(schema, pq.read_schema(path).names, extra, path)
        table = pq.read_table(path, columns=wanted)
        return pa.table({c: table.column(c).cast(types[c]) if c in types else table.column(c) for c in wanted})
    read = csv.ReadOptions(column_names=list(config.column_names) or None)
    parse = csv.ParseOptions(delimiter=config.delimiter, quote_char=config.quote_char)
    names = csv.open_csv(path, read_options=read, parse_options=parse).schema.names  # the header only
    _check_extra(schema, names, extra, path)
    as_text = csv.ConvertOptions(column_types={c: pa.string() for c in schema.columns}, include_columns=wanted,
                                 strings_can_be_null=True)
    table = csv.read_csv(path, read_options=read, parse_options=parse, convert_options=as_text)
    return pa.table({c: _typed(table.column(c), types[c], path, c) if c in types else table.column(c) for c in wanted})


def read_dataset(path: str | Path, schema: Schema, config: ReaderConfig = ReaderConfig(), split: Split = Split(),
                 seed: int = 0) -> tuple[TabularDataset, TabularDataset, TabularDataset, Encoding]:
    """``path`` split into train/validation/test by ``split`` (random ones seeded by ``seed``),
    the schema fitted on the training rows only, each part encoded; and the :class:`Encoding`.

    Raises:
        ValueError: as :func:`read_table` (also for the validation and test files).
    """
    import pyarrow.compute as pc

    if split.valid_path is not None:
        parts = [read_table(p, schema, config) for p in (path, split.valid_path, split.test_path)]
        sources = [str(p) for p in (path, split.valid_path, split.test_path)]
    else:
        extra = (split.time_column,) if split.time_column is not None else ()
        table = read_table(path, schema, config, extra)
        n, fr = table.num_rows, split.fractions
        if split.time_column is not None:  # stable: rows of one time keep their file order
            times = table.column(split.time_column)
            if times.null_count:
                row = pc.indices_nonzero(pc.is_null(times))[0].as_py()
                raise ValueError(f"{path}: row {row + 1} has no value in the time column {split.time_column!r}; fill it "
                                 f"or drop the row")
            order = np.asarray(table.column(split.time_column).to_numpy(zero_copy_only=False).argsort(kind="stable"))
            table = table.drop_columns([c for c in extra if c not in schema.columns])
        else:
            order = np.random.default_rng(seed).permutation(n)
        bounds = [0, round(n * fr[0]), round(n * (fr[0] + fr[1])), n]
        parts = [table.take(order[a:b]) for a, b in zip(bounds, bounds[1:])]
        sources = [f"{path} ({part} split)" for part in ("training", "validation", "test")]
    encoding = fit(schema, parts[0], sources[0])
    train, valid, test = (encoding.encode(t, source) for t, source in zip(parts, sources))
    return train, valid, test, encoding


def _check_extra(schema: Schema, names: list[str], extra: tuple[str, ...], path: Path) -> None:
    schema.check(names, str(path))
    missing = [c for c in extra if c not in names]
    if missing:
        raise ValueError(f"{path} has no column {missing[0]!r} (the split's time column); its columns are {names}")


def _typed(col: pa.ChunkedArray, kind: pa.DataType, path: Path, name: str) -> pa.ChunkedArray:
    """``col`` (text) as ``kind``; a value that does not convert is named with its row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if kind == pa.string():
        return col
    stripped = pc.utf8_trim_whitespace(col)
    stripped = pc.if_else(pc.equal(stripped, ""), None, stripped)  # an empty field is missing, not an error
    try:
        return stripped.cast(kind)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        for row, value in enumerate(stripped.to_pylist()):  # the error path only: find the row
            try:
                float(value) if value is not None else None
            except ValueError:
                raise ValueError(f"{path}: row {row + 1}, column {name!r}: {value!r} is not a number; fix the value, "
                                 f"or declare the column categorical") from None
        raise
