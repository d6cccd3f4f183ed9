"""Job config files: ``hetero train --config job.toml``, the command line's input in one file.

Sections (every one optional)::

    [data]                      # a user's file, read on pyarrow (hetero.data.readers)
    path = "clicks.csv"         # or --data-path; also "parts/" (a directory), "day_*.csv.gz", ["a.csv", "b.csv"]
    format = "csv"              # "csv" (any delimiter), "parquet", "libsvm", "libfm"
    delimiter = ","
    header = true               # else column_names = ["label", "city", ...] (with a header: renamed)
    null_values = ["NA"]        # texts read as missing (besides the empty field)
    split = [0.8, 0.1, 0.1]     # train/validation/test: random (seeded by --seed), or
    time_column = "ts"          # in this column's order (the latest rows test), or
    valid_path = "valid.csv"    # files of their own (with test_path; path then trains)
    fetch = "movielens-100k"    # a public data set hetero downloads (checked); relative paths are in it
    [[data.join]]               # a side table's columns joined to every row by a key
    path = "users.csv"
    on = "user_id"              # and any reader key above for the side file (default: [data]'s)

Relative paths resolve against ``--data-dir`` if given, else the fetched data set's directory,
else the current directory.

    [schema]                    # what the columns mean (hetero.data.schema)
    label = { column = "clicked", positive = ["yes"] }     # or threshold = 4
    drop = ["note"]
    [[schema.categorical]]
    column = "city"             # separator = "|" (multi-hot), hash_buckets = N, min_count, role
    [[schema.dense]]
    column = "age"
    transform = "standardize"   # "none", "log1p"
    [[schema.crosses]]
    columns = ["city", "age_bucket"]
    hash_buckets = 1000

    [train]                     # any flag of `hetero train`, by its name: batch_size = 512
    epochs = 3
    hidden = [256, 128]

``[train]`` becomes command-line flags placed before the real ones, so a flag given on the
command line overrides the file and argparse checks the file's values as it checks flags. A key
that does not exist is an error naming the closest valid key; nothing runs or is written then.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetero.data.readers import Join, ReaderConfig
from hetero.data.split import Split
from hetero.data.schema import Schema, build_dataclass, check_keys, checked, schema_from_dict
from hetero.data.toml_values import check_type

SECTIONS = ("data", "schema", "train")


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where a job's own data is and how to read and split it.

    Attributes:
        path: the data: a file, a directory of part files, a glob pattern, or several of
            these (a tuple), compressed line files read decompressed
            (:func:`hetero.data.readers.source_files`); ``None``: given by ``--data-path``.
        reader: how it is read (and its joins).
        split: how its rows become train / validation / test (random ones seeded by ``--seed``).
        fetch: a public data set (:data:`hetero.data.fetch.PUBLIC_DATA`) to download; relative
            paths are in its directory.
    """

    path: Path | tuple[Path, ...] | None = None
    reader: ReaderConfig = ReaderConfig()
    split: Split = Split()
    fetch: str | None = None

    def located(self, data_dir: Path | None, cache_dir: Path | None = None) -> "DataSource":
        """This source with relative paths under ``data_dir``, else under the fetched data set's
        directory (downloaded into ``cache_dir`` if needed), else as they are.

        Raises:
            ValueError: ``fetch`` names no public data set (naming the valid ones).
            RuntimeError: the download failed or did not match its pinned SHA-256.
        """
        from hetero.data.fetch import fetch_public

        base = data_dir if data_dir is not None else fetch_public(self.fetch, cache_dir) if self.fetch else None
        if base is None:
            return self

        def under(p):  # noqa: ANN001, ANN202 - a Path, a tuple of them, or None
            if isinstance(p, tuple):
                return tuple(under(x) for x in p)
            return p if p is None or p.is_absolute() else base / p

        joins = tuple(dataclasses.replace(j, path=under(j.path)) for j in self.reader.joins)
        split = dataclasses.replace(self.split, valid_path=under(self.split.valid_path),
                                    test_path=under(self.split.test_path))
        return DataSource(under(self.path), dataclasses.replace(self.reader, joins=joins), split, self.fetch)


