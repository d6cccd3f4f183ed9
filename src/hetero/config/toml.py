"""Job files: a :class:`~hetero.config.job.JobConfig` read from TOML (:func:`read_job_file`) and
written back as TOML (:func:`job_to_toml`, what a run writes as ``RUN_DIR/config.toml``).

A job file's tables::

    [data]                      # where the data is and how it is read (hetero.data.readers)
    path = "clicks.csv"         # also "parts/" (a directory), "day_*.csv.gz", ["a.csv", "b.csv"]
    format = "csv"              # "csv", "parquet", "libsvm", "libfm", "libffm"; delimiter, header,
                                # column_names, quote_char, null_values, on_bad_rows
    split = [0.8, 0.1, 0.1]     # random (seeded), or time_column = "ts", or valid_path + test_path
    fetch = "movielens-100k"    # a public data set hetero downloads (checked); relative paths are in it
    [[data.join]]               # a side table's columns joined to every row by a key
    path = "users.csv"
    on = "user_id"
    [schema]                    # what the columns mean (hetero.data.schema)
    label = { column = "clicked", positive = ["yes"] }
    [[schema.categorical]]
    column = "city"
    [training]                  # any section of JobConfig: [model], [optimizer], [training],
    batch_size = 512            # [checkpoint], [parallelism], [parameter_server], [planner], [logging]
    [train]                     # or the old flags by name (batch_size, dense_lr, ps_servers, ...)
    epochs = 3

Relative paths resolve against ``data.dir`` (``--data-dir``), else the fetched data set's
directory, else the current directory. A key that does not exist, a value of the wrong type and
a key set twice are errors naming the file, the table and the key (with the closest valid key).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from hetero.config.job import SECTIONS, Data, JobConfig, keys, parse_bytes
from hetero.data.reader_config import Join, ReaderConfig, format_of, with_format_separators
from hetero.data.schema import schema_from_dict
from hetero.data.toml_values import build_dataclass, check_keys, checked, parse_enum, plain_data
from hetero.data.split import Split
from hetero.data.toml_values import check_type

# keys a run's config.toml leaves out: how this process was started, not what the job is
NOT_RECORDED = {("checkpoint", "resume"), ("checkpoint", "overwrite"), ("data", "dir")}
_SPLIT_KEYS = {"split": "fractions", "time_column": "time_column", "time_format": "time_format",
               "valid_path": "valid_path", "test_path": "test_path"}
_READER_KEYS = [f.name for f in dataclasses.fields(ReaderConfig) if f.name != "joins"]
_DATA_KEYS = [f.name for f in dataclasses.fields(Data) if f.name not in ("reader", "split")]


def legacy_keys() -> dict[str, tuple[str, str]]:
    """A job file's ``[train]`` keys (the old flags' names) -> (section, key)."""
    out = {}
    for section, cls in (("data", Data), *SECTIONS.items()):
        for name, k in keys(cls).items():
            if k.flag:
                out[k.flag[2:].replace("-", "_")] = (section, name)
    out["no_progress"] = ("logging", "progress")  # inverted: see _value
    out.pop("progress", None)
    return out


DATA_TABLE_KEYS = (*_SPLIT_KEYS, *_READER_KEYS)  # [data] keys the command line sets as --data.KEY (see data_keys)


def data_keys(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The command line's ``--data.KEY VALUE`` for the reader and split keys of a job file's
    ``[data]`` table (``--data.valid_path dev.csv``, ``--data.header false``, ``--data.split
    "[0.9, 0.1]"``; ``-`` and ``_`` alike), each value read as a TOML value where it is one, else as
    text; and the rest of ``argv``. (The other ``[data]`` keys are the config manager's own.)"""
    rest, found, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        name, _, inline = arg.partition("=")
        key = name[len("--data."):].replace("-", "_") if name.startswith("--data.") else ""
        if key in DATA_TABLE_KEYS:
            value = inline if inline else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if inline else 2
            found[key] = _toml_value(value)
            continue
        rest.append(arg)
        i += 1
    return rest, found


