"""A :class:`~hetero.data.schema.Schema` applied to columns read by pyarrow: vocabularies and
dense statistics fitted on the training split only (:func:`fit`), then every split encoded into
model input (:meth:`Encoding.encode`) - ids, bags, transformed dense values, labels.

Fitting on the training split only matters: a vocabulary built over the whole file gives values
seen only in validation or test rows of their own, rows no step ever trains (their random
initial values then score those samples); here they map to the out-of-vocabulary row 0, which
training does reach (through the training split's rare and empty values).

Columns arrive as ``pyarrow`` arrays (``hetero.data.readers``): categorical as strings (empty
fields null), dense as float64, the label as read. All work is pyarrow's vectorised compute
(``value_counts``, ``index_in``, ``split_pattern``), numpy for buckets and the bags of crosses,
and one numba kernel for the hash.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hetero.data.column_rules import check_distinct
from hetero.data.rows import normalized_text
from hetero.data.schema import Categorical, Cross, Schema, Transform, schema_from_dict, schema_to_dict
from hetero.data.tabular import Feature, FeatureRole, Jagged, TabularDataset
from hetero._numba import load

if TYPE_CHECKING:
    import pyarrow as pa

CROSS_JOIN = "\x1f"  # between the values of a crossed feature's columns (ASCII unit separator)


@dataclasses.dataclass
class Encoding:
    """A schema fitted on a training split.

    Attributes:
        schema: the :class:`Schema`.
        vocabularies: per vocabulary-mode column, its values in id order (value ``k`` of the
            list has id ``k + 1``; id 0 is the out-of-vocabulary row).
        statistics: per standardised dense column, ``(mean, std)`` of the training split.
    """

    schema: Schema
    vocabularies: dict[str, list[str]]
    statistics: dict[str, tuple[float, float]]

    def specs(self) -> tuple[Feature, ...]:
        """The features' :class:`~hetero.data.tabular.Feature` specs (table sizes include row 0)."""
        schema = self.schema
        out = [Feature(c.name, self.table_rows(c), c.separator is not None, c.role,
                       c.dynamic_config() if c.dynamic else None) for c in schema.categorical]
        for x in schema.crosses:  # a bag when it crosses a multi-hot feature
            bags = any(schema.categorical_feature(n).separator is not None for n in x.columns)
            out.append(Feature(x.name, x.hash_buckets, bags, FeatureRole.WIDE))
        return tuple(out)

    def table_rows(self, c: Categorical) -> int:
        """Rows of categorical feature ``c``'s table (row 0 included; a dynamic one's: its capacity)."""
        if c.dynamic:
            return c.capacity
        if c.hash_buckets is not None:
            return c.hash_buckets
        return len(c.boundaries) + 2 if c.numeric else len(self.vocabularies[c.name]) + 1

    def fingerprint(self) -> int:
        """CRC-32 of the schema, vocabularies and statistics: another fit gives another value."""
        crc = zlib.crc32(repr((self.schema, sorted(self.statistics.items()))).encode())
        for name in sorted(self.vocabularies):
            crc = zlib.crc32("\x1e".join([name, *self.vocabularies[name]]).encode(), crc)
        return crc

    def encode(self, table: pa.Table | pa.RecordBatch, source: str) -> TabularDataset:
        """``table``'s rows as model input.

        Raises:
            ValueError: a missing column or an empty label (naming ``source``, the row and column).
        """
        self.schema.check(table.column_names, source, drop=False)
        features: dict[str, torch.Tensor | Jagged] = {}
        tokens = {c.name: _tokens(c, table) for c in self.schema.categorical}
        for c in self.schema.categorical:
            features[c.name] = self._categorical(c, *tokens[c.name])
        for x in self.schema.crosses:
            features[x.name] = _cross(x, [tokens[n] for n in x.columns], table.num_rows)
        # numpy, not torch: encoding runs on a reader thread, where torch's intra-op thread team
        # would spin beside pyarrow's decoders (measured: half the rows/s on 2 cores)
        dense = np.empty((table.num_rows, len(self.schema.dense)), dtype=np.float32)
        for j, d in enumerate(self.schema.dense):
            dense[:, j] = self._dense(d.column, d.transform, _column(table, d.column))
        return TabularDataset(features, torch.from_numpy(dense), _label(self.schema, table, source), self.specs())

    def _categorical(self, c: Categorical, values: pa.Array, offsets: np.ndarray | None) -> torch.Tensor | Jagged:
        import pyarrow as pa
        import pyarrow.compute as pc

        if c.numeric:  # the bucket ids themselves (as text, for crosses)
            ids = torch.from_numpy(values.to_numpy(zero_copy_only=False, writable=True))
        elif c.hashed:  # (a dynamic feature: the unreduced hash is its key)
            ids = hash_rows(values, 0 if c.dynamic else c.hash_buckets)
        else:
            vocab = pa.array(self.vocabularies[c.name], type=pa.string())
            index = pc.index_in(pc.if_else(pc.equal(values, ""), None, values), value_set=vocab)  # "" -> null -> row 0
            ids = torch.from_numpy(pc.add(index.fill_null(-1), 1).to_numpy(zero_copy_only=False).astype(np.int64))
        return ids if offsets is None else Jagged(ids, torch.from_numpy(offsets))

    def _dense(self, name: str, transform: Transform, col: pa.Array) -> np.ndarray:
        x = col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)  # nulls are NaN
        if transform is Transform.LOG1P:
            x = np.log1p(np.maximum(x, 0))  # (NaN stays NaN)
        elif transform is Transform.STANDARDIZE:
            mean, std = self.statistics[name]
            x = (x - mean) / std
        return np.nan_to_num(x, nan=0.0)  # a missing value: 0 after the transform (the mean)


