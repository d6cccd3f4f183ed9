"""Job config files: ``hetero train --config job.toml``, the command line's input in one file.

Sections (every one optional)::

    [data]                      # a user's file, read on pyarrow (hetero.data.readers)
    path = "clicks.csv"         # or --data-path
    format = "csv"              # "csv" (any delimiter) or "parquet"
    delimiter = ","
    header = true               # else column_names = ["label", "city", ...]
    split = [0.8, 0.1, 0.1]     # train/validation/test: random (seeded by --seed), or
    time_column = "ts"          # in this column's order (the latest rows test), or
    valid_path = "valid.csv"    # files of their own (with test_path; path then trains)

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetero.data.readers import ReaderConfig, Split
from hetero.data.schema import Schema, build_dataclass, check_keys, checked, schema_from_dict

SECTIONS = ("data", "schema", "train")


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where a job's own data is and how to read and split it.

    Attributes:
        path: the file (``None``: given by ``--data-path``).
        reader: how it is read.
        split: how its rows become train / validation / test (random ones seeded by ``--seed``).
    """

    path: Path | None = None
    reader: ReaderConfig = ReaderConfig()
    split: Split = Split()


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
    check_keys(data, ("path", *split_keys, *(f.name for f in dataclasses.fields(ReaderConfig))), where)
    split = {split_keys[k]: Path(v) if k.endswith("_path") else v for k, v in data.items() if k in split_keys}
    source = DataSource(Path(data["path"]) if "path" in data else None,
                        build_dataclass(ReaderConfig, {k: v for k, v in data.items() if k != "path" and k not in split_keys}, where),
                        checked(where, Split, **split))
    schema = schema_from_dict(doc["schema"], f"{path} [schema]") if "schema" in doc else None
    return JobFile(schema, source, _argv(doc.get("train", {}), flags, f"{path} [train]"))


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
