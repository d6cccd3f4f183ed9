"""numba kernels of the SSD tier: batched record copies and the row cache's bookkeeping. Imported
lazily (:func:`hetero.storage.records.io_kernels`).

The gather kernel copies records out of the store's mapped segment files
(:mod:`hetero.storage.mapping`) with libc's ``memcpy``, or reads them with ``pread`` where a
segment is not mapped, called from compiled code with the GIL released: a batch of records is
one kernel call per I/O thread, no Python per record, and one read in flight per thread. It is compiled per
process (``cache=False``): a ctypes function pointer is an address of this process. The cache
kernels are one pass over a batch's rows each (a direct row -> slot index; CLOCK or GCLOCK victim
selection, Smith 1978 / Effelsberg & Haerder 1984).
"""

import ctypes

import numpy as np
from numba import njit, prange

from hetero._intrinsics import prefetch, prefetch_address

_libc = ctypes.CDLL(None)
_memcpy = _libc.memcpy
_memcpy.restype = ctypes.c_void_p
_memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_pread = _libc.pread
_pread.restype = ctypes.c_ssize_t
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]

EMPTY = -1  # a free slot's row; a miss's slot
# The row cache's index: one int32 a row of the store, its slot (the low SLOT_BITS; NOT_CACHED where it has none)
# and, for LFU, its sightings (the next bits, up to SEEN_MAX: W-TinyLFU's frequency, in no memory of its own).
SLOT_BITS = 28
NOT_CACHED = np.int32((1 << SLOT_BITS) - 1)
SEEN_MAX = 7
AHEAD = 8  # rows a pass prefetches ahead
GATHER_AHEAD = 16  # records the gather prefetches ahead (each two random accesses of ~140 bytes)
VICTIM_AHEAD = 32  # slots past each hand whose rows' index entries the victim pass prefetches: a victim's row is
# read (its sightings) and written (no slot) there, a random access (1.8 -> 1.4 ms a step of 54k misses, 26 x 200k rows)


@njit(nogil=True, cache=True, inline="always")
def _segment_of(slot, segment, shift):
    """The segment of store slot ``slot`` (>= 0): a shift where ``segment`` is a power of two (``shift`` >= 0;
    a 64-bit division by a number known only at run time takes tens of cycles: the relocation of 54k rows of
    5.2M, 1.40 -> 1.23 ms in a trained store, 1.56 -> 1.17 on synthetic slots; the gather, bound by its memory
    accesses, gained nothing), else a division (a store restored from a snapshot of another segment size)."""
    return slot >> shift if shift >= 0 else slot // segment


@njit(nogil=True, cache=False)
def gather(bases, fds, written, segment, slot_bytes, header, at, rows, dst, strides, widths, offsets, scratch, lo, hi):
    """For ``i`` in ``[lo, hi)``: the record in store slot ``at[i]`` (segment ``at[i] // segment``,
    ``written`` bytes of it written; the record ``header`` bytes into its slot of ``slot_bytes``)
    into row ``rows[i]`` of each destination ``k``: ``widths[k]`` bytes from record byte
    ``offsets[k]`` to address ``dst[k] + rows[i] * strides[k]``. A segment mapped at ``bases``
    is copied from; one not mapped (0) is read with ``pread`` from ``fds`` into ``scratch`` (a
    record's bytes) first. Returns the first position whose slot is not a written one or whose
    read failed (nothing copied for it), else ``hi``.

    A mapped record and its destination rows are prefetched ``GATHER_AHEAD`` positions ahead: each
    copy is a random access into the store (a page-cache page) and one into the destination (a row
    cache far larger than the CPU's caches), so copies one after the other wait for memory in turn."""
    nbytes = slot_bytes - header
    buf = np.int64(scratch.ctypes.data)
    for i in range(lo, hi):
        j = i + GATHER_AHEAD
        if j < hi:
            a = at[j]
            s = a // segment
            if 0 <= a and s < bases.shape[0] and bases[s] != 0:
                src = bases[s] + (a - s * segment) * slot_bytes + header
                for line in range(0, nbytes, 64):
                    prefetch_address(src + line)
                prefetch_address(src + nbytes - 1)
            r = rows[j]
            for k in range(dst.shape[0]):
                prefetch_address(dst[k] + r * strides[k])
                prefetch_address(dst[k] + r * strides[k] + widths[k] - 1)
        a = at[i]
        s = a // segment
        start = (a - s * segment) * slot_bytes
        if a < 0 or s >= bases.shape[0] or s >= fds.shape[0] or start + slot_bytes > written[s]:
            return i
        if bases[s] != 0:
            src = bases[s] + start + header
        else:
            if fds[s] < 0 or _pread(fds[s], buf, nbytes, start + header) != nbytes:
                return i
            src = buf
        r = rows[i]
        for k in range(dst.shape[0]):
            _memcpy(dst[k] + r * strides[k], src + offsets[k], widths[k])
    return hi


