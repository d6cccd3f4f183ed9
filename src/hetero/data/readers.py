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
import io
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hetero.data.encode import Encoding, fit
from hetero.data.rows import BadRowCount, BadRows, ByteRange, LineCounter, typed_batch
from hetero.data.schema import Schema
from hetero.data.svmlight import sparse_format_batches
from hetero.data.tabular import TabularDataset

if TYPE_CHECKING:
    import pyarrow as pa



class FileFormat(enum.Enum):
    """A file's format."""

    CSV = "csv"  # any delimiter: CSV, TSV, ...
    PARQUET = "parquet"
    LIBSVM = "libsvm"  # "label idx:value ...": columns "label" and "features" (the indices, "|"-joined)
    LIBFM = "libfm"  # "label field:idx:value ...": columns "label" and one per field, named by its number


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    """How a file is read.

    Attributes:
        format: the :class:`FileFormat`.
        delimiter: CSV: the field separator (``"\\t"`` for TSV).
        header: CSV: the first line names the columns.
        column_names: CSV without a header: the columns' names, in file order.
        quote_char: CSV: the quote around fields holding the delimiter (``""``: none; faster).
        on_bad_rows: :class:`BadRows`: stop at the first bad row, or skip and count them.
    """

    format: FileFormat = FileFormat.CSV
    delimiter: str = ","
    header: bool = True
    column_names: tuple[str, ...] = ()
    quote_char: str = '"'
    on_bad_rows: BadRows = BadRows.ERROR

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


def column_names(path: Path, config: ReaderConfig) -> tuple[list[str], int]:
    """A CSV file's column names (its header, or ``config.column_names``) and the byte offset
    where its rows start (after the header line)."""
    import pyarrow.csv as csv

    if config.format is FileFormat.LIBSVM:
        return ["label", "features"], 0
    if config.format is FileFormat.LIBFM:  # the fields of the first MiB's lines
        with open(path, "rb") as f:
            head = f.read(1 << 20).decode("utf-8", errors="replace").splitlines()[:-1] or [""]
        fields = {t.split(":")[0] for line in head for t in line.split()[1:]}
        return ["label", *sorted(fields, key=lambda x: (len(x), x))], 0
    if config.column_names:
        return list(config.column_names), 0
    with open(path, "rb") as f:  # the header is one line (no newlines inside quoted names)
        header = f.readline()
    names = csv.read_csv(io.BytesIO(header), parse_options=_parse_options(config)).schema.names  # parsed as CSV
    return names, len(header)


