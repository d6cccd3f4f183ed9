"""How a data file reads (:class:`ReaderConfig`: its format, delimiter, header, names, quoting,
missing values, bad rows and joins), as a job file's ``[data]`` table gives it, kept in a run's
record; a file's format by its name (:func:`inferred`); and a schema as a file of a format reads
it (:func:`with_format_separators`). :mod:`hetero.data.readers` reads files by it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hetero.data.rows import COMPRESSED, BadRows
from hetero.data.schema import Schema
from hetero.data.toml_values import plain_data


class FileFormat(enum.Enum):
    """A file's format."""

    CSV = "csv"  # any delimiter: CSV, TSV, ...
    PARQUET = "parquet"
    LIBSVM = "libsvm"  # "label idx:value ...": columns "label" and "features" (the indices, "|"-joined)
    LIBFM = "libfm"  # libFM's own files (Rendle 2012; e.g. the Frappe release): the libsvm layout
    LIBFFM = "libffm"  # "label field:idx:value ...": columns "label" and one per field, named by its number


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    """How a file is read.

    Attributes:
        format: the :class:`FileFormat`.
        delimiter: CSV: the field separator (``"\\t"`` for TSV).
        header: CSV: the first line names the columns.
        column_names: CSV without a header: the columns' names, in file order.
            With a header, they replace its names (the header line is skipped).
        quote_char: CSV: the quote around fields holding the delimiter (``""``: none; faster).
        null_values: CSV: texts read as a missing value (``"NA"``, ``"unknown"``); the empty
            field always is.
        on_bad_rows: :class:`BadRows`: stop at the first bad row, or skip and count them.
        joins: side tables joined to every row (:class:`Join`).
    """

    format: FileFormat = FileFormat.CSV
    delimiter: str = ","
    header: bool = True
    column_names: tuple[str, ...] = ()
    quote_char: str = '"'
    null_values: tuple[str, ...] = ()
    on_bad_rows: BadRows = BadRows.ERROR
    joins: tuple[Join, ...] = ()

    def __post_init__(self) -> None:
        for name in ("column_names", "null_values", "joins"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.format is FileFormat.CSV and not self.header and not self.column_names:
            raise ValueError("a CSV file without a header needs column_names: the columns' names in file order")
        if len(self.delimiter) != 1:
            raise ValueError(f"delimiter {self.delimiter!r}: give one character (e.g. ',' or '\\t')")


@dataclasses.dataclass(frozen=True)
class Join:
    """Columns of a side table joined to every row of a file by a key (see the module docstring).

    Attributes:
        path: the side table's file, read whole into memory.
        on: the key column, named so in both files; the side table's other columns join the
            rows (a name the main file has too is an error: rename one with ``column_names``).
        reader: how the side table is read (its own joins: none).
    """

    path: Path
    on: str
    reader: ReaderConfig = ReaderConfig()

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.reader.joins:
            raise ValueError(f"join of {self.path}: a side table has no joins of its own; join every table to the main "
                             f"file")


def reader_to_dict(reader: ReaderConfig) -> dict[str, Any]:
    """``reader`` as JSON-able data (:func:`reader_from_dict` reads it back)."""
    return plain_data(reader)


def reader_from_dict(doc: Mapping[str, Any]) -> ReaderConfig:
    """The :class:`ReaderConfig` of :func:`reader_to_dict`'s output."""
    fields = dict(doc)
    fields["format"] = FileFormat(fields["format"])
    fields["on_bad_rows"] = BadRows(fields["on_bad_rows"])
    fields["joins"] = tuple(Join(Path(j["path"]), j["on"], reader_from_dict(j["reader"])) for j in fields["joins"])
    return ReaderConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


SPARSE_FORMATS = (FileFormat.LIBSVM, FileFormat.LIBFM, FileFormat.LIBFFM)
SUFFIXES = {".parquet": FileFormat.PARQUET, ".pq": FileFormat.PARQUET, ".libsvm": FileFormat.LIBSVM,
            ".svm": FileFormat.LIBSVM, ".libfm": FileFormat.LIBFM, ".libffm": FileFormat.LIBFFM,
            ".ffm": FileFormat.LIBFFM}  # a file's format by its name (a compressed line file: the name inside)


def format_of(path: str | Path | Sequence[str | Path]) -> FileFormat | None:
    """The format a data path's name says (its first name: a file, a pattern or a list's first),
    looking through a compression suffix (``day_0.libsvm.gz``); ``None``: no name of a format."""
    first = Path(path[0] if isinstance(path, (list, tuple)) else path)
    name = first.name.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    return SUFFIXES.get(Path(name).suffix)


def inferred(config: ReaderConfig, path: str | Path | Sequence[str | Path]) -> ReaderConfig:
    """``config`` for ``path``: its format as the file's name says where ``config`` keeps the
    default (CSV) and the name says another - ``clicks.parquet`` is never read as CSV text."""
    named = format_of(path)
    if config.format is FileFormat.CSV and named is not None:
        return dataclasses.replace(config, format=named)
    return config


def with_format_separators(schema: Schema, config: ReaderConfig) -> Schema:
    """``schema`` as a file of ``config``'s format reads: a libsvm / libFM / libFFM file's feature
    columns hold a row's ids joined by ``|`` (:func:`~hetero.data.svmlight.sparse_format_batches`),
    so a categorical feature of one without a ``separator`` takes ``"|"`` - read whole, each
    row's set of ids would be one vocabulary value (a model of AUC 0.5)."""
    if config.format not in SPARSE_FORMATS:
        return schema
    cats = tuple(dataclasses.replace(c, separator="|") if c.separator is None and not c.numeric else c
                 for c in schema.categorical)
    return dataclasses.replace(schema, categorical=cats)
