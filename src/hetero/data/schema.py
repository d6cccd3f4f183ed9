"""A declarative feature schema: which columns of a user's file are the label, the categorical
and the dense features, and how each becomes model input.

* **Label:** a column and its positive rule - values at or above a ``threshold`` (``rating >=
  4``), or membership in a set of ``positive`` values (``{1, "yes"}``, compared as text).
* **Categorical** (:class:`Categorical`): single-valued, or multi-hot with a ``separator`` (a bag
  per row); ids from a **vocabulary** built on the training split only (values seen at least
  ``min_count`` times, in order of first appearance, ids ``1..n``; row 0 is the out-of-vocabulary
  row: unseen, rare and empty values) or from **hashing** into ``hash_buckets`` rows (row 0 for
  empty values, else ``1 + fnv1a64(utf8(value)) mod (hash_buckets - 1)``: FNV-1a, 64-bit, stable
  across processes and runs - Python's ``hash`` is salted per process). A number is hashed as its
  decimal text, so ``42`` in a CSV file and ``42`` in an int64 (or a float64 ``42.0``) Parquet
  column hash alike, to the same row. A feature may derive its
  values from its column: the first ``prefix`` characters (a zip code's region), or the bucket of a
  number between ``boundaries`` (an age group; TensorFlow's bucketized column). A feature has a
  ``name`` of its own (default: the column's), so one column can feed several features.
* **Dense** (:class:`Dense`): float; ``Transform.NONE``, ``LOG1P`` (``log(1 + max(x, 0))``, the
  DLRM preprocessing) or ``STANDARDIZE`` (``(x - mean) / std`` with the mean and standard
  deviation of the training split's values); an empty field is 0 after the transform (the mean,
  standardised).
* **Crossed** (:class:`Cross`): for the wide part, the values of several categorical features
  (after their derivation) joined (``"a\\x1fb"``) and hashed into ``hash_buckets`` rows; crossing
  a multi-hot feature gives a bag, the cartesian product of the crossed values (user x each of
  the movie's genres).
* **Dropped:** every other column (named in ``drop`` to say so; a column neither used nor dropped
  is allowed and ignored).

The schema checks itself (:meth:`Schema.check`) against the columns a file has before anything is
read further. Reference: TorchRec's and the reference design's feature configs; the Criteo
preprocessing of DLRM (Naumov et al. 2019).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from hetero.data.tabular import FeatureRole
from hetero.dynamic import DynamicConfig, Eviction
from hetero.data.toml_values import build_dataclass, check_keys, checked, parse_enum, plain_data


class Transform(enum.Enum):
    """How a dense column's values are transformed (see the module docstring)."""

    NONE = "none"
    LOG1P = "log1p"
    STANDARDIZE = "standardize"


NEGATIVE = ("0", "-1", "false", "no", "")  # a label's negative values unless the schema says otherwise


@dataclasses.dataclass(frozen=True)
class Label:
    """The label column and its positive rule.

    Attributes:
        column: the column's name.
        threshold: positive when the value (a number) is at least this.
        positive: positive when the value's text is one of these (e.g. ``("1", "yes")``).
            Exactly one of ``threshold`` and ``positive`` is given; the default is ``("1",)``.
        negative: with ``positive``, the values that are negative (default :data:`NEGATIVE`;
            ``""`` is a missing value). Values are compared stripped and case-folded; a value in
            neither set is a bad row (named, or skipped under ``on_bad_rows = "skip"``).
    """

    column: str
    threshold: float | None = None
    positive: tuple[str, ...] = ()
    negative: tuple[str, ...] = NEGATIVE

    def __post_init__(self) -> None:
        for name in ("positive", "negative"):  # compared as text, stripped and case-folded
            object.__setattr__(self, name, tuple(str(v).strip().lower() for v in getattr(self, name)))
        if self.threshold is not None and self.positive:
            raise ValueError(f"label {self.column!r}: give threshold or positive values, not both")
        if self.threshold is None and not self.positive:
            object.__setattr__(self, "positive", ("1",))
        both = sorted(set(self.positive) & set(self.negative))
        if both:
            raise ValueError(f"label {self.column!r}: {both} are positive and negative values at once; give each value "
                             f"one side (negative = [...])")


