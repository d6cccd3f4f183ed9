"""Typed settings of the SSD tier (:class:`SsdConfig`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hetero.storage.cache import CachePolicy


@dataclasses.dataclass(frozen=True)
class SsdConfig:
    """Where and how a table group on the SSD tier keeps its rows.

    Attributes:
        directory: a directory on a local disk for the group's record file (created if absent);
            the file is scratch space of one run (checkpoints are written elsewhere).
        cache_bytes: DRAM budget of the group's row cache, bytes (rows with their optimizer
            state; the cache holds ``cache_bytes // record bytes`` rows, at least one batch's).
        policy: the cache's replacement policy (:class:`CachePolicy`).
        io_threads: reads in flight per batch while a segment file is not mapped (``pread``;
            mapped records are copied on the cores of numba's pool).
        mapped_bytes: the store's pages the process keeps mapped, bytes, about
            (:mod:`hetero.storage.mapping`): past it the mappings let go of their pages, which stay
            in the page cache. What the resident set holds beyond the cache.
    """

    directory: Path
    cache_bytes: int = 256 << 20
    policy: CachePolicy = CachePolicy.LFU
    io_threads: int = 16
    mapped_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        if self.cache_bytes <= 0 or self.io_threads <= 0 or self.mapped_bytes <= 0:
            raise ValueError(f"SsdConfig: cache_bytes, io_threads and mapped_bytes must be positive, got "
                             f"{self.cache_bytes}, {self.io_threads} and {self.mapped_bytes}")
