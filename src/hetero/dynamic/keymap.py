"""The key -> row map of a dynamic table: admission, eviction and their counts (:class:`KeyMap`).

A dynamic table (``TableConfig(keys=Keys.DYNAMIC)``) is looked up by raw int64 keys. Its
``capacity`` rows are given to keys as they are admitted and taken back as they are evicted; row
``capacity`` is the default row every key without a row reads. The map's work for a batch is one
compiled pass over its keys (:mod:`hetero.dynamic._kernels`), no Python per key.

Memory per row of capacity: the map's slots (16 bytes each, 2 to 4 slots a row), the row's key
(8), use count (4) and last step (4), and a free-list entry (8): 56 to 88 bytes; plus the
admission sketch's ``16 * sketch_width`` bytes when ``admit_after > 1`` or ``tinylfu``.
"""

from __future__ import annotations

import dataclasses
import threading
from types import ModuleType

import numpy as np

from hetero._numba import load
from hetero.dynamic.config import DynamicConfig, Eviction


def _kernels() -> ModuleType:
    return load("hetero.dynamic._kernels")


@dataclasses.dataclass
class DynamicStats:
    """Counts of a dynamic table since it was built (or restored).

    Attributes:
        admitted: keys given a row.
        evicted: rows taken back (at capacity, or by age).
        default_lookups: training lookups of keys without a row (not yet admitted, or refused:
            a full table whose rows were all looked up in the step); they read the default row.
        rows: rows held now.
    """

    admitted: int = 0
    evicted: int = 0
    default_lookups: int = 0
    rows: int = 0


@dataclasses.dataclass
class Assignment:
    """What one training lookup changed in the map: the rows given to new keys (their values and
    optimizer state must start afresh) and how many rows were evicted.

    Attributes:
        rows: ``(A,)`` int64 table rows given to ``keys`` (``(A,)`` int64).
        evicted: rows taken back from their keys.
    """

    rows: np.ndarray
    keys: np.ndarray
    evicted: int


