"""An export's ``dense.pt2`` loaded so that no code from the file runs.

``torch.export.load`` trusts its file: a weight or constant marked ``use_pickle`` is read with
``torch.load(weights_only=False)`` (any pickle), an "opaque" constant with ``pickle.loads``, a
custom object with torch's own unpickler; the graph's node targets are resolved as any attribute
under ``torch`` (``torch.os.system``), its symbolic shapes are parsed with ``sympy.sympify`` (an
``eval``) and its ``guards_code`` is Python source the loaded module executes on every call.

:func:`load_program` reads the archive first and refuses it, naming the entry, unless it is the
plain program ``hetero export`` writes:

* its entries are of an allow-list (the archive's version files, one model's JSON, its weights and
  tensor constants as raw bytes, their two JSON configs, the sample inputs): no compiled
  (AOTInductor) model, no custom or opaque object, no legacy pickled state dict;
* no weight or constant is pickled (``use_pickle``), and the sample inputs load with
  ``torch.load(weights_only=True)``;
* every graph target is an operator overload of ``torch.ops.aten`` / ``torch.ops.prims`` or one of
  a few ``_operator`` functions, every symbolic expression is of sympy's ``Symbol``/``Integer``
  and arithmetic over them, and every guard compares input sizes (``L['x'].size()[0] == ...``).

Then ``torch.export.load`` reads it with ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` set (torch's own switch:
any ``torch.load`` inside is weights-only), so whatever the checks missed cannot unpickle code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_ENTRIES = re.compile(r"(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
                      r"|models/model\.json|data/weights/model_weights_config\.json"
                      r"|data/constants/model_constants_config\.json|data/weights/weight_\d+"
                      r"|data/constants/tensor_\d+|data/sample_inputs/model\.pt)")
_TARGET = re.compile(r"torch\.ops\.(aten|prims)\.\w+\.\w+")
_OPERATORS = {f"_operator.{n}" for n in ("getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow",
                                         "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_")}
_EXPR_WORDS = {"Symbol", "Integer", "positive", "integer", "True", "False", "Max", "Min", "FloorDiv", "Mod",
               "PythonMod", "CeilToInt", "FloorToInt", "TruncToInt"}
_EXPR = re.compile(r"[\w\s()+\-*/%,.=']*")
_SIZE = r"L(\['[^'\\\n]+'\])+\.size\(\)\[\d+\]|-?\d+"
_GUARD = re.compile(rf"({_SIZE})( (==|!=|<=|>=|<|>) ({_SIZE}))+")
_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_env_lock = threading.Lock()  # (the switch is process-wide: one load at a time sets it)


class UnsafeProgramError(ValueError):
    """An exported program that holds code or pickled objects (crafted, or not ``hetero export``'s)."""


def load_program(path: str | Path) -> torch.export.ExportedProgram:
    """The exported program at ``path`` (``torch.export.save``'s archive), read without running
    code from it (see the module docstring). Thread-safe.

    Raises:
        UnsafeProgramError: an entry, payload, target, expression or guard outside the allow-list,
            naming it.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no exported program at {path}")
    check_program(path)
    with _weights_only():
        return torch.export.load(str(path))


def check_program(path: Path) -> None:
    """Refuse ``path`` unless it is a plain exported program (:func:`load_program`'s checks).

    Raises:
        UnsafeProgramError: naming the entry and what in it is refused.
    """
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise UnsafeProgramError(f"{path} is not an exported program archive ({e})") from None
    with z:
        names = z.namelist()
        roots = {n.split("/", 1)[0] for n in names}
        if len(roots) != 1:
            raise UnsafeProgramError(f"{path}: an exported program has one root folder; this one has {sorted(roots)}")
        root = roots.pop()
        for name in names:
            if "/" not in name or not _ENTRIES.fullmatch(name.split("/", 1)[1]):
                raise UnsafeProgramError(f"{path}: entry {name!r} is not part of a plain exported program (a compiled "
                                         f"model, a pickled object or a legacy state dict): refused")
        for config in ("data/weights/model_weights_config.json", "data/constants/model_constants_config.json"):
            payloads = json.loads(z.read(f"{root}/{config}")).get("config", {}) if f"{root}/{config}" in names else {}
            for fqn, meta in payloads.items():
                if meta.get("use_pickle") or not re.fullmatch(r"(weight|tensor)_\d+", str(meta.get("path_name"))):
                    raise UnsafeProgramError(f"{path}: {config} stores {fqn!r} as a pickled object: refused")
        if f"{root}/data/sample_inputs/model.pt" in names:
            import io

            try:
                torch.load(io.BytesIO(z.read(f"{root}/data/sample_inputs/model.pt")), weights_only=True)
            except Exception as e:  # noqa: BLE001 - any refusal of the weights-only unpickler
                raise UnsafeProgramError(f"{path}: its sample inputs are not plain tensors ({e}): refused") from None
        _check_graph(json.loads(z.read(f"{root}/models/model.json")), path)


def _check_graph(doc: Any, path: Path) -> None:  # noqa: ANN401 - JSON
    for key, value in _strings(doc):
        if key in ("target", "as_operator") and not (_TARGET.fullmatch(value) or value in _OPERATORS):
            raise UnsafeProgramError(f"{path}: the graph calls {value!r}, not an operator of torch.ops.aten/prims: "
                                     f"refused")
        if key == "expr_str" and not _safe_expression(value):
            raise UnsafeProgramError(f"{path}: symbolic expression {value[:80]!r} is not of sizes: refused")
    for guard in doc.get("guards_code", []) if isinstance(doc, dict) else []:
        if not isinstance(guard, str) or not _GUARD.fullmatch(guard):
            raise UnsafeProgramError(f"{path}: guard {str(guard)[:80]!r} is not a comparison of input sizes: refused")


def _safe_expression(text: str) -> bool:
    if not _EXPR.fullmatch(text) or "__" in text:
        return False
    quoted = re.findall(r"'([^']*)'", text)
    words = re.findall(r"[A-Za-z_]\w*", re.sub(r"'[^']*'", "", text))
    return all(re.fullmatch(r"[su]\d+", q) for q in quoted) and all(w in _EXPR_WORDS for w in words)


def _strings(doc: Any, key: str = "") -> Iterator[tuple[str, str]]:  # noqa: ANN401 - JSON
    """Every string of a JSON document with the key it is under."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _strings(v, k)
    elif isinstance(doc, list):
        for v in doc:
            yield from _strings(v, key)
    elif isinstance(doc, str):
        yield key, doc


@contextlib.contextmanager
def _weights_only() -> Iterator[None]:
    """``torch.load`` weights-only for the block, whatever its callers ask (torch's own switch)."""
    with _env_lock:
        old = os.environ.get(_ENV)
        os.environ[_ENV] = "1"
        try:
            yield
        finally:
            if old is None:
                del os.environ[_ENV]
            else:
                os.environ[_ENV] = old