@njit(nogil=True, cache=False, parallel=True)
def gather_chunks(bases, fds, written, segment, slot_bytes, header, at, rows, dst, strides, widths, offsets, chunk):
    """:func:`gather` over the cores, in chunks of ``chunk`` positions: chunk ``c`` (positions ``[c * chunk, (c + 1)
    * chunk)``) on one core; returns each chunk's first failed position (or its end). For records in mapped segments:
    the cores of numba's pool take the chunks, where threads of a Python pool handing out the same chunks competed
    with the pool's cores and its spinning (same process, 57k records of 132 bytes from a 1 GB store in the page
    cache into a 520k-row cache: 1.6-1.9 ms this way on 2 cores, 5.3-7.4 through 16 Python threads, 3.8 on one)."""
    n = at.shape[0]
    nbytes = slot_bytes - header
    stops = np.empty(-(-n // chunk), np.int64)
    for c in prange(stops.shape[0]):
        scratch = np.empty(nbytes, np.uint8)  # (a record read with pread lands here first)
        lo = c * chunk
        stops[c] = gather(bases, fds, written, segment, slot_bytes, header, at, rows, dst, strides, widths, offsets,
                          scratch, lo, min(lo + chunk, n))
    return stops


@njit(nogil=True, cache=True, parallel=True)
def find(ids, index, meta, stamp, max_count, slots, counting):
    """The lookup half of :func:`acquire`, over the cores: ``slots[i]`` the slot of row ``ids[i]``
    (``index``: row -> slot and sightings, :data:`NOT_CACHED` where it has no slot; -1: a miss); a
    hit's slot is stamped and its count raised; with ``counting``, every row's sightings too
    (saturating at :data:`SEEN_MAX`). The rows are unique: no two threads touch one slot or one
    row."""
    pinned = stamp << 8
    n = ids.shape[0]
    for i in prange(n):
        if i + AHEAD < n:  # (a random access a row into an array larger than the caches)
            prefetch(index, ids[i + AHEAD])
        r = ids[i]
        v = index[r]
        s = v & NOT_CACHED
        if counting and (v >> SLOT_BITS) < SEEN_MAX:
            index[r] = v + (1 << SLOT_BITS)
        if s == NOT_CACHED:
            slots[i] = EMPTY
        else:
            slots[i] = s
            c = meta[s] & 255
            meta[s] = pinned | (c + 1 if c < max_count else c)


@njit(nogil=True, cache=True, parallel=True)
def age(index):
    """Halve every row's sightings in ``index`` (in place; TinyLFU's reset: old popularity fades)."""
    for r in prange(index.shape[0]):
        v = index[r]
        index[r] = ((v >> (SLOT_BITS + 1)) << SLOT_BITS) | (v & NOT_CACHED)


@njit(nogil=True, cache=True)
def acquire(ids, index, slot_row, meta, dirty, stamp, new_count, hands, window, slots, misses, victims, old_rows,
            was_dirty):
    """Slots for the unique rows ``ids``, whose hits :func:`find` filled in (``slots``; -1 a
    miss): misses get a slot (a free one, else a victim: the CLOCK hand passes slots, taking one
    whose count is 0 and that this batch does not use, decrementing the others; with a
    ``window``, a miss seen no more often than that victim takes a slot of the FIFO ring instead).
    ``index``: row -> slot (int32, :data:`NOT_CACHED` where not cached; the higher bits the row's
    sightings). ``meta[s]``: the acquire that last used slot ``s`` (``stamp``) shifted left by 8,
    and its count in the low 8 bits (one word). ``hands``: the main region's and the ring's hands
    (int64, updated). Fills ``slots`` (one per id), ``misses`` (positions in ``ids``), ``victims`` /
    ``old_rows`` / ``was_dirty`` (the slots given up, their rows, whether they hold an update the
    file lacks). The index and the slots' bookkeeping are updated; the data is not moved (the
    caller writes the dirty victims back, then reads the misses). Returns ``(misses, victims)``
    counts; misses -1 when a row was given twice or a miss found no slot (the index is then
    inconsistent: the caller stops).

    One serial pass over the misses: the index entries it changes (each miss's row, each victim's)
    are prefetched - the misses' ahead in the batch, the victims' ahead of the two hands, whose
    slots come in order - and written where the pass reads them. (They were written in a parallel
    pass after it, which read each entry again: 3.69 -> 2.44 ms for 54k misses, LFU, 2.98 against
    4.23 with LRU; 26 x 200k rows, 12 calls captured from a trained tier, caches flushed, every
    output the same.)

    The slots ``[0, M)`` (``M = capacity - window``) are the main region, passed by the CLOCK hand
    ``hands[0]`` (sequential memory); the last ``window`` slots are a FIFO ring, passed by
    ``hands[1]``. A miss takes the main region's next victim unless it was seen no more often
    than that victim's row (their sightings in ``index``): then it takes the ring's next slot this
    batch does not use, and the main region keeps its row, the next miss's victim (W-TinyLFU's
    admission, Einziger et al. 2017: the one-time rows of a skewed distribution pass through the
    ring without pushing out its frequent rows, and they land in consecutive slots). Either region
    takes over when the other has no slot this batch does not use."""
    capacity = slot_row.shape[0]
    main = capacity - window
    pinned = stamp << 8
    n_miss = 0
    for i in range(ids.shape[0]):
        if slots[i] == EMPTY:
            misses[n_miss] = i
            n_miss += 1
    hand, ring = hands[0], hands[1]
    main_full = main == 0  # a region found with every slot this batch's stays so for the batch (pins only grow)
    ring_full = window == 0
    n_victim = 0
    for j in range(n_miss):
        if j + AHEAD < n_miss:  # (the rows' index entries: random accesses, prefetched)
            prefetch(index, ids[misses[j + AHEAD]])
        if window:  # (the row of the ring's slot VICTIM_AHEAD past its hand, as for the main region's below)
            a = ring + VICTIM_AHEAD
            if a >= window:
                a %= window
            if slot_row[main + a] != EMPTY:
                prefetch(index, slot_row[main + a])
        i = misses[j]
        s = EMPTY
        passed = 0  # consecutive slots of this batch's passed: once the whole main region, it has none to give
        while not main_full:  # (a slot with a count is taken within 16 passes of the hand)
            c = hand
            # (the row of the slot VICTIM_AHEAD past the hand: its index entry is read if it is the victim)
            a = c + VICTIM_AHEAD
            if a >= main:
                a %= main  # (a main region smaller than the distance wraps more than once)
            if slot_row[a] != EMPTY:
                prefetch(index, slot_row[a])
            hand = hand + 1 if hand + 1 < main else 0
            if slot_row[c] == EMPTY:
                s = c
                break
            m = meta[c]
            if (m >> 8) == stamp:
                passed += 1
                main_full = passed >= main
                continue
            passed = 0
            if (m & 255) > 0:
                meta[c] = m - 1
                continue
            s = c
            break
        if not ring_full and (s == EMPTY or (slot_row[s] != EMPTY and
                                                  (index[ids[i]] >> SLOT_BITS) <= (index[slot_row[s]] >> SLOT_BITS))):
            if s != EMPTY:
                hand = s  # (the victim stays the next miss's: the hand does not sweep on for a refused row)
            ring_full = True
            for _ in range(window):  # the ring's next slot this batch does not use, if any
                c = main + ring
                ring = ring + 1 if ring + 1 < window else 0
                if slot_row[c] == EMPTY or (meta[c] >> 8) != stamp:
                    s = c
                    ring_full = False
                    break
        if s == EMPTY:  # (every slot is this batch's: the caller's check that a batch fits did not hold)
            hands[0], hands[1] = hand, ring
            return -1, n_victim
        r = ids[i]
        v = index[r]
        if (v & NOT_CACHED) != NOT_CACHED:  # (an earlier miss of this batch took this row: a row given twice)
            hands[0], hands[1] = hand, ring
            return -1, n_victim
        if slot_row[s] != EMPTY:
            old = slot_row[s]
            index[old] |= NOT_CACHED
            victims[n_victim], old_rows[n_victim], was_dirty[n_victim] = s, old, dirty[s]
            n_victim += 1
        index[r] = (v & ~NOT_CACHED) | s
        slots[i] = s
        slot_row[s] = ids[i]
        meta[s] = pinned | new_count
        dirty[s] = False
    hands[0], hands[1] = hand, ring
    return n_miss, n_victim


@njit(nogil=True, cache=True, parallel=True)
def take(values, rows):
    """``values[rows]`` (1-D; ``rows`` int64, in range) over the cores, each entry prefetched ``AHEAD`` rows
    ahead: a random access a row into an array larger than the caches (the store's row positions: 0.88 ->
    0.36 ms for 54k rows of 5.2M, against numpy's indexing on one core, caches flushed)."""
    n = rows.shape[0]
    out = np.empty(n, values.dtype)
    for i in prange(n):
        if i + AHEAD < n:
            prefetch(values, rows[i + AHEAD])
        out[i] = values[rows[i]]
    return out


@njit(nogil=True, cache=True, parallel=True)
def unpack(records, slots, fields, offsets):
    """Record ``i`` into slot ``slots[i]`` of the cache's fields (each ``(capacity, bytes)``
    uint8; field ``k`` at record byte ``offsets[k]``); the slots prefetched ``AHEAD`` ahead."""
    n = slots.shape[0]
    for i in prange(n):
        if i + AHEAD < n:
            for k in range(len(fields)):
                prefetch(fields[k], slots[i + AHEAD])
        s = slots[i]
        for k in range(len(fields)):
            f = fields[k]
            f[s, :] = records[i, offsets[k] : offsets[k] + f.shape[1]]


@njit(nogil=True, cache=True, parallel=True)
def pack(records, slots, fields, offsets, headers):
    """The reverse of :func:`unpack`, over the cores (the write-back of evicted rows: a random read
    of the cache a row, prefetched ``AHEAD`` ahead), each record after its slot's header: ``records``
    ``(n, header + record bytes)``, ``headers`` ``(n, header)`` uint8 (the rows' bytes), record byte 0
    at ``records[i, header]`` (in the same pass: numpy's strided copy of the headers alone took 1.2 ms
    a step of 57k write-backs, the pack 0.8)."""
    n = slots.shape[0]
    h = headers.shape[1]
    for i in prange(n):
        if i + AHEAD < n:
            for k in range(len(fields)):
                prefetch(fields[k], slots[i + AHEAD])
        records[i, :h] = headers[i, :]
        s = slots[i]
        for k in range(len(fields)):
            f = fields[k]
            records[i, h + offsets[k] : h + offsets[k] + f.shape[1]] = f[s, :]


@njit(nogil=True, cache=True, parallel=True)
def relocate(rows, positions, live, live_bits, segment, shift, first):
    """The unique rows ``rows`` now in store slots ``first, first + 1, ...``: each one's previous slot
    (``positions[row]``, -1: none) leaves its segment's ``live`` count (segments of ``segment`` slots, ``shift``:
    :func:`_segment_of`) and the live slots' bits
    (``live_bits``, bit ``slot % 8`` of byte ``slot // 8``), and ``positions`` points at the new
    slot, whose bit is set.

    The row index (8 bytes a row: a random access a row into the largest array) over the cores,
    prefetched; the counts and bits (a bit a slot, small enough for the caches) in one serial pass
    after it, since two old slots may share a byte: 1.0-1.1 ms for 48k rows of 5.2M on 2 cores, against
    3.5-3.9 ms in one serial pass (session 35, alternating in one process)."""
    n = rows.shape[0]
    old = np.empty(n, np.int64)
    for i in prange(n):  # (distinct rows: no two iterations touch one position)
        if i + AHEAD < n:
            prefetch(positions, rows[i + AHEAD])
        r = rows[i]
        old[i] = positions[r]
        positions[r] = first + i
    for i in range(n):
        o = old[i]
        if o >= 0:
            live[_segment_of(o, segment, shift)] -= 1
            live_bits[o >> 3] &= np.uint8(255 ^ (1 << (o & 7)))
        new = first + i
        live_bits[new >> 3] |= np.uint8(1 << (new & 7))


@njit(nogil=True, cache=True, parallel=True)
def take_slots(slots, keep, out):
    """``out[i] = slots[keep[i]]`` for each ``i`` (whole slots: ``(n, slot_bytes)`` uint8), over the cores:
    the live slots the cleaner moves (0.3-0.7 ms for 32k slots of 140 bytes on 2 cores, against 1.7 ms
    with ``np.take``, session 35)."""
    for i in prange(keep.shape[0]):
        out[i, :] = slots[keep[i], :]


def _bit_table():
    """For each byte value: its set bits' positions (``(256, 8)``, in order, then zeros) and how many."""
    positions, counts = np.zeros((256, 8), np.int64), np.zeros(256, np.int64)
    for b in range(256):
        bits = [i for i in range(8) if b >> i & 1]
        positions[b, : len(bits)], counts[b] = bits, len(bits)
    return positions, counts


_BIT_POSITIONS, _BIT_COUNTS = _bit_table()


@njit(nogil=True, cache=True)
def live_slots(live_bits, first, count):
    """Positions ``i`` in ``[0, count)`` of the live slots ``first + i`` (their bits set): a
    sequential scan of ``count / 8`` bytes. (Reading each slot's row and checking where its
    position points - a random access into the row index per slot - took 7 ms a segment of
    65,536 slots, about a fifth of the tier's step at 26 x 200k rows in a long run, session 30.)
    A byte at a time, without a branch per slot: its set bits' positions from a table of the 256
    byte values, all eight written and the count moved on by its bits (a test a slot, taken at
    random for a segment half live, took 0.67 ms a segment; this about 0.03)."""
    keep = np.empty(count + 16, np.int64)
    n = 0
    i = 0
    while i < count and (first + i) & 7:  # (to the first whole byte)
        s = first + i
        if live_bits[s >> 3] & (1 << (s & 7)):
            keep[n] = i
            n += 1
        i += 1
    while i + 8 <= count:
        b = live_bits[(first + i) >> 3]
        for k in range(8):
            keep[n + k] = i + _BIT_POSITIONS[b, k]
        n += _BIT_COUNTS[b]
        i += 8
    while i < count:
        s = first + i
        if live_bits[s >> 3] & (1 << (s & 7)):
            keep[n] = i
            n += 1
        i += 1
    return keep[:n]