def _toml_value(text: str) -> Any:  # noqa: ANN401 - a TOML value
    tomllib = _tomllib()
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _tomllib():  # noqa: ANN202 - the module
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same parser, before it joined the standard library
        import tomli as tomllib
    return tomllib


def read_job_file(path: Path | None, data: Mapping[str, Any] | None = None) -> JobConfig:
    """The job file ``path`` over the defaults (``None``: no file), with ``data``'s keys over its
    ``[data]`` table's (:func:`data_keys`: the command line's).

    Raises:
        FileNotFoundError: no such file.
        ValueError: TOML that does not parse, or a table, key or value that does not exist or
            has the wrong type (naming the file, the table, the key and the closest valid key).
    """
    tomllib = _tomllib()
    if path is None:
        return _job({"data": dict(data or {})}, "the command line") if data else JobConfig()
    if not path.is_file():
        raise FileNotFoundError(f"job config file {path} does not exist")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    if data:  # the command line's [data] keys over the file's
        doc = {**doc, "data": {**doc.get("data", {}), **data}}
    return _job(doc, str(path), path)


def _job(doc: Mapping[str, Any], where: str, path: Path | None = None) -> JobConfig:
    """The job of a job file's tables ``doc`` (errors name ``where``)."""
    check_keys(doc, ("data", "schema", "train", *SECTIONS), f"{where}")
    sections: dict[str, dict[str, Any]] = {name: dict(doc.get(name, {})) for name in SECTIONS}
    data = dict(doc.get("data", {}))
    legacy = legacy_keys()
    check_keys(doc.get("train", {}), legacy, f"{where} [train]")
    for old, value in doc.get("train", {}).items():
        section, name = legacy[old]
        table = data if section == "data" else sections[section]
        if name in table:
            raise ValueError(f"{where}: {name} is set in [{section}] and as {old} in [train]: keep one")
        table[name] = (not value if isinstance(value, bool) else value) if old == "no_progress" else value
        if old == "no_progress" and not isinstance(value, bool):
            raise ValueError(f"{where} [train]: no_progress = {value!r}: give true or false")
    job = JobConfig(config=path, data=_data(data, f"{where} [data]"),
                    schema=schema_from_dict(doc["schema"], f"{where} [schema]") if "schema" in doc else None)
    if job.schema is not None:
        if not job.schema.categorical and not job.schema.dense:
            raise ValueError(f"{where} [schema] has no feature: add [[schema.categorical]] or [[schema.dense]] columns "
                             f"(a model of no feature scores every row alike: AUC 0.5)")
        job.schema = with_format_separators(job.schema, job.data.reader)  # (a libFM file's bags: "|")
    for name, cls in SECTIONS.items():
        setattr(job, name, _section(cls, sections[name], f"{where} [{name}]"))
    return job


def _section(cls: type, table: Mapping[str, Any], where: str) -> Any:  # noqa: ANN401 - an instance of cls
    fields = keys(cls)
    check_keys(table, fields, where)
    return cls(**{name: _value(value, fields[name].type, name, where) for name, value in table.items()})