DEFAULT_CAPACITY = 1 << 20  # a dynamic feature's rows when its capacity is not given


@dataclasses.dataclass(frozen=True)
class Categorical:
    """A categorical feature of a column.

    Attributes:
        column: the column it reads.
        name: the feature's name (default: the column's); features of one column need their own.
        separator: multi-hot: the values of a row are this string's pieces (a bag); ``None``:
            one value per row.
        prefix: use the first ``prefix`` characters of each value (``None``: the whole value).
        boundaries: a number's bucket instead of a vocabulary: increasing numbers ``b_1 < ... <
            b_k``; a value ``x`` gets id ``1 + #{i: b_i <= x}`` (``1..k+1``), a missing value id 0.
            The column is read as numbers.
        hash_buckets: rows of the hashed table (>= 2); ``None``: a vocabulary.
        min_count: vocabulary mode: a value seen fewer times in the training split maps to the
            out-of-vocabulary row 0.
        role: whether the feature feeds the wide part, the deep part, or both.
        dynamic: neither a vocabulary nor buckets: each value's key is its 64-bit FNV-1a hash (the
            hashed mode's hash, unreduced; 0 for an empty value) and its tables are dynamic
            (:mod:`hetero.dynamic`): a row per admitted key, at most ``capacity``. Two of ``n``
            distinct values share a key with probability about ``n**2 / 2**65`` (1e-5 for 1e7 values).
        capacity: a dynamic feature's rows (>= 1); ``None``: :data:`DEFAULT_CAPACITY` (2**20 rows:
            16 dims of fp32 and LazyAdam's two moments are 192 MiB, the keys it holds evicted by
            ``eviction`` past that).
        admit_after: a dynamic feature's sightings before a value gets a row (>= 1).
        ttl_steps: a dynamic feature's rows unseen for more than this many steps are evicted.
        eviction: which rows a full dynamic table gives up first.
        sketch_width: a dynamic feature's admission-sketch counters per row (a power of two >= 64;
            ``16 * sketch_width`` bytes, kept in the checkpoint; ``None``: the default, 2**20).
        tinylfu: a dynamic table short of free rows admits only values that outrank a row (:class:`DynamicConfig`).
    """

    column: str
    name: str = ""
    separator: str | None = None
    prefix: int | None = None
    boundaries: tuple[float, ...] = ()
    hash_buckets: int | None = None
    min_count: int = 1
    role: FeatureRole = FeatureRole.WIDE_AND_DEEP
    dynamic: bool = False
    capacity: int | None = None
    admit_after: int = 1
    ttl_steps: int | None = None
    eviction: Eviction = Eviction.LFU
    sketch_width: int | None = None
    tinylfu: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.name or self.column)
        self._check_dynamic()
        object.__setattr__(self, "boundaries", tuple(float(b) for b in self.boundaries))
        b = self.boundaries
        if b and any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"categorical {self.name!r}: boundaries {list(b)} must increase strictly")
        if b and (self.separator is not None or self.prefix is not None or self.hash_buckets is not None):
            raise ValueError(f"categorical {self.name!r}: boundaries bucket one number per row; drop separator, prefix "
                             f"and hash_buckets")
        if self.prefix is not None and self.prefix < 1:
            raise ValueError(f"categorical {self.name!r}: prefix={self.prefix}; give at least 1 character")
        if self.hash_buckets is not None and self.hash_buckets < 2:
            raise ValueError(f"categorical {self.name!r}: hash_buckets={self.hash_buckets}; give at least 2 (row 0 is "
                             f"the empty value's)")
        if self.min_count < 1:
            raise ValueError(f"categorical {self.name!r}: min_count={self.min_count}; give at least 1")
        if self.separator == "":
            raise ValueError(f"categorical {self.name!r}: an empty separator; give the string between values, or "
                             f"None for one value per row")

    def _check_dynamic(self) -> None:
        name = f"categorical {self.name!r}"
        if not self.dynamic:
            given = [k for k in ("capacity", "ttl_steps", "sketch_width") if getattr(self, k) is not None]
            given += [k for k, on in (("admit_after", self.admit_after != 1), ("tinylfu", self.tinylfu)) if on]
            if given:
                raise ValueError(f"{name}: {given[0]} is a dynamic feature's setting; add dynamic = true or drop it")
            return
        if self.hash_buckets is not None or self.boundaries:
            raise ValueError(f"{name}: a dynamic feature has neither hash_buckets nor boundaries; drop them")
        if self.capacity is None:
            object.__setattr__(self, "capacity", DEFAULT_CAPACITY)
        if self.capacity < 1:
            raise ValueError(f"{name}: capacity = {self.capacity}; a dynamic feature needs capacity >= 1 (its most rows)")
        self.dynamic_config()  # (its own checks, named)

    def dynamic_config(self) -> DynamicConfig:
        """A dynamic feature's admission and eviction.

        Raises:
            ValueError: a setting out of range, naming the feature and the setting.
        """
        try:
            width = {} if self.sketch_width is None else {"sketch_width": self.sketch_width}
            return DynamicConfig(admit_after=self.admit_after, ttl_steps=self.ttl_steps, eviction=self.eviction,
                                 tinylfu=self.tinylfu, **width)
        except ValueError as e:
            raise ValueError(f"categorical {self.name!r}: {e}") from None

    @property
    def vocabulary(self) -> bool:
        """Whether the ids come from a vocabulary fitted on the training split."""
        return self.hash_buckets is None and not self.boundaries and not self.dynamic

    @property
    def hashed(self) -> bool:
        """Whether the values are hashed (into buckets, or to a dynamic feature's keys)."""
        return self.hash_buckets is not None or self.dynamic

    @property
    def numeric(self) -> bool:
        """Whether the column is read as numbers (bucketised)."""
        return bool(self.boundaries)


