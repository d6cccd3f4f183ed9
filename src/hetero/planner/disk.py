"""The disk rates the planner prices the SSD tier with (:class:`DiskRate`), measured through the
tier's own store (:class:`hetero.storage.records.RowFile`) in a scratch directory on the disk
in question: records written (appended) and synced, their pages dropped from the page cache
(``posix_fadvise(DONTNEED)``, no root needed), then read at random by the tier's I/O threads.
The rate of a cold disk: a store partly in the page cache misses to memory, which is faster."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hetero.planner.calibration_types import DiskRate
from hetero.storage.layout import Field, RecordLayout
from hetero.storage.records import RowFile

RECORD = 256  # bytes of the measured records (a 60-wide fp32 row with row-wise Adagrad's state)
ROWS = 1 << 18  # 64 MiB of records
READS = 1 << 14  # random reads timed


def measure_disk(directory: Path, threads: int = 16) -> DiskRate:
    """:class:`DiskRate` of the disk holding ``directory`` (created if absent; the scratch store
    is removed)."""
    directory.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".hetero-disk-", dir=directory))
    file = None
    try:
        layout = RecordLayout((Field("weight", torch.uint8, RECORD),))
        data = np.random.default_rng(0).integers(0, 255, (ROWS, RECORD), dtype=np.uint8)
        file = RowFile(scratch / "probe.rows", layout, ROWS, threads, empty=True)
        t0 = time.perf_counter()
        file.write(np.arange(ROWS, dtype=np.int64), data)
        file.seal()
        write = (time.perf_counter() - t0) / (ROWS * (RECORD + RowFile.HEADER))
        for fd in file.fds[file.fds >= 0]:
            os.posix_fadvise(int(fd), 0, 0, os.POSIX_FADV_DONTNEED)
        rows = np.random.default_rng(1).choice(ROWS, READS, replace=False).astype(np.int64)
        out = np.empty((READS, RECORD), np.uint8)
        t0 = time.perf_counter()
        file.read(rows, out)
        read = (time.perf_counter() - t0) / READS
        return DiskRate(read, write, RECORD)
    finally:
        if file is not None:
            file.close()
        shutil.rmtree(scratch, ignore_errors=True)