class KeyMap:
    """The rows of one dynamic table's keys.

    Args:
        name: the table's name (error messages).
        capacity: rows for keys (the table's ``num_embeddings``); row ``capacity`` is the default row.
        config: admission and eviction (:class:`DynamicConfig`).
        seed: seeds the admission draws (``admit_probability``).

    Thread contract: :meth:`translate` and :meth:`lookup` may be called from any thread; a lock
    serialises them.
    """

    def __init__(self, name: str, capacity: int, config: DynamicConfig, seed: int = 0) -> None:
        config.check(name, capacity)
        self.name, self.capacity, self.config, self.seed = name, capacity, config, seed
        slots = 64
        while slots < 2 * capacity:
            slots *= 2
        # np.full, not np.zeros: every page written now, so the resident set holds the map whole from the
        # start (np.zeros takes untouched pages from calloc, which became resident one by one as new keys
        # hashed onto them - 26 MiB of sketches crept into a server's resident set over an epoch, and a host
        # short of memory would fail mid-run rather than at the start)
        self.slots = np.full((slots, 2), 0, np.int64)  # (key, row); row -1: empty
        self.slots[:, 1] = -1
        self.row_key = np.full(capacity, 0, np.int64)
        self.stat = np.full((capacity, 2), 0, np.int32)  # (use count, last step); last -1: a free row
        self.stat[:, 1] = -1
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # (a stack: row 0 is given first)
        self.nfree = np.array([capacity], np.int64)
        by_count = config.admit_probability is None and (config.admit_after > 1 or config.tinylfu)
        self.sketch = np.full((4, config.sketch_width if by_count else 64), 0, np.int32)
        self.stats = DynamicStats()
        self.next_scan = 0  # the step of the next age scan (ttl_steps)
        self.lock = threading.Lock()

    @property
    def default_row(self) -> int:
        return self.capacity

    @property
    def nbytes(self) -> int:
        """Host memory the map holds for its rows, bytes: its slots, the rows' keys and counts and the
        free list (in proportion to ``capacity``); the admission sketch's is ``sketch.nbytes``."""
        return sum(a.nbytes for a in (self.slots, self.row_key, self.stat, self.free))

    @property
    def size(self) -> int:
        """Rows held now."""
        return self.capacity - int(self.nfree[0])

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` (int64) without changing anything (evaluation, prediction): ``(N,)`` int64,
        the default row for a key without one."""
        out = np.empty(keys.shape[0], np.int64)
        with self.lock:
            _kernels().lookup(keys, out, self.slots, self.default_row)
        return out

    def translate(self, keys: np.ndarray, step: int) -> tuple[np.ndarray, Assignment]:
        """Rows of a training lookup's ``keys`` (int64) at optimizer step ``step``: counts them,
        admits and evicts (:class:`DynamicConfig`). A row looked up at ``step`` is not evicted
        before the step's update (lookups of one step share its number).

        Returns:
            ``(N,)`` int64 rows (the default row for a key without one), and the
            :class:`Assignment` of new keys' rows and evicted keys.
        """
        c, n = self.config, keys.shape[0]
        K = _kernels()
        out = np.empty(n, np.int64)
        chunk = c.chunk(self.capacity)
        with self.lock:
            evicted = np.zeros(1, np.int64)
            if c.ttl_steps is not None and step >= self.next_scan:
                room = self.size - c.keep_floor
                K.evict(room, step - c.ttl_steps, False, self.slots, self.row_key, self.stat, self.free, self.nfree,
                        evicted)
                self.next_scan = step + c.interval()
            admitted = np.empty((1 + min(n, self.capacity), 2), np.int64)
            admitted[0, 0] = 0  # (the count; the pairs follow)
            stats = np.zeros(3, np.int64)
            below = 0 if c.admit_probability is None else min(int(c.admit_probability * 2.0**64), 2**64 - 1)
            K.translate(keys, out, self.slots, self.row_key, self.stat, self.sketch, self.free, self.nfree, np.int32(step), c.admit_after, np.uint64(below),
                        np.uint64(self.seed), c.eviction is Eviction.LFU, chunk, self.default_row, admitted, evicted,
                        stats, c.tinylfu)
            self.stats.admitted += int(stats[0])
            self.stats.evicted += int(evicted[0])
            self.stats.default_lookups += int(stats[2])
            self.stats.rows = self.size
        a = int(admitted[0, 0])
        return out, Assignment(admitted[1 : a + 1, 0].copy(), admitted[1 : a + 1, 1].copy(), int(evicted[0]))

    def keys(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows held and their keys, ``(rows, keys)``, int64, in row order."""
        rows = np.flatnonzero(self.stat[:, 1] >= 0)
        return rows, self.row_key[rows]

    STATE = ("row_key", "row_count", "row_last", "sketch", "next_scan", "stats")

    def state_dict(self, copy: bool = True) -> dict[str, np.ndarray]:
        """What restores this map (:attr:`STATE`, arrays; copies, or with ``copy=False`` views that
        later lookups change): each row's key, use count and last step (-1: free), the admission
        sketch, the next age scan and the counts."""
        keep = np.copy if copy else np.asarray
        return {"row_key": keep(self.row_key), "row_count": keep(self.stat[:, 0]), "row_last": keep(self.stat[:, 1]),
                "sketch": keep(self.sketch), "next_scan": np.array(self.next_scan, np.int64),
                "stats": np.array(dataclasses.astuple(self.stats), np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict` (the map's slots are rebuilt from the rows' keys).

        Raises:
            ValueError: another capacity or sketch size, naming both.
        """
        if state["row_key"].shape != self.row_key.shape or state["sketch"].shape != self.sketch.shape:
            raise ValueError(f"dynamic table {self.name!r}: the checkpoint's key map has {state['row_key'].shape[0]} "
                             f"rows and a sketch of {state['sketch'].shape}, this table {self.capacity} and "
                             f"{self.sketch.shape}; build the table with the checkpoint's capacity and DynamicConfig")
        with self.lock:
            self.row_key[:] = state["row_key"]
            self.stat[:, 0] = state["row_count"]
            self.stat[:, 1] = state["row_last"]
            self.sketch[:] = state["sketch"]
            self.next_scan = int(state["next_scan"])
            self.stats = DynamicStats(*(int(x) for x in state["stats"]))
            held = self.stat[:, 1] >= 0
            free = np.flatnonzero(~held)[::-1]
            self.free[: free.shape[0]] = free
            self.nfree[0] = free.shape[0]
            self.slots[:, 1] = -1
            rows = np.flatnonzero(held)
            _kernels().insert(self.row_key[rows], rows, self.slots)
            self.stats.rows = self.size  # (a row-sharded table's part: its own rows)

    def init_rows(self, keys: np.ndarray, dim: int, std: float) -> np.ndarray:
        """Initial values of new keys' rows, ``(len(keys), dim)`` float32: ``N(0, std**2)`` seeded by
        each key (zeros for ``std == 0``)."""
        out = np.zeros((keys.shape[0], dim), np.float32)
        if std > 0:
            load("hetero.dynamic._init_kernels").init_rows(keys, np.uint64(self.seed), std, out)
        return out
