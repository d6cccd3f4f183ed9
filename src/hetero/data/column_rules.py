"""What a schema asks of a file's columns as they are read: each column's type (numbers, text,
bytes for hashing) and the rules on its values (a label in its positive or negative set, a dense
value finite), which :func:`hetero.data.rows.typed_batch` applies row by row; and what a fitted
vocabulary feature's distinct values must be (:func:`check_distinct`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hetero.data.rows import ValueRule
from hetero.data.schema import Categorical, Schema

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("hetero")


def value_rules(schema: Schema) -> tuple[ValueRule, ...]:
    """What the schema's columns must hold beyond their type: a label value in its positive or
    negative set (a threshold label: a finite number), a dense value finite unless the schema
    fills it."""
    label = schema.label
    rules = []
    if label.column and label.threshold is not None:
        rules.append(ValueRule(label.column, finite=True, fix="give every row a label"))
    elif label.column:
        rules.append(ValueRule(label.column, allowed=label.positive + label.negative,
                               fix=f"add it to the label's positive values ({list(label.positive)}) or negative "
                                   f"values ({list(label.negative)}) in the schema"))
    for c in schema.categorical:
        if c.dynamic:
            rules.append(ValueRule(c.column, whole=True,
                                   fix=f"a dynamic feature's key ({c.name!r}) is an integer or a text: give it an id "
                                       f"column, or bucket the number (boundaries = [...]) instead of dynamic = true"))
    for d in schema.dense:
        rules.append(ValueRule(d.column, finite=True, fill=d.fill,
                               fix=f"fix the value, or say what it reads as: fill = 0.0 in the schema's dense "
                                   f"{d.column!r}"))
    return tuple(rules)


def column_types(schema: Schema) -> dict[str, pa.DataType]:
    """Each column's type as read: numbers float64 (dense, bucketised, a threshold label), columns
    that only hashed features read bytes (the hash reads bytes; no UTF-8 validation, faster),
    other text UTF-8."""
    import pyarrow as pa

    numeric = schema.numeric_columns
    types = {c: pa.float64() if c in numeric else pa.string() for c in schema.columns}
    hashed = {c.column for c in schema.categorical if c.hashed and c.prefix is None}
    text = {c.column for c in schema.categorical if not c.hashed or c.prefix is not None}
    types.update({c: pa.binary() for c in hashed - text - set(numeric)})
    return types


UNIQUE_SHARE = 0.95  # a vocabulary feature with more distinct values per training row is refused
MIN_ROWS = 1000  # (of a training split of at least this many rows)


def check_distinct(feature: Categorical, distinct: int, rows: int) -> None:
    """Refuse a vocabulary feature whose distinct values are nearly one per training row: a row
    id, or a multi-valued column read whole (a libFM file without ``separator``), which trains a
    row per value seen once and scores every new row as unknown; warn above half.

    Raises:
        ValueError: more than :data:`UNIQUE_SHARE` of ``rows`` (>= :data:`MIN_ROWS`), naming the
            feature and the fixes.
    """
    if feature.separator is not None or rows < MIN_ROWS or distinct <= rows // 2:
        return
    what = (f"categorical {feature.name!r} has {distinct} distinct values in {rows} training rows: nearly every row's "
            f"value is new, so its rows learn nothing that scores a new row. If the column holds several values per "
            f"row, set separator = \"|\" (their separator); if it is an id, drop it (drop = [...]) or give it "
            f"hash_buckets")
    if distinct > UNIQUE_SHARE * rows:
        raise ValueError(what)
    log.warning("hetero: %s", what)
