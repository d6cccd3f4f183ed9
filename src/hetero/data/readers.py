"""Reading a user's file for a :class:`~hetero.data.schema.Schema`, on pyarrow: CSV/TSV (any
delimiter, with a header or named columns, quoted fields) and Parquet, into a ``pyarrow.Table``
of the schema's columns - categorical as strings (an empty field is null), dense as float64, the
label as text (positive values) or float64 (a threshold). Decoding is pyarrow's, multithreaded.

**Joins** (:class:`Join`): columns of side tables - small files read whole, such as a ratings
file's users and items - joined to every row by a key, a left join that keeps the rows' order
(a row whose key the side table lacks gets missing values there; a key on two rows of a side
table is an error). The joined rows stream with the main file; only the side tables are held.

:mod:`hetero.data.split` splits what these read into train / validation / test.

Reference: Apache Arrow's CSV and Parquet readers.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any


from hetero.data.column_rules import column_types, value_rules
from hetero.data.files import source_files
from hetero.data.reader_config import FileFormat, Join, ReaderConfig, inferred
from hetero.data.rows import BAD_ROW, BadRowCount, BadRows, ByteRange, LineCounter, ValueRule, data_end, open_data, \
    typed_batch
from hetero.data.schema import Schema
from hetero.data.svmlight import sparse_format_batches

if TYPE_CHECKING:
    import pyarrow as pa



def column_names(path: Path, config: ReaderConfig) -> tuple[list[str], int]:
    """A CSV file's column names (its header, or ``config.column_names``) and the byte offset
    where its rows start (after the header line)."""
    import pyarrow.csv as csv

    if config.format in (FileFormat.LIBSVM, FileFormat.LIBFM):
        return ["label", "features"], 0
    if config.format is FileFormat.LIBFFM:  # the fields of the first MiB's lines
        with open_data(path) as f:
            text = f.read(1 << 20)
        lines = text.decode("utf-8", errors="replace").splitlines()
        head = (lines if len(text) < 1 << 20 else lines[:-1]) or [""]  # (a MiB may end inside a line)
        fields = {t.split(":")[0] for line in head for t in line.split()[1:]}
        return ["label", *sorted(fields, key=lambda x: (len(x), x))], 0
    if config.column_names and not config.header:
        return list(config.column_names), 0
    header = b""
    with open_data(path) as f:  # the header is one line (no newlines inside quoted names)
        while b"\n" not in header and (chunk := f.read(1 << 16)):
            header += chunk
    if not header.strip():
        raise ValueError(f"{path} is empty (no header line): give a file with a header and rows, or set header = false "
                         f"and column_names")
    header = header[:header.index(b"\n") + 1] if b"\n" in header else header
    names = csv.read_csv(io.BytesIO(header), parse_options=_parse_options(config)).schema.names  # parsed as CSV
    if config.column_names:  # the header's names replaced
        if len(config.column_names) != len(names):
            raise ValueError(f"{path}: column_names gives {len(config.column_names)} names, the header has "
                             f"{len(names)} columns ({names}); give one name per column")
        return list(config.column_names), len(header)
    return names, len(header)


def file_columns(path: str | Path, config: ReaderConfig) -> list[str]:
    """The columns a file's rows have, in any format (a CSV file's header or ``column_names``, a
    Parquet file's schema, the svmlight formats' implied columns), then its joins' columns.

    Raises:
        FileNotFoundError: no such file (or side table).
        ValueError: a join whose key a file lacks, or whose columns the file has already.
    """
    config = inferred(config, path)
    path = source_files(path)[0]  # (every file of several is checked as it is read)
    return _own_columns(path, config) + [c for j in config.joins for c in _joined_columns(path, config, j)]


def _own_columns(path: Path, config: ReaderConfig) -> list[str]:
    import pyarrow.parquet as pq

    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    return pq.read_schema(path).names if config.format is FileFormat.PARQUET else column_names(path, config)[0]


def _joined_columns(path: Path, config: ReaderConfig, join: Join) -> list[str]:
    """The columns ``join`` adds to ``path``'s rows (checked: the key in both, no name twice)."""
    own, side = _own_columns(path, config), _own_columns(join.path, join.reader)
    for where, names in ((path, own), (join.path, side)):
        if join.on not in names:
            raise ValueError(f"{where} has no column {join.on!r}, the key of the join of {join.path}; its columns are "
                             f"{names}")
    added = [c for c in side if c != join.on]
    earlier = own + [c for j in config.joins[:config.joins.index(join)] for c in _own_columns(j.path, j.reader)]
    twice = [c for c in added if c in earlier]
    if twice:
        raise ValueError(f"{join.path} joins column {twice[0]!r}, which {path} or an earlier join has already: rename "
                         f"one (column_names = [...] in its reader)")
    return added


