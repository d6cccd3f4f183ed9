"""Each rank's part of a file read sharded over ranks: byte ranges of a line-format file cut at
line starts, row groups of a Parquet file (:mod:`hetero.data.stream` streams them, :mod:`hetero.predict`
scores them); and a cheap fingerprint of a file's ends for a run's identity.

Reference: Hadoop's line-aligned byte splits.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from hetero.data.files import single_file
from hetero.data.reader_config import FileFormat, ReaderConfig
from hetero.data.readers import column_names


def file_shards(path: str | Path, reader: ReaderConfig, world_size: int) -> list[tuple[int, int]]:
    """Each rank's shard of ``path`` (see the module docstring): bytes of a line format
    (:func:`byte_shards`, after a header), row groups of a Parquet file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: several files or a compressed one (:func:`~hetero.data.files.single_file`).
    """
    path = single_file(path, "a read sharded over ranks")
    if reader.format is not FileFormat.PARQUET:
        return byte_shards(path, world_size, column_names(path, reader)[1])
    import pyarrow.parquet as pq

    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    meta = pq.ParquetFile(path).metadata
    before = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    cuts = [int(np.abs(before - before[-1] * r / world_size).argmin()) for r in range(world_size + 1)]
    cuts = np.maximum.accumulate(cuts)  # (increasing: a group holds a run of rows)
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]


def byte_shards(path: str | Path, world_size: int, data_start: int = 0) -> list[tuple[int, int]]:
    """Rank ``r``'s bytes ``[start, end)`` of ``path``'s rows (from ``data_start``, after a header):
    even cuts moved forward to the next line start; disjoint and covering (an empty range when a
    rank's cut falls after the last line start)."""
    path = Path(path)
    size = path.stat().st_size
    cuts = [data_start]
    with open(path, "rb") as f:
        for r in range(1, world_size):
            pos = max(data_start + (size - data_start) * r // world_size, cuts[-1])
            if pos > data_start:  # a line start: the byte before it is a newline
                f.seek(pos - 1)
                while True:
                    chunk = f.read(1 << 16)
                    at = chunk.find(b"\n")
                    if at >= 0 or not chunk:
                        pos = f.tell() - len(chunk) + at + 1 if at >= 0 else size
                        break
            cuts.append(min(pos, size))
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:]))


def ends_crc(path: Path, size: int = 1 << 20) -> int:
    """The CRC-32 of the first and the last ``size`` bytes of ``path`` (a file's identity without reading it all)."""
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(size))
        f.seek(max(0, path.stat().st_size - size))
        return zlib.crc32(f.read(size), crc)
