"""What ``hetero.explain`` says of the tables on the SSD tier (:class:`TierReport`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hetero.storage.cache import CachePolicy, CacheStats


@dataclasses.dataclass(frozen=True)
class TierGroup:
    """One table group on the SSD tier.

    Attributes:
        record_bytes, cache_rows, file_bytes, stats: ``None`` until the group's sparse optimizer
            laid its rows out (the record's size is the optimizer's).
    """

    tables: tuple[str, ...]
    directory: Path
    rows: int
    cache_bytes: int
    policy: CachePolicy
    record_bytes: int | None = None
    cache_rows: int | None = None
    file_bytes: int | None = None
    stats: CacheStats | None = None


@dataclasses.dataclass(frozen=True)
class TierReport:
    """The SSD tier's table groups: where, how large their caches, and their hit rates so far."""

    groups: tuple[TierGroup, ...]

    def __str__(self) -> str:
        lines = ["SSD tier:"]
        for g in self.groups:
            cache = f"{g.cache_rows} rows of {g.record_bytes} bytes" if g.cache_rows is not None else \
                "rows laid out by the sparse optimizer"
            line = f"  {', '.join(g.tables)}: {g.rows} rows in {g.directory}; cache {_mb(g.cache_bytes)} ({cache}, " \
                   f"{g.policy.value})"
            if g.file_bytes is not None:
                line += f"; file {_mb(g.file_bytes)}"
            seen = g.stats.hits + g.stats.misses if g.stats is not None else 0
            if seen:
                line += f"; hit rate {g.stats.hit_rate:.1%} of {seen} rows looked up so far"
            else:
                line += "; hit rate measured as it runs (benchmarks/ssd_tier.py, a 10% cache: 26-27% of a batch's " \
                        "unique rows on Zipf(1.05) ids, 10% on uniform ids)"
            lines.append(line)
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
