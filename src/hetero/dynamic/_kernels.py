"""numba kernels of the dynamic tables' key map (:mod:`hetero.dynamic.keymap`); compiled on first use.

The map is open addressing with linear probing over a power-of-two table of ``(key, row)``
slots (one 16-byte entry: a probe is one cache line), at most half full, with backward-shift
deletion (Knuth, TAOCP vol. 3, 6.4, algorithm R), so no tombstones accumulate however many
keys come and go. Keys are mixed by SplitMix64's finalizer (Steele, Lea & Flood 2014) before
they index anything. A row's use count and last step share one 8-byte entry too. The passes
over a batch's keys prefetch the entries ``AHEAD`` keys in advance (as the embedding kernels
do): a batch's keys are random accesses into tables larger than the caches.
"""

import numba
import numpy as np
from numba import njit, prange

from hetero._intrinsics import prefetch

AHEAD = 16  # keys of prefetch distance
EMPTY = np.int32(-1)  # a free slot of the map; a free row's last step
SATURATED = np.int32(2**31 - 1)
C1, C2, GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, inline="always")
def mix(x):
    """SplitMix64's finalizer of ``x`` (uint64)."""
    x = (x ^ (x >> np.uint64(30))) * C1
    x = (x ^ (x >> np.uint64(27))) * C2
    return x ^ (x >> np.uint64(31))


@njit(cache=True, inline="always")
def _probe(key, home, slots):
    """The slot of ``key`` (hashed to slot ``home``), or of the empty slot where it would go."""
    mask = slots.shape[0] - 1
    i = home
    while slots[i, 1] != EMPTY and slots[i, 0] != key:
        i = (i + 1) & mask
    return i


@njit(cache=True, inline="always")
def _home(key, slots):
    return np.intp(mix(np.uint64(key)) & np.uint64(slots.shape[0] - 1))


@njit(cache=True)
def _delete(key, slots):
    """Remove ``key`` (present) from the map, shifting later slots of its probe run back."""
    mask = slots.shape[0] - 1
    i = _probe(key, _home(key, slots), slots)
    j = i
    while True:
        slots[i, 1] = EMPTY
        while True:
            j = (j + 1) & mask
            if slots[j, 1] == EMPTY:
                return
            home = _home(slots[j, 0], slots)
            # slot j's key may move to i unless its home lies cyclically in (i, j]
            if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                break
        slots[i, 0], slots[i, 1] = slots[j, 0], slots[j, 1]
        i = j


@njit(cache=True, inline="always")
def _sketch(key, sketch, add):
    """The count-min estimate of ``key`` after adding ``add`` to its four counters."""
    h = mix(np.uint64(key) ^ GOLDEN)
    h1, h2 = h & np.uint64(0xFFFFFFFF), (h >> np.uint64(32)) | np.uint64(1)
    mask = np.uint64(sketch.shape[1] - 1)
    est = SATURATED
    for d in range(sketch.shape[0]):
        c = (h1 + np.uint64(d) * h2) & mask
        v = sketch[d, c]
        if add and v < SATURATED:
            v += 1
            sketch[d, c] = v
        est = min(est, v)
    return est


PROBE_CHUNK = 4096  # keys per unit of the probe pass handed to a thread