ENCODING_FILE, VOCABULARY_FILE = "encoding.json", "vocabularies.parquet"


def encoding_document(encoding: Encoding) -> tuple[dict, pa.Table]:
    """``encoding`` as JSON-able data (the schema, statistics and vocabulary sizes) and a table
    of its vocabularies (``feature``, ``value``: one row per value, in id order);
    :func:`encoding_from_document` reads them back."""
    import pyarrow as pa

    names = [name for name, values in encoding.vocabularies.items() for _ in values]
    table = pa.table({"feature": pa.array(names, pa.string()),
                      "value": pa.array([v for values in encoding.vocabularies.values() for v in values], pa.string())})
    doc = {"format_version": 1, "schema": schema_to_dict(encoding.schema),
           "statistics": {k: list(v) for k, v in encoding.statistics.items()},
           "vocabulary_sizes": {k: len(v) for k, v in encoding.vocabularies.items()}}
    return doc, table


def encoding_from_document(doc: dict, table: pa.Table | None, where: str) -> Encoding:
    """The :class:`Encoding` of :func:`encoding_document`'s output.

    Raises:
        ValueError: vocabularies that do not match the document (naming ``where``).
    """
    import pyarrow.compute as pc

    schema = schema_from_dict(doc["schema"], where)
    vocabularies = {}
    for name, size in doc["vocabulary_sizes"].items():
        values = [] if table is None else \
            pc.filter(table.column("value"), pc.equal(table.column("feature"), name)).to_pylist()
        if len(values) != size:
            raise ValueError(f"{where}: its vocabularies hold {len(values)} values of {name!r}, its encoding says {size}: "
                             f"they are from different runs")
        vocabularies[name] = values
    return Encoding(schema, vocabularies, {k: (float(a), float(b)) for k, (a, b) in doc["statistics"].items()})


def save_encoding(encoding: Encoding, directory: Path) -> None:
    """Write ``encoding`` into ``directory`` (``encoding.json``: the schema and statistics;
    ``vocabularies.parquet``: one row per (feature, value), in id order), each file atomically
    (a prepared cache's; a run keeps its encoding in its checkpoints: :mod:`hetero.record`)."""
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    doc, table = encoding_document(encoding)
    tmp = directory / (VOCABULARY_FILE + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, directory / VOCABULARY_FILE)
    tmp = directory / (ENCODING_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, directory / ENCODING_FILE)


def load_encoding(directory: Path) -> Encoding:
    """The :class:`Encoding` :func:`save_encoding` wrote in ``directory``.

    Raises:
        FileNotFoundError: no ``encoding.json`` there (naming what wrote one).
        ValueError: a vocabulary file that does not match it.
    """
    import pyarrow.parquet as pq

    path = directory / ENCODING_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {ENCODING_FILE}: give a `hetero data prepare` cache")
    return encoding_from_document(json.loads(path.read_text()), pq.read_table(directory / VOCABULARY_FILE), str(path))


def fit(schema: Schema, train: pa.Table | pa.RecordBatch, source: str) -> Encoding:
    """Vocabularies (values seen at least ``min_count`` times, in order of first appearance) and
    standardisation statistics of the training split ``train`` (one table: :class:`Fitter` over
    its rows).

    Raises:
        ValueError: a column the schema names is missing (naming ``source``).
    """
    fitter = Fitter(schema)
    fitter.add(train, source)
    return fitter.encoding()


