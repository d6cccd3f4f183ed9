"""numba kernels of the embedding engine's dedup and of the prefetch read-after-write check.
Imported lazily by :mod:`hetero.embedding.kernels` (:func:`dedup_kernels`).

Two ways to dedup, the same ``inverse`` and occurrence chains, the unique rows in another order:

* **a marker**, one int64 a row of the group (``stamp << 32 | index``): one random access per id,
  the unique rows in first-occurrence order, so the update reads the per-id gradient in order;
* **a sort** (empty marker): a least-significant-digit radix sort of ``row << 32 | position``
  words (one int64 an id), as few passes as digits of at most ``MAX_DIGIT_BITS`` bits cover the
  largest row; the unique rows ascending (as ``torch.unique`` gives them), so the update walks the
  table and its state in address order, and reads the per-id gradient out of order.

Which one pays depends on the group's size (``hetero.embedding.group.SORTED_DEDUP_BYTES``). The
row-wise Adagrad update of 106k uniform ids, one table, in one process on 2 cores (2026-11-29),
ascending against first-occurrence order: 1M rows 5.0 against 3.7 ms, 8M 4.2 against 3.7, 16M 4.2
against 4.9, 26M 6.0 against 10.8; 26 tables of 1M rows in one group (each table's ids together in
the batch, so a table's gradient rows are near each other) 3.8 against 5.7. The sort costs 0.4-0.7
ms more than the marker's pass (serial, 106k ids) and needs no marker (8 bytes a row).

* :func:`dedup`, serial, also builds each row's occurrence chain (the sort is stable, so a row's
  positions come out increasing), which the host pooling's backward hands the optimizer (it sums a
  row's gradient by walking the chain, in occurrence order);
* :func:`dedup_unique`, parallel, without chains, for lookups whose gradient arrives coalesced per
  unique row (the device pooling's backward; on a host that feeds a GPU the serial dedup was most
  of the training thread's lookup: 2.0-2.9 ms of 106k ids on the H200 host's 16 cores);
* :func:`sorted_unique`, serial, a sort without chains (row-sharded groups, the SSD tier).

Rows or positions of ``2**31`` or more do not pack into a word: those sorts use numpy's stable
``argsort`` instead (the same result, slower).

All kernels release the GIL (``nogil``) and issue software prefetches ahead of their random
accesses, as in :mod:`hetero.embedding._numba_kernels`.
"""

import numpy as np
from numba import njit, prange

from hetero._intrinsics import fetch_max, prefetch

AHEAD = 12  # rows of prefetch distance, as in the row kernels
# dedup does less work per id than a row update, so its marker prefetch runs further ahead:
# 106k uniform ids over 1M rows with the marker out of cache, 2.15 ms at 12 -> 1.82 ms at 32.
DEDUP_AHEAD = 32
LOW = np.int64(0xFFFFFFFF)  # lower 32 bits: a position or a unique index (markers, packed words)
PACKED = np.int64(1) << 31  # rows and positions below this pack into one word
MAX_DIGIT_BITS = 14  # the widest radix digit: 16384 counters (128 KiB, in L2)
MIN_CHUNK = 4096  # ids a thread of the parallel sort takes at least


