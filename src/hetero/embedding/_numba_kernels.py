"""numba kernels of the host embedding engine. Imported lazily by :mod:`hetero.embedding.kernels`.

All kernels release the GIL (``nogil``), so a prefetch thread runs them beside the training loop.
Kernels marked *parallel* split rows (or bags) over numba's threads; each output row is written by
one thread, in a fixed order, so results do not depend on the thread count (deterministic).
"""

import numpy as np
from numba import njit, prange

_FIB = np.uint64(0x9E3779B97F4A7C15)


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
def dedup(ids, marker, stamp):
    """Unique ids in first-occurrence order and the inverse map, by direct addressing.

    ``marker`` has one int64 per row of the group: ``stamp << 32 | position`` for rows seen in the
    current call. One random access per id, no hashing and no sort; ``stamp`` must differ between
    calls (the caller increments it), so the marker never needs clearing.
    """
    n = ids.shape[0]
    unique = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    tag = np.int64(stamp) << 32
    u = 0
    for i in range(n):
        r = ids[i]
        mk = marker[r]
        if (mk >> 32) == stamp:
            inverse[i] = mk & 0xFFFFFFFF
        else:
            marker[r] = tag | u
            unique[u] = r
            inverse[i] = u
            u += 1
    return unique[:u].copy(), inverse


@njit(cache=True, nogil=True, parallel=True)
def pool_forward(rows, inverse, offsets, scale, out):
    """``out[b] = sum_{i in bag b} scale[i] * rows[inverse[i]]`` (``scale`` empty: all ones)."""
    d = rows.shape[1]
    weighted = scale.shape[0] > 0
    for b in prange(offsets.shape[0] - 1):
        for j in range(d):
            out[b, j] = 0.0
        for i in range(offsets[b], offsets[b + 1]):
            r = inverse[i]
            s = scale[i] if weighted else np.float32(1.0)
            for j in range(d):
                out[b, j] += s * rows[r, j]


@njit(cache=True, nogil=True)
def _csr_by_inverse(inverse, num_unique):
    """Stable counting sort of occurrence positions by their unique id: ``(starts, order)``."""
    starts = np.zeros(num_unique + 1, np.int64)
    for i in range(inverse.shape[0]):
        starts[inverse[i] + 1] += 1
    for k in range(num_unique):
        starts[k + 1] += starts[k]
    fill = starts[:-1].copy()
    order = np.empty(inverse.shape[0], np.int64)
    for i in range(inverse.shape[0]):
        k = inverse[i]
        order[fill[k]] = i
        fill[k] += 1
    return starts, order


@njit(cache=True, nogil=True, parallel=True)
def pool_backward(grad_out, inverse, offsets, scale, num_unique):
    """Coalesce the gradient of pooled (or per-id) outputs into one row per unique id.

    ``grad[k] = sum_{i: inverse[i] == k} scale[i] * grad_out[bag(i)]``, summed in occurrence
    order, so the result is bitwise independent of the thread count.
    """
    d = grad_out.shape[1]
    n = inverse.shape[0]
    bag_of = np.empty(n, np.int64)
    for b in prange(offsets.shape[0] - 1):
        for i in range(offsets[b], offsets[b + 1]):
            bag_of[i] = b
    starts, order = _csr_by_inverse(inverse, num_unique)
    weighted = scale.shape[0] > 0
    grad = np.empty((num_unique, d), np.float32)
    for k in prange(num_unique):
        for j in range(d):
            grad[k, j] = 0.0
        for t in range(starts[k], starts[k + 1]):
            i = order[t]
            s = scale[i] if weighted else np.float32(1.0)
            src = bag_of[i]
            for j in range(d):
                grad[k, j] += s * grad_out[src, j]
    return grad


# Sparse optimizer updates. ``w[widx[k]]`` is the weight row of unique id ``ids[k]``: for fp32
# tables ``w`` is the table itself and ``widx`` is ``ids`` (updated in place); for bf16/fp16
# tables ``w`` is an fp32 copy of the rows and ``widx`` is ``arange(U)``. State rows are always
# ``state[ids[k]]``. Each kernel reads and writes every weight row and state row once.


@njit(cache=True, nogil=True, parallel=True)
def lazy_adam(w, widx, m, v, ids, grad, step_size, beta1, beta2, eps):
    d = grad.shape[1]
    one = np.float32(1.0)
    for k in prange(ids.shape[0]):
        r, q = ids[k], widx[k]
        for j in range(d):
            g = grad[k, j]
            mj = beta1 * m[r, j] + (one - beta1) * g
            vj = beta2 * v[r, j] + (one - beta2) * g * g
            m[r, j] = mj
            v[r, j] = vj
            w[q, j] -= step_size * mj / (np.sqrt(vj) + eps)


@njit(cache=True, nogil=True, parallel=True)
def ftrl(w, widx, n, z, ids, grad, lr, l1, l2, beta):
    d = grad.shape[1]
    for k in prange(ids.shape[0]):
        r, q = ids[k], widx[k]
        for j in range(d):
            g = grad[k, j]
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
def adagrad(w, widx, s, ids, grad, lr, eps):
    d = grad.shape[1]
    for k in prange(ids.shape[0]):
        r, q = ids[k], widx[k]
        for j in range(d):
            g = grad[k, j]
            sj = s[r, j] + g * g
            s[r, j] = sj
            w[q, j] -= lr * g / (np.sqrt(sj) + eps)


@njit(cache=True, nogil=True, parallel=True)
def rowwise_adagrad(w, widx, s, ids, grad, lr, eps):
    d = grad.shape[1]
    for k in prange(ids.shape[0]):
        r, q = ids[k], widx[k]
        acc = np.float32(0.0)
        for j in range(d):
            acc += grad[k, j] * grad[k, j]
        sr = s[r] + acc / np.float32(d)
        s[r] = sr
        step = lr / (np.sqrt(sr) + eps)
        for j in range(d):
            w[q, j] -= step * grad[k, j]


@njit(cache=True, nogil=True, parallel=True)
def sgd(w, widx, ids, grad, lr):
    d = grad.shape[1]
    for k in prange(ids.shape[0]):
        q = widx[k]
        for j in range(d):
            w[q, j] -= lr * grad[k, j]


@njit(cache=True, nogil=True, parallel=True)
def stamp_rows(row_version, ids, version):
    """Record that rows ``ids`` were updated at ``version`` (for the prefetch read-after-write check)."""
    for k in prange(ids.shape[0]):
        row_version[ids[k]] = version


@njit(cache=True, nogil=True)
def stale_positions(row_version, unique, version):
    """Positions ``k`` of ``unique`` whose rows were updated after ``version``."""
    out = np.empty(unique.shape[0], np.int64)
    c = 0
    for k in range(unique.shape[0]):
        if row_version[unique[k]] > version:
            out[c] = k
            c += 1
    return out[:c].copy()
