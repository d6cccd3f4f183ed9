"""Where a row-sharded dynamic table's keys live: :class:`KeySpans` (which rank owns a key) and
:func:`rehome` (the rows a checkpoint's keys take at another world size).

A row-sharded table group cuts its rows into one block per rank (``hetero.parallel.row_sharded``),
so rank ``r`` holds a span ``[starts[r], starts[r] + counts[r])`` of a dynamic table's rows (its
default row aside). A key is owned by the rank whose span holds the key's *home row*, a hash of
the key uniform over the table's rows, so each rank owns keys in proportion to the rows it holds.
The owner's own :class:`~hetero.dynamic.KeyMap` (capacity ``counts[r]``) admits, counts and evicts
its keys, giving them rows of its span only: a key's row and optimizer state are where its key is.
This is TorchRec's and dynamicemb's rule (keys hashed to ranks, each rank a table of its share),
with the share set by the rows each rank holds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hetero._numba import load


def home_rows(keys: np.ndarray, capacity: int) -> np.ndarray:
    """Each key's *home row* (``(K,)`` int64 of ``(K,)`` int64 keys): a hash of the key uniform over
    ``[0, capacity)``, which places the key on the rank (or parameter server) holding that row."""
    home = np.empty(keys.shape[0], np.int64)
    load("hetero.dynamic._kernels").home_rows(keys, capacity, home)
    return home


@dataclasses.dataclass(frozen=True)
class KeySpans:
    """The spans of one dynamic table's rows over the ranks.

    Attributes:
        capacity: the table's rows for keys (``num_embeddings``).
        starts: ``(N,)`` int64: rank ``r``'s first table row (its span may be empty).
        counts: ``(N,)`` int64: rank ``r``'s rows; they add up to ``capacity``.
    """

    capacity: int
    starts: np.ndarray
    counts: np.ndarray

    @classmethod
    def of_blocks(cls, capacity: int, first_row: int, blocks: list[tuple[int, int]]) -> "KeySpans":
        """The spans of a table whose rows start at group row ``first_row`` in a group cut into
        ``blocks`` (rank ``r`` holds group rows ``blocks[r] = (lo, hi)``, contiguous, in rank order)."""
        lo = np.array([min(max(a - first_row, 0), capacity) for a, _ in blocks], np.int64)
        hi = np.array([min(max(b - first_row, 0), capacity) for _, b in blocks], np.int64)
        return cls(capacity, lo, hi - lo)

    def owner(self, keys: np.ndarray) -> np.ndarray:
        """The rank owning each of ``keys`` (``(K,)`` int64): ``(K,)`` int64."""
        home = home_rows(keys, self.capacity)
        # the last rank whose span starts at or before the row: an empty span is never it
        return np.searchsorted(self.starts, home, side="right") - 1

    def rank_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The rank holding each table row of ``rows``."""
        return np.searchsorted(self.starts, rows, side="right") - 1


@dataclasses.dataclass
class Rehomed:
    """The rows of a checkpoint's keys at the present spans (:func:`rehome`).

    Attributes:
        source: ``(capacity,)`` int64: table row ``i`` takes the checkpoint's row ``source[i]``
            (its value, state, key and counts), or is free (-1).
        dropped: keys that found no row at their owner (its span full): evicted, least used first.
    """

    source: np.ndarray
    dropped: int

    @property
    def identity(self) -> bool:
        """Whether every key keeps its row (the checkpoint was saved at these spans)."""
        held = self.source >= 0
        return not self.dropped and bool((self.source[held] == np.flatnonzero(held)).all())


def rehome(spans: KeySpans, row_key: np.ndarray, row_count: np.ndarray, row_last: np.ndarray) -> Rehomed:
    """The rows each held key of a checkpointed table (its ``(capacity,)`` rows' keys, use counts and
    last steps, -1: free) takes at ``spans``: a key whose row lies in its owner's span keeps it (at
    the world size it was saved at, every key: nothing moves); the others take the owner's free
    rows in the order of their old rows. Where an owner has fewer free rows than keys to take in,
    the least used of those keys are dropped (ties: the least recently seen, then the larger key),
    as its eviction would choose.

    A pure function of its arguments: every rank computes the same result alone.
    """
    held = np.flatnonzero(row_last >= 0)
    owner = spans.owner(row_key[held])
    stays = owner == spans.rank_of_rows(held)
    source = np.full(spans.capacity, -1, np.int64)
    source[held[stays]] = held[stays]
    dropped = 0
    for r in range(spans.starts.shape[0]):
        movers = held[~stays & (owner == r)]
        if not movers.shape[0]:
            continue
        lo = int(spans.starts[r])
        free = lo + np.flatnonzero(source[lo : lo + int(spans.counts[r])] < 0)
        if movers.shape[0] > free.shape[0]:  # keep the most used: sorted by (count, last, -key), descending
            rank = np.lexsort((-row_key[movers], row_last[movers], row_count[movers]))[::-1]
            dropped += movers.shape[0] - free.shape[0]
            movers = np.sort(movers[rank[: free.shape[0]]])
        source[free[: movers.shape[0]]] = movers
    return Rehomed(source, dropped)


@dataclasses.dataclass
class KeyShard:
    """A row-sharded dynamic table's part on this rank (``HostEmbedding.key_shard``).

    Attributes:
        spans: every rank's span of the table's rows.
        rehomed: a loaded checkpoint's :attr:`Rehomed.source`, until the optimizer state has moved
            with its keys (``None``: nothing moved).
        sketch_base: the admission sketch as loaded (every rank's sum), which each rank counts on
            from: the whole table's sketch is then ``base + sum(rank's - base)`` (``None``: zeros).
    """

    spans: KeySpans
    rehomed: np.ndarray | None = None
    sketch_base: np.ndarray | None = None


def merged_counts(parts: list[dict[str, np.ndarray]], base: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The map-wide entries of a table's parts' key maps (``sketch``, ``stats``, ``next_scan`` of each
    part's ``KeyMap.state_dict``), merged as one map of every key would hold them: the admission
    sketches summed (a count-min sketch is linear; over their common loaded ``base``, counted once;
    saturating at int32's top, as the counters do), the counts summed, the latest next age scan."""
    sketch = np.zeros(parts[0]["sketch"].shape, np.int64)
    for p in parts:
        sketch += p["sketch"].astype(np.int64)
    if base is not None:
        sketch -= (len(parts) - 1) * base.astype(np.int64)
    return {"sketch": np.minimum(sketch, 2**31 - 1).astype(parts[0]["sketch"].dtype),
            "stats": np.sum([p["stats"] for p in parts], axis=0).astype(np.int64),
            "next_scan": np.array(max(int(p["next_scan"]) for p in parts), np.int64)}
