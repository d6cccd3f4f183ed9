"""The svmlight family of line formats - libsvm and libFM ``label idx:value ...``, libFFM
``label field:idx:value ...`` - as record batches of categorical columns
(``hetero.data.readers``: ``FileFormat.LIBSVM`` / ``LIBFM`` / ``LIBFFM``). Reference: LIBSVM's,
libFM's (Rendle 2012) and LIBFFM's (Juan et al. 2016) data format documentation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hetero.data.rows import BadRowCount, BadRows, ByteRange, LineCounter, ValueRule, open_data, typed_batch

if TYPE_CHECKING:
    import pyarrow as pa


def sparse_format_batches(path: Path, format_name: str, on_bad_rows: BadRows, field_aware: bool, start: int, end: int,
                          block_bytes: int, lines: LineCounter, types: dict, wanted: list[str],
                          bad: BadRowCount, rules: tuple[ValueRule, ...] = ()) -> Iterator[pa.RecordBatch]:
    """libsvm / libFM lines (``label index:value ...``) or libFFM lines (``label
    field:index:value ...``, ``field_aware``) as record
    batches of the schema's columns: the label's text and, per field column, the row's ids joined
    by ``|`` (null when the row has none). Feature values must be 1 (categorical ids, as CTR data
    sets write them); another value or a malformed token is an error naming the line (or, under
    ``BadRows.SKIP``, its row is skipped)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as csv

    read = csv.ReadOptions(column_names=["line"], block_size=block_bytes)
    parse = csv.ParseOptions(delimiter="\x1f", quote_char=False)  # one field per line
    convert = csv.ConvertOptions(column_types={"line": pa.string()})
    first = 0
    with open_data(path, start) as f:
        for batch in csv.open_csv(ByteRange(f, end - start), read_options=read, parse_options=parse,
                                  convert_options=convert):
            n = batch.num_rows
            parts = pc.split_pattern(pc.utf8_trim_whitespace(batch.column("line")), " ", max_splits=None)
            counts = pc.list_value_length(parts).to_numpy(zero_copy_only=False)
            tokens = parts.flatten()
            row = np.repeat(np.arange(n), counts)
            head = np.zeros(len(tokens), dtype=bool)
            head[np.concatenate([[0], np.cumsum(counts)[:-1]])[counts > 0]] = True  # each row's label
            label = pc.list_element(parts, 0)
            tokens, row = tokens.filter(pa.array(~head)), row[~head]
            pieces = pc.split_pattern(tokens, ":")
            want = 3 if field_aware else 2
            malformed = pc.list_value_length(pieces).to_numpy(zero_copy_only=False) != want
            if malformed.any():  # ("a:b" in a field-aware file): read as a blank token, flagged below
                pieces = pc.if_else(pa.array(malformed), pa.scalar([""] * want, type=pieces.type), pieces)
            value = pc.list_element(pieces, want - 1) if len(tokens) else pa.array([], pa.string())
            wrong = malformed | pc.not_equal(value, "1").fill_null(True).to_numpy(zero_copy_only=False)
            drop = np.zeros(n, dtype=bool)
            if wrong.any():
                at = int(np.flatnonzero(wrong)[0])
                where = (f"{path}: line {lines.line(first + int(row[at]))}: {tokens[at].as_py()!r} is not "
                         f"{'field:index:1' if field_aware else 'index:1'}")
                if on_bad_rows is BadRows.ERROR:
                    raise ValueError(f"{where}; hetero reads {format_name} features as categorical ids of "
                                     f"value 1: write other values as a CSV with dense columns, or set on_bad_rows = "
                                     f"\"skip\"")
                drop[row[wrong]] = True
                bad.add(int(drop.sum()), where)
            field = pc.list_element(pieces, 0) if field_aware else None
            index = pc.list_element(pieces, want - 2) if len(tokens) else pa.array([], pa.string())
            columns = {}
            for name in wanted:
                if name == "label":
                    columns[name] = label
                    continue
                mask = np.ones(len(tokens), dtype=bool) if field is None else \
                    pc.equal(field, name).to_numpy(zero_copy_only=False)
                mask &= ~wrong
                per_row = np.bincount(row[mask], minlength=n)
                offsets = pa.array(np.concatenate([[0], np.cumsum(per_row)]).astype(np.int32))
                joined = pc.binary_join(pa.ListArray.from_arrays(offsets, index.filter(pa.array(mask))), "|")
                columns[name] = pc.if_else(pa.array(per_row == 0), pa.nulls(n, pa.string()), joined)
            batch = pa.RecordBatch.from_pydict(columns)
            counter, at = lines, first
            if drop.any() and not bad.mark:  # the bad tokens' rows out first: the rules then name only rows that remain
                batch = batch.filter(pa.array(~drop))
                counter, at = _Renumbered(lines, first, np.flatnonzero(~drop)), 0
            yield typed_batch(batch, types, wanted, path, at, on_bad_rows, bad, counter, rules,
                              drop if bad.mark else None)
            first += n


class _Renumbered:
    """A :class:`LineCounter` for a block whose bad rows were dropped: row ``i`` of what remains
    is row ``keep[i]`` of the block starting at row ``first``."""

    def __init__(self, lines: LineCounter, first: int, keep: np.ndarray) -> None:
        self.lines, self.first, self.keep = lines, first, keep

    def line(self, row: int) -> int:
        return self.lines.line(self.first + int(self.keep[row]))
