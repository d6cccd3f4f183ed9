"""A DRAM cache of row records over a :class:`~hetero.storage.records.RowFile`: the SSD tier's
working set.

The cache holds ``capacity`` rows in one array per record field (the row, then each optimizer
state), each ``(capacity, D)`` or ``(capacity,)`` and laid out as an in-memory table of
``capacity`` rows: the embedding engine's gather, pooling and optimizer kernels run on them
unchanged, with cache slots for row indices. :meth:`RowCache.acquire` gives the slots of a batch's
unique rows and keeps them resident until the next call; misses are copied in from the file in
one batch (:meth:`RowFile.load`), the slots they take are chosen by the
replacement policy among the rows this batch does not use, and a victim holding an update the
file lacks is written back first (:meth:`RowFile.store`; write-back: no update is lost, none is
written twice). Rows move between file and cache as whole
records (row and state together), byte for byte, so training through the cache equals training
the table in memory exactly.

Replacement (:class:`CachePolicy`): CLOCK (second chance; an approximation of LRU) or GCLOCK
(hit counts, decremented as the hand passes; an approximation of LFU, which keeps the frequent
rows of a skewed id distribution; a new row starts on probation, count 0: the first to go unless
hit again) with W-TinyLFU's admission (Einziger, Friedman & Manes 2017, "TinyLFU: A Highly
Efficient Cache Admission Policy"): every row's sightings are counted (3 bits beside its slot in
the row -> slot index, so in no memory of their own; halved each time the lookups grow by ten
times the cache's rows, so old popularity fades), and a miss seen no more often than the GCLOCK
victim's row does not take its slot but one of a FIFO ring of ``capacity // 8`` slots.
``benchmarks/ssd_tier.py`` measures both policies.

Read-ahead (:meth:`RowCache.stage`): a prefetch worker reads the records of the next batch's
rows that are not cached, while the training thread goes on; :meth:`RowCache.acquire` then takes
a miss's record from them only if it is still the row's current one (:class:`StagedRecords`),
so a read-ahead row is never stale.

Thread contract: one thread at a time (the training thread), except :meth:`RowCache.stage`, which
may run on another thread at the same time.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import torch

from hetero.placement import host_empty
from hetero.storage.layout import StagedRecords, io_kernels
from hetero.storage.records import RowFile

FLUSH_CHUNK = 1 << 16  # slots written back per piece by flush()
LFU_MAX_COUNT = 15  # GCLOCK's ceiling: a row hit 15 times survives 15 passes of the hand
WINDOW_SHARE = 8  # LFU: 1/8 of the slots are the ring of rows refused admission (a batch's one-time rows fit)
AGING = 10  # LFU: the sightings are halved each time they grew by this many times the cache's rows (TinyLFU's reset)


class CachePolicy(enum.Enum):
    """How the row cache chooses the rows it gives up (see the module docstring)."""

    LRU = "lru"  # CLOCK
    LFU = "lfu"  # GCLOCK

    @property
    def max_count(self) -> int:
        return 1 if self is CachePolicy.LRU else LFU_MAX_COUNT

    @property
    def admission_count(self) -> int:
        """A new row's count: CLOCK's reference bit; for GCLOCK 0, on probation: a row seen once
        is the first to go, a row hit again has earned a place (the tail of a skewed
        distribution does not push out its head)."""
        return 1 if self is CachePolicy.LRU else 0

    def window(self, capacity: int) -> int:
        """Slots of the FIFO ring of rows refused admission (LFU; none for LRU)."""
        return 0 if self is CachePolicy.LRU else capacity // WINDOW_SHARE


@dataclasses.dataclass
class CacheStats:
    """Counts since the cache was built: rows found, rows read from disk (``staged`` of them
    ahead, by :meth:`RowCache.stage`), rows given up, and those of them written back (dirty)."""

    hits: int = 0
    misses: int = 0
    staged: int = 0
    evictions: int = 0
    write_backs: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


class RowCache:
    """``capacity`` rows of ``file``'s records in DRAM (see the module docstring).

    Attributes:
        fields: field name -> ``(capacity, width)`` or ``(capacity,)`` CPU tensor of the field's
            dtype; row ``s`` holds the record of the row in slot ``s``.

    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, file: RowFile, capacity: int, policy: CachePolicy = CachePolicy.LFU) -> None:
        if capacity < 1:
            raise ValueError(f"a row cache holds at least one row, got capacity {capacity}")
        self.file, self.capacity, self.policy = file, capacity, policy
        layout = file.layout
        self.fields: dict[str, torch.Tensor] = {f.name: host_empty(f.shape(capacity), f.dtype) for f in layout.fields}
        self._bytes = [(layout.offset(f.name), _bytes_view(self.fields[f.name], capacity)) for f in layout.fields]
        self._field_bytes = tuple(b for _, b in self._bytes)
        self._offsets = np.array([o for o, _ in self._bytes], np.int64)
        kernels = io_kernels()
        if capacity >= kernels.NOT_CACHED:
            raise ValueError(f"a row cache holds fewer than 2**{kernels.SLOT_BITS} - 1 rows, got capacity {capacity}")
        # row -> slot (NOT_CACHED: none) and the row's sightings (LFU), 4 bytes a row of the store (beside its
        # 8-byte position a row): one random access a lookup, none probing; smaller than a hash map of the cached
        # rows (32-64 bytes each) while the cache holds more than a tenth of the rows
        self._index = np.full(file.rows, kernels.NOT_CACHED, np.int32)
        self.slot_row = np.full(capacity, -1, np.int64)  # the row each slot holds (-1: free)
        self._meta = np.zeros(capacity, np.int64)  # the acquire that last used the slot << 8 | its count
        self.dirty = np.zeros(capacity, np.bool_)
        self._window = policy.window(capacity)  # (LFU: the ring of rows refused admission; its sightings counted)
        self._counted = 0  # sightings since the last halving
        self._stamp = 0
        self._hands = np.zeros(2, np.int64)  # the CLOCK hand of the main slots, the ring's
        self._last: tuple[np.ndarray, np.ndarray] | None = None
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        """DRAM the cached rows take (their fields), bytes."""
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    def stage(self, rows: np.ndarray) -> StagedRecords:
        """Read ahead the records of the unique ``rows`` (int64) that are not cached now; any
        thread, while the owner goes on (the index is read without a lock: a hint, since the owner
        may change it meanwhile - the records are checked when :meth:`acquire` uses them).

        Raises:
            OSError: a failed read (:class:`RowFile`).
        """
        none = io_kernels().NOT_CACHED
        return self.file.stage(rows[(self._index[rows] & none) == none])

    def acquire(self, rows: np.ndarray, used: bool = True, staged: StagedRecords | None = None) -> np.ndarray:
        """Slots (int64, one per row) of the unique rows ``rows`` (int64), each resident until the
        next call; misses are read from the file (or taken from ``staged``, :meth:`stage`, where
        its record is still current), dirty victims written back first. ``used``: count the rows
        in :attr:`stats` (a lookup; an update of rows just looked up is not).

        Raises:
            ValueError: more rows than the cache holds (the message names the size to give).
            OSError: a failed read or write (:class:`RowFile`).
        """
        n = rows.shape[0]
        last = self._last
        # The rows the last call gave slots to (a view of the same memory, which ``_last`` keeps alive, so
        # no other array can be there): still resident - the update of the rows a lookup just brought in.
        if last is not None and last[0].ctypes.data == rows.ctypes.data and last[0].shape == rows.shape and \
                last[0].strides == rows.strides and last[0].dtype == rows.dtype:
            return last[1]
        if n > self.capacity:
            raise ValueError(f"a batch touches {n} rows of {self.file.path.name} but its cache holds {self.capacity}: "
                             f"give the cache at least {n} rows ({n * self.file.layout.nbytes} bytes)")
        self._stamp += 1
        slots, misses = np.empty(n, np.int64), np.empty(n, np.int64)
        victims, old_rows, was_dirty = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.bool_)
        kernels = io_kernels()
        if self._window:
            self._counted += n
            if self._counted >= AGING * self.capacity:
                kernels.age(self._index)
                self._counted = 0
        # (the hits, and each row's sightings, on every core)
        kernels.find(rows, self._index, self._meta, self._stamp, self.policy.max_count, slots, self._window > 0)
        n_miss, n_victim = kernels.acquire(
            rows, self._index, self.slot_row, self._meta, self.dirty, self._stamp, self.policy.admission_count,
            self._hands, self._window, slots, misses, victims, old_rows, was_dirty)
        assert n_miss >= 0, "RowCache.acquire takes unique rows that fit (a row given twice, or a miss without a slot)"
        back = victims[:n_victim][was_dirty[:n_victim]]
        if back.shape[0]:  # their records are still in their slots: out to the file before the reads land
            self._write(old_rows[:n_victim][was_dirty[:n_victim]], back)
        if n_miss:
            miss = misses[:n_miss]
            self.stats.staged += self.file.load(rows[miss], slots[miss], self._field_bytes, self._offsets, staged)
        if used:
            self.stats.hits += n - n_miss
            self.stats.misses += n_miss
        self.stats.evictions += n_victim
        self.stats.write_backs += back.shape[0]
        self._last = (rows, slots)  # (a lookup's rows, asked again by the update of the same step)
        return slots

    def _write(self, rows: np.ndarray, slots: np.ndarray) -> None:
        self.file.store(rows, slots, self._field_bytes, self._offsets)

    def mark_dirty(self, slots: np.ndarray) -> None:
        """Note that the rows in ``slots`` were updated (written back when given up or flushed)."""
        self.dirty[slots] = True

    def flush(self) -> None:
        """Write every updated row back to the file (they stay cached, now clean); not yet durable
        (``file.seal()``)."""
        slots = np.flatnonzero(self.dirty).astype(np.int64)
        for lo in range(0, slots.shape[0], FLUSH_CHUNK):  # (in pieces: a whole cache's records at once would double it)
            part = slots[lo : lo + FLUSH_CHUNK]
            self._write(self.slot_row[part], part)
            self.dirty[part] = False

    def clear(self) -> None:
        """Forget every cached row (after :meth:`flush`: an update not yet written back is lost)."""
        assert not self.dirty.any(), "clear() after flush()"
        self._last = None
        np.bitwise_or(self._index, io_kernels().NOT_CACHED, out=self._index)  # (the sightings stay)
        self.slot_row.fill(-1)
        self._meta.fill(0)

    def read(self, rows: np.ndarray, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """The current values of ``rows`` (any int64 rows; the cache is left as it is): field name
        (``names``, default every field) -> ``(len(rows), width)`` or ``(len(rows),)`` tensor,
        from the cache where a row is cached, else from the file."""
        none = io_kernels().NOT_CACHED
        slots = (self._index[rows] & none).astype(np.int64)
        cached = slots != none
        fields = [f for f in self.file.layout.fields if names is None or f.name in names]
        out = {f.name: torch.empty(f.shape(rows.shape[0]), dtype=f.dtype) for f in fields}
        away = np.flatnonzero(~cached)
        if away.shape[0]:
            records = np.empty((away.shape[0], self.file.layout.nbytes), np.uint8)
            self.file.read(rows[away], records)
            for offset, field in ((self.file.layout.offset(f.name), f) for f in fields):
                bytes_ = records[:, offset : offset + field.nbytes].copy()
                out[field.name][torch.from_numpy(away)] = torch.from_numpy(bytes_).view(field.dtype).reshape(
                    field.shape(away.shape[0]))
        here = np.flatnonzero(cached)
        if here.shape[0]:
            for name in out:
                out[name][torch.from_numpy(here)] = self.fields[name][torch.from_numpy(slots[here])]
        return out


def _bytes_view(t: torch.Tensor, rows: int) -> np.ndarray:
    """``t`` as ``(rows, bytes per row)`` uint8, sharing its memory (bf16 through int16: numpy
    has no bf16)."""
    arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return arr.view(np.uint8).reshape(rows, -1)
