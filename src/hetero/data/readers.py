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


def read_table(path: str | Path, schema: Schema, config: ReaderConfig = ReaderConfig()) -> pa.Table:
    """The schema's columns of ``path``, typed (see the module docstring).

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
    if config.format is FileFormat.PARQUET:
        schema.check(pq.read_schema(path).names, str(path))
        table = pq.read_table(path, columns=schema.columns)
        return pa.table({c: table.column(c).cast(types[c]) for c in schema.columns})
    read = csv.ReadOptions(column_names=list(config.column_names) or None)
    parse = csv.ParseOptions(delimiter=config.delimiter, quote_char=config.quote_char)
    names = csv.open_csv(path, read_options=read, parse_options=parse).schema.names  # the header only
    schema.check(names, str(path))
    as_text = csv.ConvertOptions(column_types={c: pa.string() for c in schema.columns}, include_columns=schema.columns,
                                 strings_can_be_null=True)
    table = csv.read_csv(path, read_options=read, parse_options=parse, convert_options=as_text)
    return pa.table({c: _typed(table.column(c), types[c], path, c) for c in schema.columns})


def read_dataset(path: str | Path, schema: Schema, config: ReaderConfig = ReaderConfig(),
                 fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
                 seed: int = 0) -> tuple[TabularDataset, TabularDataset, TabularDataset, Encoding]:
    """``path`` split at random (seeded) into train/validation/test by ``fractions``, the schema
    fitted on the training rows only, each split encoded; and the :class:`Encoding`.

    Raises:
        ValueError: as :func:`read_table`, or fractions that are not three positives summing to 1.
    """
    if len(fractions) != 3 or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"split fractions {fractions}: give three positive fractions summing to 1 (train, "
                         f"validation, test)")
    table = read_table(path, schema, config)
    n = table.num_rows
    order = np.random.default_rng(seed).permutation(n)
    bounds = [0, round(n * fractions[0]), round(n * (fractions[0] + fractions[1])), n]
    parts = [table.take(order[a:b]) for a, b in zip(bounds, bounds[1:])]
    encoding = fit(schema, parts[0], f"{path} (training split)")
    train, valid, test = (encoding.encode(t, str(path)) for t in parts)
    return train, valid, test, encoding


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