def file_columns(path: str | Path, config: ReaderConfig) -> list[str]:
    """The columns a file has, in any format (a CSV file's header or ``column_names``, a Parquet
    file's schema, the svmlight formats' implied columns).

    Raises:
        FileNotFoundError: no such file.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    return pq.read_schema(path).names if config.format is FileFormat.PARQUET else column_names(path, config)[0]


def record_batches(path: str | Path, schema: Schema, config: ReaderConfig = ReaderConfig(),
                   extra: tuple[str, ...] = (), byte_range: tuple[int, int] | None = None,
                   block_bytes: int = 1 << 20, bad: BadRowCount | None = None) -> Iterator[pa.RecordBatch]:
    """The schema's columns of ``path`` (or of its rows starting in ``byte_range``, a CSV file's
    bytes ``[start, end)`` cut at line starts) in record batches of about ``block_bytes`` of
    text, typed (see the module docstring), and the columns ``extra`` as pyarrow infers them.
    Decoding is pyarrow's, on its own threads; memory holds a few blocks, not the file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a column the schema names is missing (naming the file's columns); under
            ``BadRows.ERROR`` a row of another field count, or a dense or threshold-label value
            that is not a number (naming the file, row, column, value).
    """
    import pyarrow as pa
    import pyarrow.csv as csv
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    bad = bad if bad is not None else BadRowCount()
    types = _types(schema)
    wanted = schema.columns + [c for c in extra if c not in schema.columns]
    if config.format is FileFormat.PARQUET:
        if byte_range is not None:
            raise ValueError(f"{path}: a Parquet file is sharded by row groups, not bytes; prepare it with `hetero data "
                             f"prepare` or give each rank its own file")
        _check_extra(schema, pq.read_schema(path).names, extra, path)
        first = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=max(1, block_bytes // 64), columns=wanted):
            yield typed_batch(batch, types, wanted, path, first, config.on_bad_rows, bad)
            first += batch.num_rows
        return
    names, data_start = column_names(path, config)
    _check_extra(schema, names, extra, path)
    start, end = byte_range if byte_range is not None else (data_start, path.stat().st_size)
    lines = LineCounter(path, start)
    if end <= start:  # an empty shard (more ranks than lines) or a file of a header only: no rows
        return
    if config.format in (FileFormat.LIBSVM, FileFormat.LIBFM):
        yield from sparse_format_batches(path, schema, config, config.format is FileFormat.LIBFM, start, end,
                                         block_bytes, lines, types, wanted, bad)
        return
    parse = _parse_options(config)
    if config.on_bad_rows is BadRows.SKIP:
        parse.invalid_row_handler = lambda row: (bad.add(1, f"{path}: a row of {row.actual_columns} fields, "
                                                            f"{row.expected_columns} expected: {row.text[:80]!r}"),
                                                 "skip")[1]
    read = csv.ReadOptions(column_names=names, block_size=block_bytes)
    # Numbers are decoded by pyarrow straight from the text (fast); a value that does not
    # convert stops that reader, and the rows from the failing block on are read again as text
    # and cast per block, which names the row (BadRows.ERROR) or drops it (SKIP, text from the
    # start: pyarrow's count of skipped malformed rows cannot be rewound).
    fast = config.on_bad_rows is BadRows.ERROR
    first = 0
    while True:
        convert = csv.ConvertOptions(column_types=types if fast else {c: pa.string() for c in schema.columns},
                                     include_columns=wanted, strings_can_be_null=True, null_values=[""])
        with open(path, "rb") as f:
            f.seek(start)
            try:
                skip = first
                for batch in csv.open_csv(ByteRange(f, end - start), read_options=read, parse_options=parse,
                                          convert_options=convert):
                    if skip >= batch.num_rows:
                        skip -= batch.num_rows
                        continue
                    batch, skip = batch.slice(skip) if skip else batch, 0
                    yield typed_batch(batch, types, wanted, path, first, config.on_bad_rows, bad, lines)
                    first += batch.num_rows
                return
            except pa.ArrowInvalid as e:
                if fast and "conversion error" in str(e):
                    fast = False  # again as text from the row after the last one yielded
                    continue
                # a row of another field count (pyarrow names it)
                raise ValueError(f"{path}: {str(e).splitlines()[0]}; fix the row, or set on_bad_rows = \"skip\"") \
                    from None


def read_table(path: str | Path, schema: Schema, config: ReaderConfig = ReaderConfig(),
               extra: tuple[str, ...] = ()) -> pa.Table:
    """The whole of :func:`record_batches` as one table (the same errors)."""
    import pyarrow as pa

    batches = list(record_batches(path, schema, config, extra))
    if batches:
        return pa.Table.from_batches(batches)
    return pa.Table.from_batches([], schema=_empty_schema(schema, extra))


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


def _parse_options(config: ReaderConfig):  # noqa: ANN202 - pyarrow.csv.ParseOptions
    import pyarrow.csv as csv

    return csv.ParseOptions(delimiter=config.delimiter, quote_char=config.quote_char or False)


def empty_batch(schema: Schema) -> pa.RecordBatch:
    """No rows, the schema's columns typed as the readers type them."""
    import pyarrow as pa

    return pa.RecordBatch.from_pylist([], schema=_empty_schema(schema, ()))


def _types(schema: Schema) -> dict[str, pa.DataType]:
    """Each column's type as read: numbers float64, hashed categorical columns bytes (the hash
    reads bytes; no UTF-8 validation, faster), other text UTF-8."""
    import pyarrow as pa

    numeric = [d.column for d in schema.dense] + ([schema.label.column] if schema.label.threshold is not None else [])
    types = {c: pa.float64() if c in numeric else pa.string() for c in schema.columns}
    types.update({c.column: pa.binary() for c in schema.categorical if c.hash_buckets is not None})
    return types


def _empty_schema(schema: Schema, extra: tuple[str, ...]) -> pa.Schema:
    import pyarrow as pa

    return pa.schema(list(_types(schema).items()) + [(c, pa.string()) for c in extra if c not in schema.columns])


