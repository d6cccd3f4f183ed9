"""A job file's values checked against the type of the field they fill (TOML gives strings,
numbers, booleans and lists; a dataclass field says which it takes): one line naming the key,
the value, the type expected and an example, instead of Python's words later; a table built
into its dataclass (:func:`build_dataclass`, keys checked, enums parsed) and back
(:func:`plain_data`)."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any


def check_type(value: Any, hint: Any, key: str, where: str) -> None:  # noqa: ANN401 - a TOML value, a type
    """Check a job file's ``key = value`` against the field's type ``hint`` (an int where a
    float is wanted passes; a string never passes for a number, nor a number for a string).

    Raises:
        ValueError: naming ``where``, the key, the value, the expected type and an example.
    """
    if not _fits(value, hint):
        raise ValueError(f"{where}: {key} = {value!r} is {_toml_kind(value)}; give {expected_type(hint)}, e.g. {key} = "
                         f"{_example(hint)}")


def _fits(value: Any, hint: Any) -> bool:  # noqa: ANN401
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # (None: a saved schema's; TOML has none)
        return (value is None and type(None) in args) or any(_fits(value, a) for a in args if a is not type(None))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        inner = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        return len(inner) == len(value) and all(_fits(v, a) for v, a in zip(value, inner))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str or hint is pathlib.Path or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return isinstance(value, (str, hint))
    return True  # a nested dataclass (joins): checked where it is built


def _toml_kind(value: Any) -> str:  # noqa: ANN401
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}
    return kinds.get(type(value), type(value).__name__)


def expected_type(hint: Any) -> str:  # noqa: ANN401
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(expected_type(a) for a in args if a is not type(None))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {expected_type(args[0]).removeprefix('a ').removeprefix('an ')}s"
        return f"a list of {len(args)} {expected_type(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f"one of {[k.value for k in hint]}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            pathlib.Path: "a path (a string)"}.get(hint, str(hint))


def _example(hint: Any) -> str:  # noqa: ANN401
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _example(next(a for a in args if a is not type(None)))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"[{_example(args[0])}, {_example(args[0])}]"
        if args and args[0] is float and len(args) == 3:
            return "[0.8, 0.1, 0.1]"
        return "[" + ", ".join(_example(a) for a in args) + "]"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f'"{next(iter(hint)).value}"'
    return {bool: "true", int: "1000", float: "0.5", str: '"text"', pathlib.Path: '"file.csv"'}.get(hint, "...")


def parse_enum(kind: type[enum.Enum], value: object, what: str) -> enum.Enum:
    """``kind(value)``; a value that is not one is an error naming ``what`` and the valid values."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{what} {value!r} does not exist; valid values are {[k.value for k in kind]}") from None


def plain_data(value: Any) -> Any:  # noqa: ANN401 - JSON-able data
    """``value`` as JSON-able data: enums as their values, paths as text, tuples as lists,
    dataclasses as dicts of their fields (recursively)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [plain_data(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def build_dataclass(cls: type, table: Mapping[str, Any], where: str) -> Any:  # noqa: ANN401 - an instance of cls
    """``cls(**table)``: keys checked against its fields, an enum field's text converted, lists
    made tuples; the dataclass's own checks run (their errors prefixed with ``where``)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    check_keys(table, fields, where)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in table.items():
        check_type(value, hints[key], key, where)
        default = fields[key].default
        if isinstance(default, enum.Enum) and not isinstance(value, enum.Enum):
            value = parse_enum(type(default), value, f"{where}: {key} =")
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    return checked(where, cls, **kwargs)


def checked(where: str, cls: type, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - an instance of cls
    """``cls(*args, **kwargs)``, its own checks' errors prefixed with ``where``."""
    try:
        return cls(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def check_keys(table: Mapping[str, Any], valid: Any, where: str) -> None:  # noqa: ANN401 - names
    """Raise ``ValueError`` for a key of ``table`` not in ``valid``, naming the closest valid key."""
    valid = list(valid)
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{where}: no key {key!r}; {hint}valid keys are {valid}")