@dataclasses.dataclass(frozen=True)
class Dense:
    """A dense (float) column and its :class:`Transform`.

    Attributes:
        column: the column.
        transform: applied to each value.
        fill: what a ``NaN``, ``inf`` or ``-inf`` value reads as (before the transform);
            ``None``: such a value is a bad row. (An empty field is a missing value: 0 after the
            transform.)
    """

    column: str
    transform: Transform = Transform.NONE
    fill: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.transform, Transform):
            object.__setattr__(self, "transform", parse_enum(Transform, self.transform, f"dense {self.column!r} transform"))


@dataclasses.dataclass(frozen=True)
class Cross:
    """A crossed feature of several categorical features, hashed (wide part only).

    Attributes:
        columns: the crossed categorical features, by name (at least 2); a multi-hot one makes
            the cross a bag (the cartesian product of the rows' values).
        hash_buckets: rows of its table (>= 2).
        name: the feature's name (default: the columns joined by ``"_x_"``).
    """

    columns: tuple[str, ...]
    hash_buckets: int
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))
        if len(self.columns) < 2:
            raise ValueError(f"cross {list(self.columns)}: a cross joins at least 2 columns")
        if self.hash_buckets < 2:
            raise ValueError(f"cross {list(self.columns)}: hash_buckets={self.hash_buckets}; give at least 2")
        if not self.name:
            object.__setattr__(self, "name", "_x_".join(self.columns))