@njit(cache=True, parallel=True)
def _rows(keys, slots, out):
    """``out[i]``: the row of ``keys[i]``, or -1 (read-only: over every core, in chunks of
    ``PROBE_CHUNK`` keys whose home slots are computed first, then each prefetched ``AHEAD`` keys
    in advance of its probe)."""
    n = keys.shape[0]
    for c in prange((n + PROBE_CHUNK - 1) // PROBE_CHUNK):
        lo, hi = c * PROBE_CHUNK, min(n, (c + 1) * PROBE_CHUNK)
        homes = np.empty(hi - lo, np.intp)
        for i in range(lo, hi):
            homes[i - lo] = _home(keys[i], slots)
        for i in range(lo, hi):
            if i + AHEAD < hi:
                prefetch(slots, homes[i + AHEAD - lo])
            out[i] = slots[_probe(keys[i], homes[i - lo], slots), 1]


@njit(cache=True, parallel=True)
def _found(keys, out, slots, stat, step, parts):
    """A training lookup's probe and count in one pass: ``out[i]``, the row of ``keys[i]`` or -1;
    each found row's use count incremented (saturating at ``SATURATED``) and its last step set to
    ``step``. Returns how many keys have no row.

    The keys are split over ``parts`` threads (a power of two) by the top bits of a multiplicative
    hash of the key, so every occurrence of a key, and so every count of its row, falls to one
    thread: no atomic adds, and a Zipf batch's hot rows stay in one core's cache (two cores
    counting them with atomic adds passed their lines back and forth: 0.80 against 0.55 ms on one
    core, 106k keys of a 1M-key map). Each thread picks its keys out of the batch without a
    branch and hashes them to their home slots, then probes them with the slots prefetched
    ``AHEAD`` keys in advance and counts each ``AHEAD`` keys after its probe, once its row's entry,
    prefetched at the probe, has arrived (two misses a key in flight, where a probe pass and then a
    count pass waited on the second in turn: 2.15 -> 1.78 ms, 106k Zipf keys of a held 1M-key map,
    the caches flushed between batches). One parallel region: with the home slots computed in one
    of their own first, to split the keys by them, 1.94 against 1.72 ms (1M keys, caches warm;
    2.94 against 2.81 at 10M, flushed; alternating in one process, medians)."""
    n = keys.shape[0]
    shift, p2 = np.uint64(64), parts  # the hash's top log2(parts) bits pick the thread
    while p2 > 1:
        shift, p2 = shift - np.uint64(1), p2 // 2
    missing = 0
    for p in prange(parts):
        own = np.empty(n, np.int64)  # this thread's keys, in the batch's order (picked without a branch)
        m = n
        if parts == 1:
            for i in range(n):
                own[i] = i
        else:
            m = 0
            for i in range(n):
                own[m] = i
                m += np.intp((np.uint64(keys[i]) * GOLDEN) >> shift) == p
        homes = np.empty(m, np.intp)
        for j in range(m):
            homes[j] = _home(keys[own[j]], slots)
        miss = 0
        for j in range(m + AHEAD):
            if j < m:
                if j + AHEAD < m:
                    prefetch(slots, homes[j + AHEAD])
                i = own[j]
                r = slots[_probe(keys[i], homes[j], slots), 1]
                out[i] = r
                if r >= 0:
                    prefetch(stat, r)
            if j >= AHEAD:
                r = out[own[j - AHEAD]]
                if r >= 0:
                    if stat[r, 0] < SATURATED:
                        stat[r, 0] += 1
                    stat[r, 1] = step
                else:
                    miss += 1
        missing += miss
    return missing


@njit(cache=True)
def _count_unknown(keys, out, sketch):
    """Count the keys without a row (``out[i] < 0``) in the admission sketch, on one core."""
    n = keys.shape[0]
    mask = np.uint64(sketch.shape[1] - 1)
    for i in range(n):
        if i + AHEAD < n and out[i + AHEAD] < 0:
            h = mix(np.uint64(keys[i + AHEAD]) ^ GOLDEN)
            h1, h2 = h & np.uint64(0xFFFFFFFF), (h >> np.uint64(32)) | np.uint64(1)
            for d in range(sketch.shape[0]):
                prefetch(sketch[d], np.intp((h1 + np.uint64(d) * h2) & mask))
        if out[i] < 0:
            _sketch(keys[i], sketch, True)


def lookup(keys, out, slots, default_row):
    """Rows of ``keys`` without changing anything (evaluation): a key with no row reads ``default_row``."""
    _rows(keys, slots, out)
    out[out < 0] = default_row


@njit(cache=True)
def evict(k, before, lfu, slots, row_key, stat, free, nfree, evicted):
    """Evict up to ``k`` rows last looked up before step ``before`` (the current step: any row
    this step has not looked up; an earlier one: the rows past their age), lowest score first -
    LFU ``(count, last)``, LRU ``last`` - ties by key; their rows go onto the free stack, their
    count into ``evicted[0]``. Returns how many were evicted."""
    n = 0
    for r in range(stat.shape[0]):
        if stat[r, 1] != EMPTY and stat[r, 1] < before:
            n += 1
    if n == 0 or k <= 0:
        return 0
    cand = np.empty(n, np.int64)
    score = np.empty(n, np.int64)
    n = 0
    for r in range(stat.shape[0]):
        if stat[r, 1] != EMPTY and stat[r, 1] < before:
            cand[n] = r
            score[n] = (np.int64(stat[r, 0]) << 32 | stat[r, 1]) if lfu else np.int64(stat[r, 1])
            n += 1
    if n > k:
        kth = np.partition(score, k - 1)[k - 1]  # (a copy: score stays in cand's order)
        below = 0
        for j in range(n):
            below += score[j] < kth
        ties = np.empty(n, np.int64)
        t = 0
        for j in range(n):
            if score[j] == kth:
                ties[t] = row_key[cand[j]]
                t += 1
        cut = np.sort(ties[:t])[k - below - 1]  # the largest tied key evicted
        m = 0
        for j in range(n):
            if score[j] < kth or (score[j] == kth and row_key[cand[j]] <= cut):
                cand[m] = cand[j]
                m += 1
        n = m
    for j in range(n):
        r = cand[j]
        _delete(row_key[r], slots)
        evicted[0] += 1
        stat[r, 0], stat[r, 1] = 0, EMPTY
        free[nfree[0]] = r
        nfree[0] += 1
    return n


VICTIM_SAMPLE = 16  # rows sampled for the least-used row a new key must outrank (tinylfu)


@njit(cache=True)
def _outranks(key, step, sketch, stat):
    """TinyLFU's admission filter (Einziger, Friedman & Manes 2017) for ``key``, which a table short
    of free rows would admit: whether its sketch count (its sightings while it held no row) exceeds the use count
    of the least used of ``VICTIM_SAMPLE`` rows drawn for it (from a hash of the key and ``step``:
    reproducible) among those this step has not looked up - the sample standing in for the least
    used row, as Redis's approximated LFU picks its victim. A key seen once never outranks a row
    (every row was looked up at least once), so a stream of one-off keys does not churn the rows
    of returning ones. No sampled row evictable (or no rows: a part of a table with none): the key
    does not get in."""
    est = _sketch(key, sketch, False)
    if est <= 1 or stat.shape[0] == 0:
        return False
    low = SATURATED
    base = mix(np.uint64(key) ^ mix(np.uint64(step) ^ GOLDEN))
    rows = np.uint64(stat.shape[0])
    for t in range(VICTIM_SAMPLE):
        r = np.intp(mix(base + np.uint64(t + 1) * GOLDEN) % rows)
        if stat[r, 1] != EMPTY and stat[r, 1] < step and stat[r, 0] < low:
            low = stat[r, 0]
    return est > low


@njit(cache=True)
def _admit(keys, out, slots, row_key, stat, sketch, free, nfree, step, admit_after, admit_below, seed, lfu, chunk,
           default_row, admitted, evicted, stats, tinylfu):
    """The second pass of :func:`translate`: the keys with no row (``out[i] == -1``)."""
    by_count = admit_below == 0
    missing = np.flatnonzero(out == -1)  # (in order: admissions follow the batch's order)
    m = missing.shape[0]
    for j in range(m):
        if j + AHEAD < m:
            prefetch(slots, _home(keys[missing[j + AHEAD]], slots))
        i = missing[j]
        key = keys[i]
        s = _probe(key, _home(key, slots), slots)
        if slots[s, 1] != EMPTY:  # admitted by an earlier occurrence of this batch
            r = slots[s, 1]
            out[i] = r
            if stat[r, 0] < SATURATED:
                stat[r, 0] += 1
            continue
        if by_count:
            admit = admit_after == 1 or _sketch(key, sketch, False) >= admit_after
        else:
            admit = mix(np.uint64(key) ^ mix(np.uint64(step) ^ np.uint64(seed))) < admit_below
        # (tinylfu: while fewer than a chunk of rows are free - until an age scan frees more - so the rows an
        # eviction frees go to keys that outrank rows; a key refused once in a pass stays refused: the free rows
        # stay below a chunk, and the least count among its sampled evictable rows only rises)
        if admit and tinylfu and nfree[0] < chunk and not _outranks(key, step, sketch, stat):
            admit = False
        if admit and nfree[0] == 0:
            evict(chunk, step, lfu, slots, row_key, stat, free, nfree, evicted)
            s = _probe(key, _home(key, slots), slots)  # (deletions shifted the slots)
        if not admit or nfree[0] == 0:
            out[i] = default_row
            stats[2] += 1
            continue
        nfree[0] -= 1
        r = free[nfree[0]]
        slots[s, 0], slots[s, 1] = key, r
        row_key[r] = key
        stat[r, 0], stat[r, 1] = 1, step
        out[i] = r
        a = admitted[0, 0] + 1
        admitted[0, 0] = a
        admitted[a, 0], admitted[a, 1] = r, key
        stats[0] += 1


def translate(keys, out, slots, row_key, stat, sketch, free, nfree, step, admit_after, admit_below, seed, lfu, chunk,
              default_row, admitted, evicted, stats, tinylfu):
    """Rows of a training step's ``keys`` into ``out``: known keys are counted and stamped with
    ``step``; unknown ones are counted in the sketch and admitted (given a free row, evicting
    ``chunk`` rows when none is free) once seen ``admit_after`` times - or, with ``admit_below``
    > 0, when ``mix(key, step, seed) < admit_below`` - else they read ``default_row``. Every
    occurrence of a key reads the same row: admission is decided once the whole batch is counted.

    With ``tinylfu``, a table with fewer than ``chunk`` free rows admits a key only if it outranks
    a row it could evict (:func:`_outranks`).

    ``admitted`` receives ``(row, key)`` pairs from ``admitted[0, 0]`` + 1 on (sized by the caller),
    ``evicted[0]`` the count of evictions; ``stats`` += (admitted, evicted, default lookups)."""
    parts = 1  # threads of the pass, a power of two (a thread's keys by the top bits of a hash)
    while parts * 2 <= numba.get_num_threads():
        parts *= 2
    if not _found(keys, out, slots, stat, step, parts):
        return  # every key has a row
    if admit_below == 0 and (admit_after > 1 or tinylfu):  # (else keys are admitted uncounted)
        _count_unknown(keys, out, sketch)
    before = evicted[0]
    _admit(keys, out, slots, row_key, stat, sketch, free, nfree, step, admit_after, admit_below, seed, lfu, chunk,
           default_row, admitted, evicted, stats, tinylfu)
    stats[1] += evicted[0] - before


@njit(cache=True)
def insert(keys, rows, slots):
    """Put ``keys`` (not in the map) at ``rows`` (a restored map's slots)."""
    for i in range(keys.shape[0]):
        s = _probe(keys[i], _home(keys[i], slots), slots)
        slots[s, 0], slots[s, 1] = keys[i], rows[i]


@njit(cache=True, parallel=True)
def home_rows(keys, capacity, out):
    """``out[i]``: the table row that places ``keys[i]`` on a rank (a row-sharded table's owner:
    the rank holding that row), uniform over ``[0, capacity)``. SplitMix64's next output for the
    key, not the finalizer that picks the key's slot: the keys a rank owns spread over its map."""
    for i in prange(keys.shape[0]):
        out[i] = np.int64(mix(np.uint64(keys[i]) + GOLDEN) % np.uint64(capacity))
