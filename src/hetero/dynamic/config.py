"""Typed configuration of dynamic tables: :class:`Keys`, :class:`Eviction` and :class:`DynamicConfig`."""

from __future__ import annotations

import dataclasses
import enum
import math


class Keys(enum.Enum):
    """What a table's ids are."""

    FIXED = "fixed"  # row numbers ``0 <= id < num_embeddings`` (a fitted vocabulary, or hashed ids)
    DYNAMIC = "dynamic"  # raw int64 keys, each given a row of its own on admission (:mod:`hetero.dynamic`)


class Eviction(enum.Enum):
    """Which rows a full dynamic table gives up first for new keys."""

    LFU = "lfu"  # the fewest lookups since admission (ties: the least recently seen, then the lowest row)
    LRU = "lru"  # the least recently seen (ties: the lowest row)


@dataclasses.dataclass(frozen=True)
class DynamicConfig:
    """Admission and eviction of a dynamic table (``TableConfig(keys=Keys.DYNAMIC, dynamic=...)``).

    A key not in the table is counted on each training lookup (a count-min sketch, Cormode &
    Muthukrishnan 2005: ``sketch_width x 4`` int32 counters, ``16 * sketch_width`` bytes; a count can
    only be over-estimated, so a key may be admitted early, never late) and is admitted once seen
    ``admit_after`` times, or, with ``admit_probability``, on each sighting with that probability
    (drawn from a hash of the key and the step: reproducible). Until then its lookups read the
    shared default row (every value ``default_value``) and it gets no update.

    A full table (``num_embeddings`` rows, its capacity) evicts by ``eviction`` to admit new keys,
    ``evict_chunk`` rows at a time (one linear pass over the table's counts per chunk), never a
    row this step looked up. With ``ttl_steps``, every ``ttl_interval`` steps the rows unseen for
    more than ``ttl_steps`` steps are evicted, least recently seen first, but never below
    ``keep_floor`` rows. An evicted row's optimizer state is reset with it: the row is a new
    key's, as if never trained.

    With ``tinylfu``, once the table has fewer than ``evict_chunk`` rows free, a key it would admit
    must also *outrank* a row: its sketch count (sightings while it held no row) must exceed the
    use count of the least used of 16 rows sampled for it (from a hash of the key and the step)
    that this step has not looked up. This is TinyLFU's admission filter (Einziger, Friedman &
    Manes 2017, "TinyLFU: A Highly Efficient Cache Admission Policy", ACM TOS), against a sampled
    victim as in Redis's approximated LFU. A key seen once never outranks a row, so a stream of
    one-off keys does not evict the rows of returning ones, and the rows an eviction frees go to
    keys that earned them. Every sighting of a key without a row is then counted in the sketch.

    Attributes:
        admit_after: sightings before a key is admitted (1: on its first lookup).
        admit_probability: admit on each sighting with this probability instead (``None``: by count).
        eviction: the policy of a full table (:class:`Eviction`).
        evict_chunk: rows evicted at once when the table is full (``None``: 1/64 of the capacity,
            at least 1); the rows admitted that step are among them.
        ttl_steps: evict rows unseen for more than this many steps (``None``: never by age).
        ttl_interval: steps between the age scans (``None``: ``max(1, ttl_steps // 10)``).
        keep_floor: the age scan never takes the table below this many rows.
        default_value: every value of the default row (the lookup of a key with no row).
        sketch_width: counters per row of the admission sketch (4 rows).
        tinylfu: a table short of free rows admits only keys that outrank a row (above; by count only).

    Raises:
        ValueError: a value out of range, naming the field and the fix.
    """

    admit_after: int = 1
    admit_probability: float | None = None
    eviction: Eviction = Eviction.LFU
    evict_chunk: int | None = None
    ttl_steps: int | None = None
    ttl_interval: int | None = None
    keep_floor: int = 0
    default_value: float = 0.0
    sketch_width: int = 1 << 20
    tinylfu: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, got: object, want: str) -> None:
            raise ValueError(f"dynamic table: {field} = {got!r} is invalid; it must be {want}")

        if not isinstance(self.admit_after, int) or self.admit_after < 1:
            bad("admit_after", self.admit_after, "an integer >= 1 (1 admits a key on its first lookup)")
        if self.admit_probability is not None and not 0 < self.admit_probability <= 1:
            bad("admit_probability", self.admit_probability, "in (0, 1], or None to admit by count")
        if not isinstance(self.eviction, Eviction):
            bad("eviction", self.eviction, f"one of {[e.value for e in Eviction]}")
        if self.evict_chunk is not None and self.evict_chunk < 1:
            bad("evict_chunk", self.evict_chunk, ">= 1, or None for 1/64 of the capacity")
        if self.ttl_steps is not None and self.ttl_steps < 1:
            bad("ttl_steps", self.ttl_steps, ">= 1, or None to evict by capacity only")
        if self.ttl_interval is not None and (self.ttl_interval < 1 or self.ttl_steps is None):
            bad("ttl_interval", self.ttl_interval, ">= 1, and given only with ttl_steps")
        if self.keep_floor < 0:
            bad("keep_floor", self.keep_floor, ">= 0")
        if not math.isfinite(self.default_value):
            bad("default_value", self.default_value, "a finite number")
        if self.tinylfu and self.admit_probability is not None:
            bad("tinylfu", self.tinylfu, "False with admit_probability (it compares sketch counts, which admission "
                "by probability does not keep); admit by count (admit_probability = None)")
        if self.sketch_width < 64 or self.sketch_width & (self.sketch_width - 1):
            bad("sketch_width", self.sketch_width, "a power of two >= 64")

    def share(self, rows: int, capacity: int) -> "DynamicConfig":
        """The settings of a part of a table of ``capacity`` rows that holds ``rows`` of them (a
        rank's span, a parameter server's shard): ``keep_floor`` in proportion, ``evict_chunk``
        capped at the part."""
        chunk = None if self.evict_chunk is None or not rows else min(self.evict_chunk, rows)
        return dataclasses.replace(self, keep_floor=self.keep_floor * rows // capacity, evict_chunk=chunk)

    def check(self, table: str, capacity: int) -> None:
        """The settings that depend on the table's capacity.

        Raises:
            ValueError: ``keep_floor`` or ``evict_chunk`` above the capacity.
        """
        if self.keep_floor > capacity:
            raise ValueError(f"table {table!r}: keep_floor = {self.keep_floor} exceeds the table's capacity "
                             f"(num_embeddings = {capacity}); lower it or raise the capacity")
        if self.evict_chunk is not None and self.evict_chunk > capacity:
            raise ValueError(f"table {table!r}: evict_chunk = {self.evict_chunk} exceeds the table's capacity "
                             f"(num_embeddings = {capacity}); lower it")

    def chunk(self, capacity: int) -> int:
        """Rows evicted at once when the table is full."""
        return self.evict_chunk if self.evict_chunk is not None else max(1, capacity // 64)

    def interval(self) -> int:
        """Steps between the age scans (with ``ttl_steps``)."""
        assert self.ttl_steps is not None
        return self.ttl_interval if self.ttl_interval is not None else max(1, self.ttl_steps // 10)