@dataclasses.dataclass(frozen=True)
class Schema:
    """What a file's columns mean (see the module docstring).

    Attributes:
        label: the :class:`Label`.
        categorical: the categorical features, in model order.
        dense: the dense features, in model order.
        crosses: crossed features for the wide part.
        drop: columns named as unused.
    """

    label: Label
    categorical: tuple[Categorical, ...] = ()
    dense: tuple[Dense, ...] = ()
    crosses: tuple[Cross, ...] = ()
    drop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("categorical", "dense", "crosses", "drop"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        dense = [d.column for d in self.dense]
        twice = sorted({c for c in dense if dense.count(c) > 1})
        if twice:
            raise ValueError(f"schema has dense columns {twice} more than once: each dense column is one input")
        if self.label.column in {c.column for c in self.categorical} | set(dense):
            raise ValueError(f"schema uses the label column {self.label.column!r} as a feature: the model would see its "
                             f"answer; remove the feature")
        dropped = sorted(set(self.drop) & set(self.columns))
        if dropped:
            raise ValueError(f"schema drops columns {dropped} that it also uses: remove them from drop")
        names = [c.name for c in self.categorical] + [x.name for x in self.crosses]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise ValueError(f"schema has two features named {clash}: give each feature of one column its own name "
                             f"(name = ...), and the crosses other names")
        categorical = {c.name for c in self.categorical}
        for x in self.crosses:
            missing = [c for c in x.columns if c not in categorical]
            if missing:
                raise ValueError(f"cross {x.name!r} joins {missing}, which are not categorical features of the schema "
                                 f"(by name: {sorted(categorical)})")

    @property
    def columns(self) -> list[str]:
        """The columns the schema reads (the label's unless :meth:`unlabelled`)."""
        label = [self.label.column] if self.label.column else []
        used = [*label, *(c.column for c in self.categorical), *(d.column for d in self.dense)]
        return list(dict.fromkeys(used))  # a column feeding several features is read once

    @property
    def numeric_columns(self) -> list[str]:
        """The columns read as numbers: dense ones, bucketised ones, a threshold label's."""
        label = [self.label.column] if self.label.column and self.label.threshold is not None else []
        return list(dict.fromkeys([*label, *(d.column for d in self.dense),
                                   *(c.column for c in self.categorical if c.numeric)]))

    def categorical_feature(self, name: str) -> Categorical:
        """The categorical feature called ``name``."""
        return next(c for c in self.categorical if c.name == name)

    def unlabelled(self) -> "Schema":
        """This schema for rows without the label column (scoring): the label is not read and
        encodes as 0."""
        return dataclasses.replace(self, label=Label(""))

    def check(self, columns: Sequence[str], source: str, drop: bool = True) -> None:
        """Check that ``source`` (a file's name) has every column the schema reads (and, with
        ``drop``, the columns it names as dropped).

        Raises:
            ValueError: naming the missing columns and the columns the file has.
        """
        missing = [c for c in self.columns + (list(self.drop) if drop else []) if c not in columns]
        if missing:
            raise ValueError(f"{source} has no column {missing[0]!r} that the schema names"
                             f"{f' (nor {missing[1:]})' if missing[1:] else ''}; its columns are {list(columns)}")


def schema_to_dict(schema: Schema) -> dict[str, Any]:
    """``schema`` as plain data (:func:`plain_data`; :func:`schema_from_dict` reads it back)."""
    return plain_data(schema)


def schema_from_dict(table: Mapping[str, Any], where: str) -> Schema:
    """A :class:`Schema` from a job file's ``[schema]`` table (or :func:`schema_to_dict`'s output);
    errors name ``where`` and the closest valid key."""
    check_keys(table, [f.name for f in dataclasses.fields(Schema)], where)
    if "label" not in table:
        raise ValueError(f"{where} has no label: add label = {{ column = \"...\", positive = [\"1\"] }}")
    label = table["label"] if isinstance(table["label"], Mapping) else {"column": table["label"]}
    return checked(where, Schema, build_dataclass(Label, label, f"{where} label"),
                  tuple(build_dataclass(Categorical, c, f"{where} categorical[{i}]") for i, c in enumerate(table.get("categorical", ()))),
                  tuple(build_dataclass(Dense, d, f"{where} dense[{i}]") for i, d in enumerate(table.get("dense", ()))),
                  tuple(build_dataclass(Cross, x, f"{where} crosses[{i}]") for i, x in enumerate(table.get("crosses", ()))),
                  tuple(table.get("drop", ())))
