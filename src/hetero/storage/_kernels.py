"""numba kernels of the SSD tier: batched record I/O and the row cache's bookkeeping. Imported
lazily (:func:`hetero.storage.records.io_kernels`).

The read kernel calls libc's ``pread`` from compiled code with the GIL released: a batch of
record reads is one kernel call per I/O thread, no Python per row, and the threads keep as many
reads in flight as there are threads. It is compiled per process (``cache=False``): a ctypes
function pointer is an address of this process. The cache kernels are one pass over a
batch's rows each (open-addressing row -> slot map with backward-shift deletion; CLOCK or GCLOCK
victim selection, Smith 1978 / Effelsberg & Haerder 1984).
"""

import ctypes

import numpy as np
from numba import njit

_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
_pread.restype = ctypes.c_ssize_t
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]

EMPTY = -1  # a free key of the map, a free slot's row


@njit(nogil=True, cache=False)
def read_records(fds, offsets, nbytes, buf, lo, hi):
    """Read ``nbytes`` at byte ``offsets[i]`` of file descriptor ``fds[i]`` into row ``i`` of
    ``buf`` (``(n, nbytes)`` uint8), for ``i`` in ``[lo, hi)``. Returns the first position that
    failed (a short read or an error), else ``hi``."""
    base = buf.ctypes.data
    for i in range(lo, hi):
        if _pread(fds[i], base + i * nbytes, nbytes, offsets[i]) != nbytes:
            return i
    return hi


@njit(nogil=True, cache=True, inline="always")
def _home(key, mask):
    return np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(20)) & mask


@njit(nogil=True, cache=True)
def _insert(keys, vals, key, val):
    """Map ``key`` to ``val``; ``False`` (nothing changed) when ``key`` is there already."""
    mask = keys.shape[0] - 1
    h = _home(key, mask)
    while keys[h] != EMPTY:
        if keys[h] == key:
            return False
        h = (h + 1) & mask
    keys[h] = key
    vals[h] = val
    return True


@njit(nogil=True, cache=True)
def _remove(keys, vals, key):
    mask = keys.shape[0] - 1
    h = _home(key, mask)
    while keys[h] != key:
        h = (h + 1) & mask
    keys[h] = EMPTY
    j = h
    while True:  # backward shift: keep every key reachable from its home without tombstones
        j = (j + 1) & mask
        if keys[j] == EMPTY:
            return
        home = _home(keys[j], mask)
        if (j > h and (home <= h or home > j)) or (j < h and home <= h and home > j):
            keys[h], vals[h] = keys[j], vals[j]
            keys[j] = EMPTY
            h = j


@njit(nogil=True, cache=True)
def acquire(ids, keys, vals, slot_row, count, pin, dirty, stamp, max_count, new_count, hand, slots, misses, victims, old_rows,
            was_dirty):
    """Slots for the unique rows ``ids``: hits are found, misses get a slot (a free one, else a
    victim: the CLOCK hand passes slots, taking one whose count is 0 and that this batch does not
    use, decrementing the others). Fills ``slots`` (one per id), ``misses`` (positions in ``ids``),
    ``victims`` / ``old_rows`` / ``was_dirty`` (the slots given up, their rows, whether they hold
    an update the file lacks). The map and the slots' bookkeeping are updated; the data is not
    moved (the caller writes the dirty victims back, then reads the misses). Returns
    ``(misses, victims, hand)`` counts and the new hand; misses -1 when a row was given twice
    (the map is then inconsistent: the caller stops)."""
    mask = keys.shape[0] - 1
    capacity = slot_row.shape[0]
    n_miss = 0
    for i in range(ids.shape[0]):
        key = ids[i]
        h = _home(key, mask)
        s = EMPTY
        while keys[h] != EMPTY:
            if keys[h] == key:
                s = vals[h]
                break
            h = (h + 1) & mask
        if s == EMPTY:
            misses[n_miss] = i
            n_miss += 1
        else:
            slots[i] = s
            pin[s] = stamp
            if count[s] < max_count:
                count[s] += 1
    n_victim = 0
    for j in range(n_miss):
        while True:  # terminates: the caller checked that a batch fits, so unpinned slots exist
            s = hand
            hand = hand + 1 if hand + 1 < capacity else 0
            if slot_row[s] == EMPTY:
                break
            if pin[s] == stamp:
                continue
            if count[s] > 0:
                count[s] -= 1
                continue
            victims[n_victim], old_rows[n_victim], was_dirty[n_victim] = s, slot_row[s], dirty[s]
            n_victim += 1
            _remove(keys, vals, slot_row[s])
            break
        i = misses[j]
        slots[i] = s
        slot_row[s] = ids[i]
        count[s] = new_count
        pin[s] = stamp
        dirty[s] = False
        if not _insert(keys, vals, ids[i], s):  # a row given twice: the caller broke the contract (unique rows)
            return -1, n_victim, hand
    return n_miss, n_victim, hand


@njit(nogil=True, cache=True)
def lookup(ids, keys, vals, slots):
    """``slots[i]``: the slot of row ``ids[i]``, or -1 where it is not cached."""
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        key = ids[i]
        h = _home(key, mask)
        slots[i] = EMPTY
        while keys[h] != EMPTY:
            if keys[h] == key:
                slots[i] = vals[h]
                break
            h = (h + 1) & mask


@njit(nogil=True, cache=True)
def unpack(records, slots, fields, offsets):
    """Record ``i`` into slot ``slots[i]`` of the cache's fields (each ``(capacity, bytes)``
    uint8; field ``k`` at record byte ``offsets[k]``)."""
    for i in range(slots.shape[0]):
        s = slots[i]
        for k in range(len(fields)):
            f = fields[k]
            f[s, :] = records[i, offsets[k] : offsets[k] + f.shape[1]]


@njit(nogil=True, cache=True)
def pack(records, slots, fields, offsets):
    """The reverse of :func:`unpack`."""
    for i in range(slots.shape[0]):
        s = slots[i]
        for k in range(len(fields)):
            f = fields[k]
            records[i, offsets[k] : offsets[k] + f.shape[1]] = f[s, :]


@njit(nogil=True, cache=True)
def live_slots(segment, first, positions):
    """Positions in ``segment`` (file slots ``first ...``, each a row (int64 in its first 8 bytes)
    and a record) of the live slots: those their row's position points at."""
    keep = np.empty(segment.shape[0], np.int64)
    n = 0
    for i in range(segment.shape[0]):
        row = segment[i, :8].view(np.int64)[0]
        if row >= 0 and row < positions.shape[0] and positions[row] == first + i:
            keep[n] = i
            n += 1
    return keep[:n]