@njit(cache=True, nogil=True, inline="always")
def _digits(top):
    """``(passes, width)``: as few digits of at most ``MAX_DIGIT_BITS`` bits as cover ``top``,
    the bits shared out evenly between them (``passes * width`` >= bits, each below 32)."""
    bits = 0
    while bits < 63 and (top >> bits) > 0:
        bits += 1
    passes = max(1, (bits + MAX_DIGIT_BITS - 1) // MAX_DIGIT_BITS)
    return passes, max(1, (bits + passes - 1) // passes)


@njit(cache=True, nogil=True)
def _sort_rows(ids, a, b):
    """Positions of ``ids`` sorted by row, stably: returns ``(keys, pos, shift, mask)``, the
    ``j``-th smallest row being ``keys[j] >> shift`` at position ``pos[j] & mask``. ``a`` and
    ``b`` are int64 scratch of at least ``N`` elements (packed words; one of them is returned)."""
    n = ids.shape[0]
    top = 0
    for i in range(n):
        top = max(top, ids[i])
    if top >= PACKED or n >= PACKED:
        pos = np.argsort(ids, kind="mergesort")  # (stable)
        return ids[pos], pos, 0, np.int64(-1)
    passes, width = _digits(top)
    radix = 1 << width
    count = np.empty(radix, np.int64)
    for i in range(n):
        a[i] = (ids[i] << 32) | i
    for p in range(passes):
        shift = 32 + p * width
        count[:] = 0
        for i in range(n):
            count[(a[i] >> shift) & (radix - 1)] += 1
        if count.max() < n:  # (else every id has this digit: the order stays)
            total = 0
            for d in range(radix):
                total, count[d] = total + count[d], total
            for i in range(n):  # (stable: equal digits keep their order)
                v = a[i]
                d = (v >> shift) & (radix - 1)
                b[count[d]] = v
                count[d] += 1
            a, b = b, a
    return a, a, 32, LOW


@njit(cache=True, nogil=True, inline="always")
def _marker_dedup_into(ids, marker, stamp, last, unique, inverse, first, nxt):
    """The marker's dedup into caller-provided arrays (first-occurrence order); returns ``U``."""
    n = ids.shape[0]
    tag = np.int64(stamp) << 32
    u = 0
    for i in range(n):
        if i + DEDUP_AHEAD < n:
            prefetch(marker, ids[i + DEDUP_AHEAD])
        r = ids[i]
        mk = marker[r]
        nxt[i] = -1
        if (mk >> 32) == stamp:
            k = mk & 0xFFFFFFFF
            inverse[i] = k
            nxt[last[k]] = i
            last[k] = i
        else:
            marker[r] = tag | u
            unique[u] = r
            first[u] = i
            last[u] = i
            inverse[i] = u
            u += 1
    return u


@njit(cache=True, nogil=True, inline="always")
def _sorted_dedup_into(ids, a, b, unique, inverse, first, nxt):
    """The sort's dedup into caller-provided arrays (ascending); returns ``U``."""
    keys, pos, shift, mask = _sort_rows(ids, a, b)
    u = -1
    last_row = np.int64(-1)
    last = np.int64(-1)
    for j in range(ids.shape[0]):
        row, i = keys[j] >> shift, pos[j] & mask
        nxt[i] = -1
        if row != last_row:
            u += 1
            unique[u] = row
            first[u] = i
            last_row = row
        else:
            nxt[last] = i
        inverse[i] = u
        last = i
    return u + 1


@njit(cache=True, nogil=True, inline="always")
def _dedup_into(ids, marker, stamp, a, b, unique, inverse, first, nxt):
    """The body of :func:`dedup`, writing into caller-provided arrays; returns ``U``."""
    if marker.shape[0] == 0:
        return _sorted_dedup_into(ids, a, b, unique, inverse, first, nxt)
    return _marker_dedup_into(ids, marker, stamp, a, unique, inverse, first, nxt)


@njit(cache=True, nogil=True)
def dedup(ids, marker, stamp, a, b):
    """Unique ids, the inverse map and the occurrence chains of ``ids`` (int64, >= 0).

    ``marker``: the group's marker (one int64 a row; ``stamp`` new each call, so it never needs
    clearing), or an empty array: sort, the unique ids ascending. ``a`` and ``b`` are int64
    scratch of at least ``N`` elements that the caller keeps between calls (a fresh array costs a
    page fault per 4 KiB on first touch).

    Returns ``unique (U,)`` (first-occurrence order with a marker, else ascending), ``inverse (N,)``,
    ``first (U,)`` (the position of each unique id's first occurrence) and ``nxt (N,)`` (the
    position of the next occurrence of the same id, -1 at the last): the optimizer kernels sum a
    row's gradient by walking its chain, in occurrence order, with no scratch buffer.
    """
    n = ids.shape[0]
    unique = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    nxt = np.empty(n, np.int64)
    u = _dedup_into(ids, marker, stamp, a, b, unique, inverse, first, nxt)
    return unique[:u], inverse, first[:u], nxt  # views: copying U elements costs more than the slack


@njit(cache=True, nogil=True, parallel=True)
def _sort_rows_parallel(ids, a, b, nthreads):
    """:func:`_sort_rows` over ``nthreads`` contiguous parts of ``ids``: per pass each thread
    counts its part's digits, the counts' prefix sum in (digit, thread) order gives every part
    its places (the sort stays stable), then each thread scatters its part."""
    n = ids.shape[0]
    chunks = max(1, min(nthreads, n // MIN_CHUNK))
    size = (n + chunks - 1) // chunks
    tops = np.zeros(chunks, np.int64)
    for t in prange(chunks):
        top = np.int64(0)
        for i in range(t * size, min(n, (t + 1) * size)):
            top = max(top, ids[i])
            a[i] = (ids[i] << 32) | i  # (discarded if a row does not pack)
        tops[t] = top
    top = tops.max() if n else np.int64(0)
    if top >= PACKED or n >= PACKED or chunks == 1:
        return _sort_rows(ids, a, b)
    passes, width = _digits(top)
    radix = 1 << width
    count = np.empty((chunks, radix), np.int64)
    src, dst = a, b
    for p in range(passes):
        shift = 32 + p * width
        for t in prange(chunks):
            count[t, :] = 0
            for i in range(t * size, min(n, (t + 1) * size)):
                count[t, (src[i] >> shift) & (radix - 1)] += 1
        total = 0
        shared = False  # every id has this digit: the order stays
        for d in range(radix):
            first_total = total
            for t in range(chunks):
                total, count[t, d] = total + count[t, d], total
            shared = shared or total - first_total == n
        if not shared:
            for t in prange(chunks):
                for i in range(t * size, min(n, (t + 1) * size)):
                    v = src[i]
                    d = (v >> shift) & (radix - 1)
                    dst[count[t, d]] = v
                    count[t, d] += 1
            src, dst = dst, src
    return src, src, 32, LOW


@njit(cache=True, nogil=True, parallel=True)
def _sorted_unique_parallel(ids, a, b, nthreads):
    """The sort's parallel dedup without chains: the sort on ``nthreads`` parts of ``ids``
    (:func:`_sort_rows_parallel`); then each thread counts the new rows of its part of the sorted
    words, a prefix sum numbers them, and each writes its rows and its positions' ``inverse``."""
    n = ids.shape[0]
    keys, pos, shift, mask = _sort_rows_parallel(ids, a, b, nthreads)
    chunks = max(1, min(nthreads, n // MIN_CHUNK))
    size = (n + chunks - 1) // chunks
    starts = np.zeros(chunks + 1, np.int64)
    for t in prange(chunks):
        c = 0
        for j in range(t * size, min(n, (t + 1) * size)):
            c += j == 0 or (keys[j] >> shift) != (keys[j - 1] >> shift)
        starts[t + 1] = c
    for t in range(chunks):  # (serial: one number a part)
        starts[t + 1] += starts[t]
    unique = np.empty(starts[chunks], np.int64)
    inverse = np.empty(n, np.int64)
    for t in prange(chunks):
        u = starts[t] - 1  # (the row before this part's first new one)
        for j in range(t * size, min(n, (t + 1) * size)):
            row = keys[j] >> shift
            if j == 0 or row != (keys[j - 1] >> shift):
                u += 1
                unique[u] = row
            inverse[pos[j] & mask] = u
    return unique, inverse


@njit(cache=True, nogil=True, parallel=True)
def _marker_unique(ids, marker, stamp, nthreads):
    """The marker's parallel dedup without chains (first-occurrence order). ``ids`` is split into
    ``nthreads`` contiguous chunks. Pass 1 claims each row for its first occurrence: an atomic max
    of ``stamp << 32 | (LOW - i)`` into ``marker[row]`` (an older stamp is smaller, a smaller
    position larger). Pass 2 counts each chunk's first occurrences; their prefix sum numbers them
    in position order. Pass 3 writes each first occurrence's row into ``unique`` and its number
    into the marker; pass 4 reads every id's number back as its ``inverse``. ``N < 2**32``."""
    n = ids.shape[0]
    tag = np.int64(stamp) << 32
    chunks = max(1, min(nthreads, n))
    size = (n + chunks - 1) // chunks
    for t in prange(chunks):
        lo, hi = t * size, min(n, (t + 1) * size)
        for i in range(lo, hi):
            if i + DEDUP_AHEAD < hi:
                prefetch(marker, ids[i + DEDUP_AHEAD])
            fetch_max(marker, ids[i], tag | (LOW - i))
    is_first = np.empty(n, np.bool_)
    starts = np.zeros(chunks + 1, np.int64)
    for t in prange(chunks):
        lo, hi = t * size, min(n, (t + 1) * size)
        c = 0
        for i in range(lo, hi):
            if i + DEDUP_AHEAD < hi:
                prefetch(marker, ids[i + DEDUP_AHEAD])
            f = marker[ids[i]] == (tag | (LOW - i))
            is_first[i] = f
            c += f
        starts[t + 1] = c
    for t in range(chunks):  # (serial: one number a chunk)
        starts[t + 1] += starts[t]
    unique = np.empty(starts[chunks], np.int64)
    for t in prange(chunks):
        lo, hi = t * size, min(n, (t + 1) * size)
        u = starts[t]
        for i in range(lo, hi):
            if is_first[i]:
                unique[u] = ids[i]
                marker[ids[i]] = tag | u  # (only the first occurrence's thread writes this row)
                u += 1
    inverse = np.empty(n, np.int64)
    for t in prange(chunks):
        lo, hi = t * size, min(n, (t + 1) * size)
        for i in range(lo, hi):
            if i + DEDUP_AHEAD < hi:
                prefetch(marker, ids[i + DEDUP_AHEAD])
            inverse[i] = marker[ids[i]] & LOW
    return unique, inverse


@njit(cache=True, nogil=True)
def dedup_unique(ids, marker, stamp, a, b, nthreads):
    """``unique`` and ``inverse`` of :func:`dedup` (the same arrays), in parallel, without chains:
    the marker's four passes, or without one the sort's (``a`` and ``b`` its scratch)."""
    if marker.shape[0] == 0:
        return _sorted_unique_parallel(ids, a, b, nthreads)
    return _marker_unique(ids, marker, stamp, nthreads)


@njit(cache=True, nogil=True, parallel=True)
def stamp_rows(row_version, ids, version):
    """Record that rows ``ids`` were updated at ``version`` (for the prefetch read-after-write check)."""
    n = ids.shape[0]
    for k in prange(n):
        if k + AHEAD < n:
            prefetch(row_version, ids[k + AHEAD])
        row_version[ids[k]] = version


@njit(cache=True, nogil=True, parallel=True)
def stale_positions(row_version, unique, version, nthreads):
    """Positions ``k`` of ``unique`` (increasing) whose rows were updated after ``version``: one
    random read per row, split over ``nthreads`` chunks, then a serial scan of the flags."""
    n = unique.shape[0]
    stale = np.empty(n, np.bool_)
    chunks = max(1, min(nthreads, n))
    size = (n + chunks - 1) // chunks
    for t in prange(chunks):
        lo, hi = t * size, min(n, (t + 1) * size)
        for k in range(lo, hi):
            if k + AHEAD < hi:
                prefetch(row_version, unique[k + AHEAD])
            stale[k] = row_version[unique[k]] > version
    return np.nonzero(stale)[0]


@njit(cache=True, nogil=True)
def sorted_unique(ids):
    """``(unique, inverse)`` of ``ids`` (int64, >= 0) as ``torch.unique(ids, return_inverse=True)``
    gives them (and :func:`dedup_unique`): the distinct ids ascending, and each id's index among
    them. Serial, without chains, for groups whose gradient arrives coalesced (row-sharded; on the
    SSD tier). Measured on 2 cores, 106k Zipf ids below 5.2M: 1.2 ms against 2.3 ms for
    ``torch.unique`` alone (two arrays sorted then; the words now move half the bytes)."""
    n = ids.shape[0]
    keys, pos, shift, mask = _sort_rows(ids, np.empty(n, np.int64), np.empty(n, np.int64))
    unique, inverse = np.empty(n, np.int64), np.empty(n, np.int64)
    u = -1
    for j in range(n):
        row = keys[j] >> shift
        if u < 0 or row != unique[u]:
            u += 1
            unique[u] = row
        inverse[pos[j] & mask] = u
    return unique[: u + 1], inverse