def _value(value: Any, hint: Any, name: str, where: str) -> Any:  # noqa: ANN401 - a TOML value, a type
    """A TOML value as the field's type (enums from their values, sizes from "2GiB", lists as tuples)."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if isinstance(value, str) and name.endswith("_memory"):
        try:
            return parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"{where}: {name} = {e}") from None
    for kind in kinds:
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return parse_enum(kind, value, f"{where}: {name} =")
    check_type(value, hint, name, where)
    if Path in kinds:
        return Path(value)
    return tuple(value) if isinstance(value, list) else value


def _data(table: Mapping[str, Any], where: str) -> Data:
    """``[data]``: its own keys, the reader's, the split's and the joins."""
    check_keys(table, ("join", *_DATA_KEYS, *_SPLIT_KEYS, *_READER_KEYS), where)
    reader = {k: v for k, v in table.items() if k in _READER_KEYS}
    if "format" not in reader and isinstance(table.get("path"), (str, list)) and table["path"]:
        named = format_of(table["path"])  # (a job's config.toml then says what it read)
        if named is not None:
            reader["format"] = named.value
    joins = []
    for i, side in enumerate(table.get("join", ())):
        at = f"{where} join[{i}]"
        check_keys(side, ("path", "on", *_READER_KEYS), at)
        if "path" not in side or "on" not in side:
            raise ValueError(f"{at}: a join needs path (the side table) and on (the key column)")
        own = {k: v for k, v in reader.items() if k != "column_names"} | {k: v for k, v in side.items()
                                                                           if k in _READER_KEYS}
        check_type(side["path"], Path, "path", at)
        check_type(side["on"], str, "on", at)
        joins.append(checked(at, Join, Path(side["path"]), side["on"], build_dataclass(ReaderConfig, own, at)))
    fields = keys(Data)
    own = {}
    for name, value in table.items():
        if name == "path":
            check_type(value, str | tuple[str, ...], "path", where)
            own["path"] = tuple(Path(p) for p in value) if isinstance(value, list) else Path(value)
        elif name in fields:
            own[name] = _value(value, fields[name].type, name, where)
    split = {_SPLIT_KEYS[k]: v for k, v in table.items() if k in _SPLIT_KEYS}
    files = {}  # valid_path / test_path as a table: the file and how it reads, where not as the training file
    for key in ("valid_path", "test_path"):
        if isinstance(split.get(key), Mapping):
            at, side = f"{where} {key}", split[key]
            check_keys(side, ("path", *_READER_KEYS), at)
            if "path" not in side:
                raise ValueError(f"{at}: give the file: {key} = {{ path = \"...\", header = false }}")
            check_type(side["path"], str, "path", at)
            split[key] = side["path"]
            files[key.replace("_path", "_reader")] = build_dataclass(
                ReaderConfig, {**reader, **{k: v for k, v in side.items() if k != "path"}, "joins": tuple(joins)}, at)
    hints = typing.get_type_hints(Split)
    for name, value in split.items():
        check_type(value, hints[name], "split" if name == "fractions" else name, where)
    split = {k: Path(v) if k.endswith("_path") else tuple(v) if isinstance(v, list) else v for k, v in split.items()}
    return Data(**own, reader=build_dataclass(ReaderConfig, {**reader, "joins": tuple(joins)}, where),
                split=checked(where, Split, **split, **files))


def job_to_dict(job: JobConfig) -> dict[str, Any]:
    """``job`` as a job file's tables (what :func:`read_job_file` reads back): every key with
    its value, ``None`` values left out (TOML has no null: they are the defaults)."""
    data = {name: getattr(job.data, name) for name in _DATA_KEYS if ("data", name) not in NOT_RECORDED}
    data |= {k: v for k, v in plain_data(job.data.reader).items() if k != "joins"}
    data |= {key: getattr(job.data.split, name) for key, name in _SPLIT_KEYS.items()}
    base = plain_data(job.data.reader)
    for key, part in (("valid_path", "valid"), ("test_path", "test")):
        own = job.data.split.reader_of(part, job.data.reader)
        if own is not job.data.reader and data[key] is not None:  # the file's own reader keys, where they differ
            data[key] = {"path": data[key], **{k: v for k, v in plain_data(own).items()
                                               if k != "joins" and v != base[k]}}
    if job.data.reader.joins:
        data["join"] = [{"path": j.path, "on": j.on, **{k: v for k, v in plain_data(j.reader).items() if k != "joins"}}
                        for j in job.data.reader.joins]
    doc: dict[str, Any] = {"data": data}
    if job.schema is not None:
        doc["schema"] = plain_data(job.schema)
    for name in SECTIONS:
        section = getattr(job, name)
        doc[name] = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                     if (name, f.name) not in NOT_RECORDED}
    return _plain(doc)


def job_to_toml(job: JobConfig) -> str:
    """``job`` as TOML text (:func:`job_to_dict`)."""
    return tomli_w.dumps(job_to_dict(job))


def _plain(value: Any) -> Any:  # noqa: ANN401 - TOML-able data
    """``value`` as TOML data: :func:`plain_data`, with ``None`` values left out of tables."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    value = plain_data(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return _plain(value) if isinstance(value, Mapping) else value