class Fitter:
    """:func:`fit` over a training split that arrives in record batches (a stream larger than
    memory): value counts merged as batches arrive (memory: the distinct values), dense moments
    merged by Chan et al.'s pairwise update (exact to rounding, no second pass)."""

    MERGE_ROWS = 1 << 20  # distinct (value, count) rows buffered before a merge

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.vocab_columns = [c for c in schema.categorical if c.vocabulary]
        self.counts: dict[str, list[pa.Table]] = {c.name: [] for c in self.vocab_columns}
        self.seen = {c.name: 0 for c in self.vocab_columns}  # values so far: the order of first appearance
        self.moments = {d.column: (0, 0.0, 0.0) for d in schema.dense if d.transform is Transform.STANDARDIZE}
        self.rows = 0

    def add(self, batch: pa.Table | pa.RecordBatch, source: str) -> None:
        """Count ``batch``'s rows (raises as :func:`fit`)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self.schema.check(batch.column_names, source, drop=False)  # the readers keep the used columns
        self.rows += batch.num_rows
        for c in self.vocab_columns:
            counts = pc.value_counts(_tokens(c, batch)[0])
            order = pa.array(np.arange(self.seen[c.name], self.seen[c.name] + len(counts), dtype=np.int64))
            self.seen[c.name] += len(counts)
            self.counts[c.name].append(pa.table({"value": counts.field("values"), "count": counts.field("counts"),
                                                 "order": order}))
            if sum(t.num_rows for t in self.counts[c.name]) > self.MERGE_ROWS:
                self.counts[c.name] = [_merge(self.counts[c.name])]
        for name, (n, mean, m2) in self.moments.items():
            x = _column(batch, name).to_numpy(zero_copy_only=False).astype(np.float64)
            x = x[~np.isnan(x)]  # of the values present
            if x.size:
                bm, total = x.mean(), n + x.size
                delta = bm - mean
                self.moments[name] = (total, mean + delta * x.size / total,
                                      m2 + float(((x - bm) ** 2).sum()) + delta * delta * n * x.size / total)

    def encoding(self) -> Encoding:
        """The :class:`Encoding` of the rows added."""
        import pyarrow.compute as pc

        vocabularies = {}
        for c in self.vocab_columns:
            merged = _merge(self.counts[c.name]).sort_by("order")
            values, n = merged.column("value"), merged.column("count")
            check_distinct(c, merged.num_rows, self.rows)
            keep = pc.and_(pc.and_(pc.is_valid(values), pc.not_equal(values, "")), pc.greater_equal(n, c.min_count))
            vocabularies[c.name] = pc.filter(values, keep.fill_null(False)).to_pylist()
        statistics = {}
        for name, (n, mean, m2) in self.moments.items():
            std = math.sqrt(m2 / n) if n else 1.0
            statistics[name] = (float(mean) if n else 0.0, std if std > 0 and math.isfinite(std) else 1.0)
        return Encoding(self.schema, vocabularies, statistics)


def _merge(tables: list[pa.Table]) -> pa.Table:
    """(value, count, order) tables as one: counts summed, the first order kept."""
    import pyarrow as pa

    if len(tables) == 1:
        return tables[0]
    if not tables:
        return pa.table({"value": pa.array([], pa.string()), "count": pa.array([], pa.int64()),
                         "order": pa.array([], pa.int64())})
    merged = pa.concat_tables(tables).group_by("value").aggregate([("count", "sum"), ("order", "min")])
    return merged.rename_columns({"count_sum": "count", "order_min": "order"}).select(["value", "count", "order"])


def hash_rows(col: pa.Array | pa.ChunkedArray, buckets: int) -> torch.Tensor:
    """Each string's row of a ``buckets``-row hashed table (see :mod:`hetero.data.schema`), or
    with ``buckets == 0`` its 64-bit key (a dynamic feature's): int64. Reads Arrow's buffers in
    place (no copy of the strings)."""
    import pyarrow as pa


    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if col.type not in (pa.string(), pa.large_string(), pa.binary(), pa.large_binary()):
        col = col.cast(pa.string())
    validity, offsets, data = col.buffers()
    n, wide = len(col), col.type in (pa.large_string(), pa.large_binary())
    offsets_np = np.frombuffer(offsets, dtype=np.int64 if wide else np.int32, count=col.offset + n + 1)[col.offset:]
    data_np = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    bits = np.frombuffer(validity, dtype=np.uint8) if validity is not None and col.null_count else _NO_NULLS
    return torch.from_numpy(load("hetero.data._hash_kernels").fnv1a_buckets(offsets_np, data_np, bits, col.offset,
                                                                             buckets))


_NO_NULLS = np.zeros(0, dtype=np.uint8)


def _tokens(c: Categorical, table: pa.Table | pa.RecordBatch) -> tuple[pa.Array, np.ndarray | None]:
    """Categorical feature ``c``'s values in ``table`` after its derivation (prefix, bucket), as
    one array (a bag's values in row order) and, multi-hot, the bags' int64 offsets ``(N + 1,)``.
    Bucket ids come as int64, other values as text (a column read as numbers for another feature:
    its numbers as text, ``1995.0`` as ``"1995"``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = _column(table, c.column)
    if c.numeric:
        x = col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)  # nulls are NaN
        ids = np.searchsorted(np.asarray(c.boundaries), x, side="right") + 1
        return pa.array(np.where(np.isnan(x), 0, ids).astype(np.int64)), None
    if pa.types.is_floating(col.type):
        col = col.cast(pa.string())
    offsets = None
    if c.separator is not None:  # a bag per row; an empty field is a bag of one empty value
        lists = pc.split_pattern(col.fill_null(""), c.separator)
        offsets = lists.offsets.to_numpy().astype(np.int64) - lists.offsets[0].as_py()
        col = lists.flatten()
    if c.prefix is not None:
        col = pc.utf8_slice_codeunits(col, 0, c.prefix)
    return col, offsets


def _cross(x: Cross, parts: list[tuple[pa.Array, np.ndarray | None]], rows: int) -> torch.Tensor | Jagged:
    """Cross ``x`` of its features' values (:func:`_tokens`): joined and hashed; with multi-hot
    features, every combination of the row's values (a bag of the bags' sizes' product)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    # one type for the join (bucket ids as their digits); bytes: no UTF-8 check
    values = [(v.cast(pa.string()) if pa.types.is_integer(v.type) else v).cast(pa.binary()).fill_null(b"")
              for v, _ in parts]
    if all(o is None for _, o in parts):
        return hash_rows(pc.binary_join_element_wise(*values, CROSS_JOIN.encode()), x.hash_buckets)
    single = np.arange(rows + 1, dtype=np.int64)
    joined, offsets = values[0], parts[0][1] if parts[0][1] is not None else single
    for more, (_, more_offsets) in zip(values[1:], parts[1:]):
        more_offsets = more_offsets if more_offsets is not None else single
        a, b = np.diff(offsets), np.diff(more_offsets)
        new = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(a * b, out=new[1:])
        row = np.repeat(np.arange(rows), a * b)
        k = np.arange(new[-1]) - new[row]  # the pair's rank in its row: (left k // |b|, right k % |b|)
        left, right = offsets[row] + k // b[row], more_offsets[row] + k % b[row]
        joined = pc.binary_join_element_wise(joined.take(pa.array(left)), more.take(pa.array(right)),
                                             CROSS_JOIN.encode())
        offsets = new
    return Jagged(hash_rows(joined, x.hash_buckets), torch.from_numpy(offsets))


def _label(schema: Schema, table: pa.Table | pa.RecordBatch, source: str) -> torch.Tensor:
    import pyarrow as pa
    import pyarrow.compute as pc

    label = schema.label
    if not label.column:  # an unlabelled schema (Schema.unlabelled): scoring rows without labels
        return torch.zeros(table.num_rows)
    col = _column(table, label.column)
    missing = pc.indices_nonzero(pc.is_null(col)) if col.null_count and label.threshold is not None else None
    if missing is not None and len(missing):
        row = missing[0].as_py()
        raise ValueError(f"{source}: row {row + 1} has no value in label column {label.column!r}; fill it or drop the "
                         f"row")
    if label.threshold is not None:
        positive = pc.greater_equal(col.cast(pa.float64()), label.threshold)
    else:  # the reader has checked every value is positive or negative (hetero.data.readers.value_rules)
        positive = pc.is_in(normalized_text(col), value_set=pa.array(label.positive, pa.string()))
    return torch.from_numpy(positive.to_numpy(zero_copy_only=False).astype(np.float32))


def _column(table: pa.Table | pa.RecordBatch, name: str) -> pa.Array:
    import pyarrow as pa

    col = table.column(name)
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col
