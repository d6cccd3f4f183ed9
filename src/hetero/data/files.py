"""The files a data path names: one file, a directory of part files, a glob, or a list of
these; compressed line files are read decompressed (:mod:`hetero.data.rows`)."""

from __future__ import annotations

import glob
from collections.abc import Sequence
from pathlib import Path

from hetero.data.rows import compressed


def source_files(path: str | Path | Sequence[str | Path]) -> list[Path]:
    """The files a data path names, in order: a file; a directory's files (sorted by name, hidden
    ones and ``_SUCCESS``-style markers left out: Spark's and Hive's part files); a glob pattern's
    matches (sorted); or a list of any of these, in its order. A compressed line file
    (:data:`hetero.data.rows.COMPRESSED`) is read decompressed.

    Raises:
        FileNotFoundError: a directory without files, or a pattern that matches none.
    """
    if isinstance(path, (list, tuple)):
        return [f for p in path for f in source_files(p)]
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith((".", "_")))
        if not files:
            raise FileNotFoundError(f"data directory {p} holds no data files")
        return files
    if any(ch in str(p) for ch in "*?[") and not p.exists():
        files = sorted(Path(f) for f in glob.glob(str(p)) if Path(f).is_file())
        if not files:
            raise FileNotFoundError(f"no data file matches {p}")
        return files
    return [p]


def single_file(path: str | Path | Sequence[str | Path], what: str) -> Path:
    """The one uncompressed file ``what`` (a byte-sharded read) needs.

    Raises:
        ValueError: several files or a compressed one (naming them and the fix).
    """
    files = source_files(path)
    if len(files) != 1 or compressed(files[0]):
        named = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
        raise ValueError(f"{what} cuts one uncompressed file into byte ranges; {named} cannot be cut: decompress and "
                         f"concatenate it into one file, or read it in memory (or prepare a cache: hetero data prepare)")
    return files[0]