def record_batches(path: str | Path | Sequence[str | Path], schema: Schema, config: ReaderConfig = ReaderConfig(),
                   extra: tuple[str, ...] = (), shard: tuple[int, int] | None = None,
                   block_bytes: int = 1 << 20, bad: BadRowCount | None = None,
                   text: tuple[str, ...] = ()) -> Iterator[pa.RecordBatch]:
    """The schema's columns of ``path`` (any of :func:`source_files`; or of one file's ``shard``: bytes ``[start, end)`` of a line
    format, cut at line starts, or row groups ``[start, end)`` of a Parquet file) in record
    batches of about ``block_bytes`` of text, typed (see the module docstring), its joins'
    columns added, and the columns ``extra`` as pyarrow infers them (those also in ``text``: as
    their text, exactly - a 64-bit id is no double - in a line format; a Parquet file's as typed).
    ``bad``: the count of bad rows, and whether they are marked, not skipped
    (:class:`~hetero.data.rows.BadRowCount`). Decoding is pyarrow's, on its own threads; memory
    holds a few blocks and the side tables, not the file.

    Raises:
        FileNotFoundError: no such file (or side table).
        ValueError: a column the schema names is missing (naming the file's columns); under
            ``BadRows.ERROR`` a row of another field count, or a dense or threshold-label value
            that is not a number (naming the file, row, column, value); a side table's key on
            two rows.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    config = inferred(config, path)
    files = source_files(path)
    if len(files) > 1:  # several files, one after the other (line numbers are each file's own)
        if shard is not None:
            raise ValueError(f"a shard is a byte or row-group range of one file; {path} names {len(files)} files")
        for f in files:
            yield from record_batches(f, schema, config, extra, None, block_bytes, bad, text)
        return
    path = files[0]
    bad = bad if bad is not None else BadRowCount()
    types = column_types(schema)
    if config.format is not FileFormat.PARQUET:  # ``text``: extra columns as their text, exactly (a Parquet
        types.update({c: pa.string() for c in text if c in extra and c not in types})  # file's keep their type)
    wanted = schema.columns + [c for c in extra if c not in schema.columns]
    joined = {c: j for j in config.joins for c in _joined_columns(path, config, j)}
    _check_extra(schema, _own_columns(path, config) + list(joined), extra, path)
    sides = []
    for j in config.joins:  # each side table with the columns the schema takes from it, keyed
        own = [c for c in wanted if joined.get(c) is j]
        if own:
            sides.append((j, own, _side_table(j, {**{c: types[c] for c in own}, j.on: pa.string()}, block_bytes,
                                              tuple(r for r in value_rules(schema) if r.column in own))))
    read = [c for c in wanted if c not in joined] + [j.on for j, _, _ in sides if j.on not in wanted]
    rules = value_rules(schema)
    for batch in _typed_batches(path, {c: t for c, t in types.items() if c not in joined}, read, config, shard,
                                block_bytes, bad, tuple(r for r in rules if r.column not in joined)):
        if sides:
            columns = {c: batch.column(c) for c in read}
            for j, own, table in sides:
                index = pc.index_in(columns[j.on].cast(pa.string()), value_set=table.column(j.on))  # null: no such key
                columns.update({c: table.column(c).take(index) for c in own})
            kept = wanted + ([BAD_ROW] if bad.mark else [])
            batch = pa.RecordBatch.from_arrays([_chunk(batch.column(c) if c == BAD_ROW else columns[c]) for c in kept],
                                               names=kept)
        yield batch


def _side_table(join: Join, types: dict, block_bytes: int, rules: tuple[ValueRule, ...] = ()) -> pa.Table:
    """``join``'s side table: the key (rows without one dropped, each key once) and ``types``'
    columns, typed."""
    import pyarrow as pa
    import pyarrow.compute as pc

    wanted = list(types)
    table = pa.Table.from_batches(list(_typed_batches(join.path, types, wanted, join.reader, None, block_bytes,
                                                      BadRowCount(), rules)), schema=pa.schema(types.items()))
    table = table.filter(pc.is_valid(table.column(join.on))).combine_chunks()
    if pc.count_distinct(table.column(join.on)).as_py() != table.num_rows:
        counts = pc.value_counts(table.column(join.on))
        twice = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))[0].as_py()
        raise ValueError(f"{join.path}: key {join.on} = {twice!r} is on more than one row; a joined side table holds "
                         f"one row per key")
    return table


def _chunk(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    import pyarrow as pa

    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def _typed_batches(path: Path, types: dict, wanted: list[str], config: ReaderConfig,
                   shard: tuple[int, int] | None, block_bytes: int, bad: BadRowCount,
                   rules: tuple[ValueRule, ...] = ()) -> Iterator[pa.RecordBatch]:
    """``wanted`` columns of the file itself (no joins) or its ``shard``, typed by ``types``
    (others as read)."""
    import pyarrow as pa
    import pyarrow.csv as csv
    import pyarrow.parquet as pq

    if config.format is FileFormat.PARQUET:
        first, groups = 0, None if shard is None else list(range(*shard))
        if groups == []:  # an empty shard (more ranks than row groups)
            return
        for batch in pq.ParquetFile(path).iter_batches(batch_size=max(1, block_bytes // 64), row_groups=groups,
                                                       columns=wanted):
            yield typed_batch(batch, types, wanted, path, first, config.on_bad_rows, bad, rules=rules)
            first += batch.num_rows
        return
    names, data_start = column_names(path, config)
    start, end = shard if shard is not None else (data_start, data_end(path))
    lines = LineCounter(path, start)
    if end <= start:  # an empty shard (more ranks than lines) or a file of a header only: no rows
        return
    if config.format in (FileFormat.LIBSVM, FileFormat.LIBFM, FileFormat.LIBFFM):
        yield from sparse_format_batches(path, config.format.value, config.on_bad_rows, config.format is FileFormat.LIBFFM,
                                         start, end, block_bytes,
                                         lines, types, wanted, bad, rules)
        return
    parse = _parse_options(config)
    if config.on_bad_rows is BadRows.SKIP and not bad.mark:  # (marking: such a row cannot keep its place: an error)
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
    nulls = ["", *config.null_values]
    while True:
        convert = csv.ConvertOptions(column_types=types if fast else {c: pa.string() for c in types},
                                     include_columns=wanted, strings_can_be_null=True, null_values=nulls)
        with open_data(path, start) as f:
            try:
                skip = first
                for batch in csv.open_csv(ByteRange(f, end - start), read_options=read, parse_options=parse,
                                          convert_options=convert):
                    if skip >= batch.num_rows:
                        skip -= batch.num_rows
                        continue
                    batch, skip = batch.slice(skip) if skip else batch, 0
                    yield typed_batch(batch, types, wanted, path, first, config.on_bad_rows, bad, lines, rules)
                    first += batch.num_rows
                return
            except pa.ArrowInvalid as e:
                if fast and "conversion error" in str(e):
                    fast = False  # again as text from the row after the last one yielded
                    continue
                # a row of another field count (pyarrow quotes it). Newer pyarrow also numbers it
                # ("Row #N: "), counted from the start of this byte range, not of the file: left out
                message = re.sub(r"^(CSV parse error: )Row #\d+: ", r"\1", str(e).splitlines()[0])
                if bad.mark and config.on_bad_rows is BadRows.SKIP:
                    raise ValueError(f"{path}: {message}; hetero predict writes one score per input row and cannot "
                                     f"place a row it cannot split into columns: fix the row (a bad value in a row "
                                     f"of the right field count scores as null)") from None
                raise ValueError(f"{path}: {message}; fix the row, or set on_bad_rows = \"skip\"") from None


def read_table(path: str | Path | Sequence[str | Path], schema: Schema, config: ReaderConfig = ReaderConfig(),
               extra: tuple[str, ...] = (), bad: BadRowCount | None = None) -> pa.Table:
    """The whole of :func:`record_batches` as one table (the same errors; ``bad``: counts the
    rows skipped as bad)."""
    import pyarrow as pa

    batches = list(record_batches(path, schema, config, extra, bad=bad))
    if batches:
        return pa.Table.from_batches(batches)
    return pa.Table.from_batches([], schema=_empty_schema(schema, extra))


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


def _empty_schema(schema: Schema, extra: tuple[str, ...]) -> pa.Schema:
    import pyarrow as pa

    return pa.schema(list(column_types(schema).items()) + [(c, pa.string()) for c in extra if c not in schema.columns])


