"""A :class:`~hetero.data.schema.Schema` applied to columns read by pyarrow: vocabularies and
dense statistics fitted on the training split only (:func:`fit`), then every split encoded into
model input (:meth:`Encoding.encode`) - ids, bags, transformed dense values, labels.

Fitting on the training split only matters: a vocabulary built over the whole file gives values
seen only in validation or test rows of their own, rows no step ever trains (their random
initial values then score those samples); here they map to the out-of-vocabulary row 0, which
training does reach (through the training split's rare and empty values).

Columns arrive as ``pyarrow`` arrays (``hetero.data.readers``): categorical as strings (empty
fields null), dense as float64, the label as read. All work is pyarrow's vectorised compute
(``value_counts``, ``index_in``, ``split_pattern``) and one numba kernel for the hash.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from hetero.data.schema import Categorical, Cross, Schema, Transform
from hetero.data.tabular import Feature, FeatureRole, Jagged, TabularDataset

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
        out = [Feature(c.column, c.hash_buckets or len(self.vocabularies[c.column]) + 1, c.separator is not None, c.role)
               for c in self.schema.categorical]
        out += [Feature(x.name, x.hash_buckets, False, FeatureRole.WIDE) for x in self.schema.crosses]
        return tuple(out)

    def encode(self, table: pa.Table, source: str) -> TabularDataset:
        """``table``'s rows as model input.

        Raises:
            ValueError: a missing column or an empty label (naming ``source``, the row and column).
        """
        self.schema.check(table.column_names, source, drop=False)
        features: dict[str, torch.Tensor | Jagged] = {}
        for c in self.schema.categorical:
            features[c.column] = self._categorical(c, _column(table, c.column))
        for x in self.schema.crosses:
            features[x.name] = _cross(x, table)
        dense = [self._dense(d.column, d.transform, _column(table, d.column)) for d in self.schema.dense]
        dense_t = torch.stack(dense, dim=1) if dense else torch.zeros(table.num_rows, 0)
        return TabularDataset(features, dense_t, _label(self.schema, table, source), self.specs())

    def _categorical(self, c: Categorical, col: pa.Array) -> torch.Tensor | Jagged:
        import pyarrow as pa
        import pyarrow.compute as pc

        offsets = None
        if c.separator is not None:  # a bag per row; an empty field is a bag of one empty value
            lists = pc.split_pattern(col.fill_null(""), c.separator)
            offsets = torch.from_numpy(lists.offsets.to_numpy().astype(np.int64) - lists.offsets[0].as_py())
            col = lists.flatten()
        if c.hash_buckets is not None:
            ids = hash_rows(col, c.hash_buckets)
        else:
            vocab = pa.array(self.vocabularies[c.column], type=pa.string())
            index = pc.index_in(pc.if_else(pc.equal(col, ""), None, col), value_set=vocab)  # "" -> null -> row 0
            ids = torch.from_numpy(pc.add(index.fill_null(-1), 1).to_numpy(zero_copy_only=False).astype(np.int64))
        return ids if offsets is None else Jagged(ids, offsets)

    def _dense(self, name: str, transform: Transform, col: pa.Array) -> torch.Tensor:
        x = torch.from_numpy(col.to_numpy(zero_copy_only=False).astype(np.float64))  # nulls are NaN
        if transform is Transform.LOG1P:
            x = torch.log1p(x.clamp(min=0))
        elif transform is Transform.STANDARDIZE:
            mean, std = self.statistics[name]
            x = (x - mean) / std
        return torch.nan_to_num(x, nan=0.0).float()  # a missing value: 0 after the transform (the mean)


def fit(schema: Schema, train: pa.Table, source: str) -> Encoding:
    """Vocabularies (values seen at least ``min_count`` times, in order of first appearance) and
    standardisation statistics of the training split ``train``.

    Raises:
        ValueError: a column the schema names is missing (naming ``source``).
    """
    import pyarrow.compute as pc

    schema.check(train.column_names, source, drop=False)  # read_table keeps the used columns
    vocabularies = {}
    for c in schema.categorical:
        if c.hash_buckets is not None:
            continue
        col = _column(train, c.column)
        if c.separator is not None:
            col = pc.split_pattern(col, c.separator).flatten()
        counts = pc.value_counts(col)
        values, n = counts.field("values"), counts.field("counts")
        keep = pc.and_(pc.and_(pc.is_valid(values), pc.not_equal(values, "")), pc.greater_equal(n, c.min_count))
        vocabularies[c.column] = pc.filter(values, keep.fill_null(False)).to_pylist()
    statistics = {}
    for d in schema.dense:
        if d.transform is Transform.STANDARDIZE:
            x = _column(train, d.column).to_numpy(zero_copy_only=False).astype(np.float64)
            x = x[~np.isnan(x)]  # of the values present
            mean, std = (float(x.mean()), float(x.std())) if x.size else (0.0, 1.0)
            statistics[d.column] = (mean, std if std > 0 and math.isfinite(std) else 1.0)
    return Encoding(schema, vocabularies, statistics)


def hash_rows(col: pa.Array, buckets: int) -> torch.Tensor:
    """Each string's row of a ``buckets``-row hashed table (see :mod:`hetero.data.schema`): int64."""
    import pyarrow as pa

    from hetero._numba import load

    arr = col.cast(pa.large_string())  # int64 offsets, one layout for the kernel
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    validity, offsets, data = arr.buffers()
    n = len(arr)
    offsets_np = np.frombuffer(offsets, dtype=np.int64, count=arr.offset + n + 1)[arr.offset:]
    data_np = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return torch.from_numpy(load("hetero.data._hash_kernels").fnv1a_buckets(offsets_np, data_np, valid, buckets))


def _cross(x: Cross, table: pa.Table) -> torch.Tensor:
    import pyarrow.compute as pc

    parts = [_column(table, c).fill_null("") for c in x.columns]
    return hash_rows(pc.binary_join_element_wise(*parts, CROSS_JOIN), x.hash_buckets)


def _label(schema: Schema, table: pa.Table, source: str) -> torch.Tensor:
    import pyarrow as pa
    import pyarrow.compute as pc

    label = schema.label
    col = _column(table, label.column)
    missing = pc.indices_nonzero(pc.is_null(col)) if col.null_count else None
    if missing is not None and len(missing):
        row = missing[0].as_py()
        raise ValueError(f"{source}: row {row + 1} has no value in label column {label.column!r}; fill it or drop the "
                         f"row")
    if label.threshold is not None:
        positive = pc.greater_equal(col.cast(pa.float64()), label.threshold)
    else:
        positive = pc.is_in(col.cast(pa.string()), value_set=pa.array(label.positive))
    return torch.from_numpy(positive.to_numpy(zero_copy_only=False).astype(np.float32))


def _column(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
