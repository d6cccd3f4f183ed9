"""numba kernels of the host embedding engine. Imported lazily by :mod:`hetero.embedding.kernels`.

All kernels release the GIL (``nogil``), so a prefetch thread runs them beside the training loop.
Kernels marked *parallel* split rows (or bags) over numba's threads; each output row is written by
one thread, in a fixed order, so results do not depend on the thread count (deterministic).

Random row access is what costs: every kernel that walks rows in data-dependent order issues a
software prefetch ``AHEAD`` rows in advance (LLVM's ``llvm.prefetch``), which keeps several cache
misses in flight (:mod:`hetero._intrinsics`). Measured on the 2-core benchmark machine: the
LazyAdam update of 101k random rows of a 1M x 16 table went from 5.1 ms to 2.9 ms.

Bags: ``offsets`` of length 0 means "every id is its own bag" (a per-id lookup), which skips
building and reading an ``arange`` offsets array.
"""

import numpy as np
from numba import njit, prange

from hetero._intrinsics import fetch_add, prefetch
from hetero.embedding._numba_dedup import _dedup_into

AHEAD = 12  # rows of prefetch distance; 8..32 measured equally good
POOL_CHUNK = 1024  # bags per unit of pooling work handed to a thread


@njit(cache=True, nogil=True)
def globalize(ids, seg_starts, vocab, row_offset, hashed, out):
    """Check (or hash) the ids of each table segment and shift them to group rows, in one pass.

    Segment ``s`` is ``ids[seg_starts[s]:seg_starts[s + 1]]``. Returns the position of the first
    out-of-range id, or -1 when all are valid. Nothing is written to any table.
    """
    for s in range(seg_starts.shape[0] - 1):
        v, off, h = vocab[s], row_offset[s], hashed[s]
        for i in range(seg_starts[s], seg_starts[s + 1]):
            x = ids[i]
            if h:
                x = x % v  # Python (floor) semantics: negative ids hash into range too
            elif x < 0 or x >= v:
                return i
            out[i] = x + off
    return -1


@njit(cache=True, nogil=True)
def first_out_of_range(ids, vocab):
    """Position of the first id outside ``[0, vocab)``, or -1: the check of :func:`globalize`
    without its copy, for a lookup whose ids are already group rows (one table at row 0).

    A branch-free pass first (as unsigned, a negative id is out of range too: it vectorizes,
    0.047 -> 0.011 ms for 106k ids), then the position, only when some id is bad."""
    bad = False
    for i in range(ids.shape[0]):
        bad |= np.uint64(ids[i]) >= np.uint64(vocab)
    if not bad:
        return -1
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= vocab:
            return i
    return -1


@njit(cache=True, nogil=True, inline="always")
def _pool_range(rows, index, offsets, scale, out, lo, hi):
    """Bags ``[lo, hi)`` of :func:`pool_forward` (ids ``[lo, hi)`` when ``offsets`` is empty)."""
    d = rows.shape[1]
    weighted = scale.shape[0] > 0
    if offsets.shape[0] == 0:  # every id is its own bag
        for i in range(lo, hi):
            if i + AHEAD < hi:
                prefetch(rows, index[i + AHEAD])
            r = index[i]
            if weighted:
                s = scale[i]
                for j in range(d):
                    out[i, j] = s * rows[r, j]
            else:  # the common case: a plain copy, no multiply by 1
                for j in range(d):
                    out[i, j] = rows[r, j]
        return
    for b in range(lo, hi):
        for j in range(d):
            out[b, j] = 0.0
        for i in range(offsets[b], offsets[b + 1]):
            r = index[i]
            s = scale[i] if weighted else np.float32(1.0)
            for j in range(d):
                out[b, j] += s * rows[r, j]