@dataclasses.dataclass(frozen=True)
class JobFile:
    """A parsed job config file.

    Attributes:
        schema: the ``[schema]`` section (``None``: the job trains on a built-in data set).
        source: the ``[data]`` section.
        argv: the ``[train]`` section as command-line flags.
    """

    schema: Schema | None
    source: DataSource
    argv: tuple[str, ...]


def read_job_file(path: Path, flags: Mapping[str, bool]) -> JobFile:
    """Parse ``path``; ``flags`` maps each ``hetero train`` flag (``--batch-size``) to whether it
    takes a value (``False``: a switch such as ``--no-progress``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: TOML that does not parse, or a key, section or value that does not exist
            (naming the file, where, and the closest valid key).
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same parser, before it joined the standard library
        import tomli as tomllib

    if not path.is_file():
        raise FileNotFoundError(f"job config file {path} does not exist")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    check_keys(doc, SECTIONS, f"{path}")
    data = dict(doc.get("data", {}))
    where = f"{path} [data]"
    split_keys = {"split": "fractions", "time_column": "time_column", "valid_path": "valid_path", "test_path": "test_path"}
    reader_keys = [f.name for f in dataclasses.fields(ReaderConfig) if f.name != "joins"]
    check_keys(data, ("path", "fetch", "join", *split_keys, *reader_keys), where)
    split = {split_keys[k]: v for k, v in data.items() if k in split_keys}
    reader = {k: v for k, v in data.items() if k in reader_keys}
    joins = []
    for i, table in enumerate(data.get("join", ())):
        at = f"{where} join[{i}]"
        check_keys(table, ("path", "on", *reader_keys), at)
        if "path" not in table or "on" not in table:
            raise ValueError(f"{at}: a join needs path (the side table) and on (the key column)")
        own = {k: v for k, v in reader.items() if k != "column_names"} | {k: v for k, v in table.items()
                                                                           if k in reader_keys}
        check_type(table["path"], Path, "path", at)
        check_type(table["on"], str, "on", at)
        joins.append(checked(at, Join, Path(table["path"]), table["on"], build_dataclass(ReaderConfig, own, at)))
    if "path" in data:
        check_type(data["path"], str | tuple[str, ...], "path", where)
    data_path = tuple(Path(p) for p in data["path"]) if isinstance(data.get("path"), list) else \
        Path(data["path"]) if "path" in data else None
    source = DataSource(data_path,
                        build_dataclass(ReaderConfig, {**reader, "joins": tuple(joins)}, where),
                        _split(split, where), data.get("fetch"))
    schema = schema_from_dict(doc["schema"], f"{path} [schema]") if "schema" in doc else None
    return JobFile(schema, source, _argv(doc.get("train", {}), flags, f"{path} [train]"))


def _split(table: Mapping[str, Any], where: str) -> Split:
    """The ``[data]`` split keys (``split``, ``time_column``, ``valid_path``, ``test_path``) as a :class:`Split`."""
    names = {"fractions": "split"}  # a field's job-file key
    hints = typing.get_type_hints(Split)
    for key, value in table.items():
        check_type(value, hints[key], names.get(key, key), where)
    fields = {k: Path(v) if k.endswith("_path") else tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    return checked(where, Split, **fields)


def _argv(table: Mapping[str, Any], flags: Mapping[str, bool], where: str) -> tuple[str, ...]:
    names = {f.removeprefix("--").replace("-", "_"): f for f in flags}
    check_keys(table, names, where)
    argv: list[str] = []
    for key, value in table.items():
        flag = names[key]
        if not flags[flag]:  # a switch: true sets it (the command line cannot unset it)
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {key} is a switch; give true or false, not {value!r}")
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return tuple(argv)
