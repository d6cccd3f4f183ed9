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
        io_threads: reads (and writes) in flight per batch.
    """

    directory: Path
    cache_bytes: int = 256 << 20
    policy: CachePolicy = CachePolicy.LFU
    io_threads: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        if self.cache_bytes <= 0 or self.io_threads <= 0:
            raise ValueError(f"SsdConfig: cache_bytes and io_threads must be positive, got {self.cache_bytes} and "
                             f"{self.io_threads}")