@njit(cache=True, nogil=True, parallel=True)
def pool_forward(rows, index, offsets, scale, out):
    """``out[b] = sum_{i in bag b} scale[i] * rows[index[i]]`` (``scale`` empty: all ones).

    ``rows`` is either the gathered unique rows (``index`` = the inverse map) or, when the device
    is the host, the fp32 table itself (``index`` = table rows): then no staging copy is made.
    """
    bags = out.shape[0]
    for c in prange((bags + POOL_CHUNK - 1) // POOL_CHUNK):
        _pool_range(rows, index, offsets, scale, out, c * POOL_CHUNK, min(bags, (c + 1) * POOL_CHUNK))


@njit(cache=True, nogil=True, parallel=True)
def dedup_pool(ids, marker, stamp, a, b, rows, offsets, scale, out, nthreads):
    """:func:`dedup` of ``ids`` and :func:`pool_forward` of ``rows`` at ``ids``, at the same time.

    When the device is the host, the pooling reads the table at the ids themselves and need not
    wait for the dedup: thread 0 dedups (serial: the marker's pass or the sort) while the other threads pool chunks
    of bags claimed from a shared counter, and thread 0 joins the pooling when its dedup is done.
    Each output row is still written by one thread with the same arithmetic, so the results are
    bitwise those of the two kernels in sequence. Measured on the 2-core benchmark machine, 106k
    uniform ids of a 1M x 16 table, caches cold: 3.0 ms in sequence, 2.2 ms here.
    Returns what :func:`dedup` returns (``marker`` to ``b`` are its arguments).
    """
    n = ids.shape[0]
    unique = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    nxt = np.empty(n, np.int64)
    shared = np.zeros(2, np.int64)  # [next chunk to claim, U]
    bags = out.shape[0]
    nchunks = (bags + POOL_CHUNK - 1) // POOL_CHUNK
    for t in prange(nthreads):
        if t == 0:
            shared[1] = _dedup_into(ids, marker, stamp, a, b, unique, inverse, first, nxt)
        while True:
            c = fetch_add(shared, 0, 1)  # a chunk goes to whichever thread is free
            if c >= nchunks:
                break
            _pool_range(rows, ids, offsets, scale, out, c * POOL_CHUNK, min(bags, (c + 1) * POOL_CHUNK))
    u = shared[1]
    return unique[:u], inverse, first[:u], nxt


@njit(cache=True, nogil=True, inline="always")
def _coalesce_range(grad, src, inverse, offsets, scale, lo, hi):
    """``grad[k] = sum_{i: inverse[i] == k} scale[i] * src[bag(i)]`` for ``lo <= k < hi``.

    Scans all occurrences in order (reading ``src`` sequentially) and keeps those it owns, so each
    row's sum is accumulated in occurrence order: bitwise independent of how rows are split
    between threads. No sort or CSR index is built.
    """
    d = grad.shape[1]
    for k in range(lo, hi):
        for j in range(d):
            grad[k, j] = 0.0
    weighted = scale.shape[0] > 0
    if offsets.shape[0] == 0:  # every id is its own bag
        n = inverse.shape[0]
        for i in range(n):
            if i + AHEAD < n:
                prefetch(grad, inverse[i + AHEAD])
            k = inverse[i]
            if k >= lo and k < hi:
                s = scale[i] if weighted else np.float32(1.0)
                for j in range(d):
                    grad[k, j] += s * src[i, j]
        return
    for b in range(offsets.shape[0] - 1):
        for i in range(offsets[b], offsets[b + 1]):
            k = inverse[i]
            if k >= lo and k < hi:
                s = scale[i] if weighted else np.float32(1.0)
                for j in range(d):
                    grad[k, j] += s * src[b, j]


@njit(cache=True, nogil=True, inline="always")
def _owned(t, nthreads, nu):
    """Unique rows ``[lo, hi)`` owned by thread ``t``."""
    chunk = (nu + nthreads - 1) // nthreads
    return t * chunk, min(nu, (t + 1) * chunk)


@njit(cache=True, nogil=True, inline="always")
def _row_grad(k, acc, grad, src, first, nxt, scale):
    """Gradient of unique row ``k`` into ``acc``: ``grad[k]`` when ``src`` is empty (coalesced
    already), else the sum of ``scale[i] * src[i]`` over the row's occurrence chain, in
    occurrence order (so bitwise independent of how rows are split between threads)."""
    d = acc.shape[0]
    if src.shape[0] == 0:
        for j in range(d):
            acc[j] = grad[k, j]
        return
    weighted = scale.shape[0] > 0
    for j in range(d):
        acc[j] = 0.0
    i = first[k]
    while i >= 0:
        s = scale[i] if weighted else np.float32(1.0)
        for j in range(d):
            acc[j] += s * src[i, j]
        i = nxt[i]


@njit(cache=True, nogil=True, inline="always")
def _prefetch_grad(src, first, k):
    """Prefetch the per-id gradient of unique row ``k``'s first occurrence (``src[first[k]]``; nothing
    when the gradient is coalesced, read in order). Its occurrences lie anywhere in the batch: without
    this the walk of a row's chain waited on a cache miss per row. The row-wise Adagrad update of a
    DLRM step (79.6k unique rows of 106k Zipf ids, 26 x 1M x 16, 2 threads), alternating call by call
    in one process, medians of 80: 3.99 -> 3.75 and 4.20 -> 3.92 ms with the caches flushed before each
    call, 2.63 -> 2.55 and 3.42 -> 3.37 ms without."""
    if src.shape[0] > 0:
        prefetch(src, first[k])


@njit(cache=True, nogil=True, parallel=True)
def pool_backward(grad_out, inverse, offsets, scale, num_unique, nthreads):
    """Coalesce the gradient of pooled (or per-id) outputs into one ``(U, D)`` row per unique id."""
    grad = np.empty((num_unique, grad_out.shape[1]), np.float32)
    for t in prange(nthreads):
        lo, hi = _owned(t, nthreads, num_unique)
        _coalesce_range(grad, grad_out, inverse, offsets, scale, lo, hi)
    return grad


# Sparse optimizer updates. ``w[widx[k]]`` is the weight row of unique id ``ids[k]``: for fp32
# tables ``w`` is the table itself and ``widx`` is ``ids`` (updated in place); for bf16/fp16
# tables ``w`` is an fp32 copy of the rows and ``widx`` is ``arange(U)``. State rows are always
# ``state[ids[k]]``. Each kernel reads and writes every weight row and state row once.
# The gradient is either coalesced, ``grad (U, D)`` with ``src`` empty, or per id: ``src (N, D)``
# with the occurrence chains ``first``/``nxt`` of :func:`dedup` and an optional ``scale (N,)``;
# then each row's gradient is summed as the row is updated (the coalesce fused into the update:
# measured 0.5 ms less per step than a separate coalescing pass, for 106k ids).


@njit(cache=True, nogil=True, parallel=True)
def lazy_adam(w, widx, m, v, ids, grad, src, first, nxt, scale, nthreads, step_size, beta1, beta2, eps):
    nu = ids.shape[0]
    d = w.shape[1]
    one = np.float32(1.0)
    for t in prange(nthreads):
        lo, hi = _owned(t, nthreads, nu)
        acc = np.empty(d, np.float32)  # this thread's gradient row
        for k in range(lo, hi):
            if k + AHEAD < hi:
                prefetch(w, widx[k + AHEAD])
                prefetch(m, ids[k + AHEAD])
                prefetch(v, ids[k + AHEAD])
                _prefetch_grad(src, first, k + AHEAD)
            _row_grad(k, acc, grad, src, first, nxt, scale)
            r, q = ids[k], widx[k]
            for j in range(d):
                g = acc[j]
                mj = beta1 * m[r, j] + (one - beta1) * g
                vj = beta2 * v[r, j] + (one - beta2) * g * g
                m[r, j] = mj
                v[r, j] = vj
                w[q, j] -= step_size * mj / (np.sqrt(vj) + eps)


@njit(cache=True, nogil=True, parallel=True)
def ftrl(w, widx, n, z, ids, grad, src, first, nxt, scale, nthreads, lr, l1, l2, beta):
    nu = ids.shape[0]
    d = w.shape[1]
    for t in prange(nthreads):
        lo, hi = _owned(t, nthreads, nu)
        acc = np.empty(d, np.float32)  # this thread's gradient row
        for k in range(lo, hi):
            if k + AHEAD < hi:
                prefetch(w, widx[k + AHEAD])
                prefetch(n, ids[k + AHEAD])
                prefetch(z, ids[k + AHEAD])
                _prefetch_grad(src, first, k + AHEAD)
            _row_grad(k, acc, grad, src, first, nxt, scale)
            r, q = ids[k], widx[k]
            for j in range(d):
                g = acc[j]
                nj = n[r, j]
                n_new = nj + g * g
                sqrt_new = np.sqrt(n_new)
                zj = z[r, j] + g - (sqrt_new - np.sqrt(nj)) / lr * w[q, j]
                n[r, j] = n_new
                z[r, j] = zj
                if abs(zj) <= l1:
                    w[q, j] = 0.0
                else:
                    w[q, j] = -(zj - np.sign(zj) * l1) / ((beta + sqrt_new) / lr + l2)


@njit(cache=True, nogil=True, parallel=True)
def adagrad(w, widx, s, ids, grad, src, first, nxt, scale, nthreads, lr, eps):
    nu = ids.shape[0]
    d = w.shape[1]
    for t in prange(nthreads):
        lo, hi = _owned(t, nthreads, nu)
        acc = np.empty(d, np.float32)  # this thread's gradient row
        for k in range(lo, hi):
            if k + AHEAD < hi:
                prefetch(w, widx[k + AHEAD])
                prefetch(s, ids[k + AHEAD])
                _prefetch_grad(src, first, k + AHEAD)
            _row_grad(k, acc, grad, src, first, nxt, scale)
            r, q = ids[k], widx[k]
            for j in range(d):
                g = acc[j]
                sj = s[r, j] + g * g
                s[r, j] = sj
                w[q, j] -= lr * g / (np.sqrt(sj) + eps)


@njit(cache=True, nogil=True, parallel=True)
def rowwise_adagrad(w, widx, s, ids, grad, src, first, nxt, scale, nthreads, lr, eps):
    nu = ids.shape[0]
    d = w.shape[1]
    for t in prange(nthreads):
        lo, hi = _owned(t, nthreads, nu)
        acc = np.empty(d, np.float32)  # this thread's gradient row
        for k in range(lo, hi):
            if k + AHEAD < hi:
                prefetch(w, widx[k + AHEAD])
                prefetch(s, ids[k + AHEAD])
                _prefetch_grad(src, first, k + AHEAD)
            _row_grad(k, acc, grad, src, first, nxt, scale)
            r, q = ids[k], widx[k]
            sq = np.float32(0.0)
            for j in range(d):
                sq += acc[j] * acc[j]
            sr = s[r] + sq / np.float32(d)
            s[r] = sr
            step = lr / (np.sqrt(sr) + eps)
            for j in range(d):
                w[q, j] -= step * acc[j]


@njit(cache=True, nogil=True, parallel=True)
def sgd(w, widx, ids, grad, src, first, nxt, scale, nthreads, lr):
    nu = ids.shape[0]
    d = w.shape[1]
    for t in prange(nthreads):
        lo, hi = _owned(t, nthreads, nu)
        acc = np.empty(d, np.float32)  # this thread's gradient row
        for k in range(lo, hi):
            if k + AHEAD < hi:
                prefetch(w, widx[k + AHEAD])
                _prefetch_grad(src, first, k + AHEAD)
            _row_grad(k, acc, grad, src, first, nxt, scale)
            q = widx[k]
            for j in range(d):
                w[q, j] -= lr * acc[j]
