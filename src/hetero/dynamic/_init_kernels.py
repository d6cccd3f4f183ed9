"""numba kernels of the initial rows of a dynamic table's new keys (:meth:`hetero.dynamic.KeyMap.init_rows`):
normal values drawn by the ziggurat method from a counter-based stream of each key, so a key's
first row does not depend on when, where or on which rank it is admitted. Compiled on first use.
"""

import numpy as np
from numba import njit, prange

from hetero.dynamic._kernels import GOLDEN, mix


def _ziggurat(layers=256, r=3.6541528853610088, area=4.92867323399e-3):
    """Marsaglia & Tsang's (2000) tables for N(0, 1)'s right half in ``layers`` strips of equal
    ``area`` (``r`` and ``area``: the 256-strip constants of Doornik's ZIGNOR, 2005; the top strip
    closes on them to 1e-12): ``x[i]``, strip i's right edge (``x[0]``: the base strip's width
    ``area / f(r)``, so a draw past ``x[1] = r`` falls in the tail), ``x[layers] = 0``;
    ``f[i] = exp(-x[i]**2 / 2)``. A draw takes its strip, sign and uniform from disjoint bits
    (Doornik's point: the original reused the strip's bits in the uniform)."""
    x = np.zeros(layers + 1)
    x[0], x[1] = area / np.exp(-0.5 * r * r), r
    for i in range(1, layers - 1):
        x[i + 1] = np.sqrt(-2.0 * np.log(area / x[i] + np.exp(-0.5 * x[i] * x[i])))
    return x.astype(np.float32), np.exp(-0.5 * x * x).astype(np.float32)


ZIG_X, ZIG_F = _ziggurat()
UNIT = np.float32(2.0**-24)  # a 24-bit integer -> [0, 1)


@njit(cache=True, inline="always")
def _uniform(bits, shift):
    return np.float32((bits >> shift) & 0xFFFFFF) * UNIT


@njit(cache=True, inline="always")
def _draw(base, j, k):
    """Draw ``k`` of value ``j``'s own stream (``k >= 1``; past every row's fast draws ``1..D``)."""
    return np.int64(mix(base + (np.uint64(j + 1) << np.uint64(32) | np.uint64(k)) * GOLDEN))


@njit(cache=True)
def _ziggurat_slow(base, j, zx, zf):
    """Value ``j`` of a row whose fast draw (``j + 1``) was refused: that draw's point takes the
    ziggurat's full test - in the base strip, a draw from the tail past ``r`` (Marsaglia's method);
    else the wedge's - and a point the wedge refuses is drawn again, from value ``j``'s own stream."""
    bits, k = np.int64(mix(base + np.uint64(j + 1) * GOLDEN)), 0
    while True:
        layer = bits & 255
        z = _uniform(bits, 9) * zx[layer]
        if k > 0 and z < zx[layer + 1]:
            break
        k += 1
        more = _draw(base, j, k)
        if layer == 0:  # the tail: r + a, a exponential with rate r, kept with probability exp(-a^2 / 2)
            while True:
                a = -np.log(_uniform(more, 8) + UNIT) / zx[1]  # (+ UNIT: in (0, 1], no log of 0)
                if np.float32(-2.0) * np.log(_uniform(more, 32) + UNIT) > a * a:
                    break
                k += 1
                more = _draw(base, j, k)
            z = zx[1] + a
            break
        if zf[layer] + _uniform(more, 8) * (zf[layer + 1] - zf[layer]) < np.exp(np.float32(-0.5) * z * z):
            break
        k += 1
        bits = _draw(base, j, k)
    return -z if bits & 256 else z


@njit(cache=True, parallel=True)  # (no fastmath: it assumes no NaN, and a NaN marks a refused draw)
def _init_rows(keys, seed, std, out, zx, zf):
    d, nan, sd = out.shape[1], np.float32(np.nan), np.float32(std)
    for i in prange(keys.shape[0]):
        base, refused = mix(np.uint64(keys[i]) ^ np.uint64(seed)), 0
        for j in range(d):  # (branch-free: vectorised)
            bits = np.int64(mix(base + np.uint64(j + 1) * GOLDEN))
            layer = bits & 255
            z = _uniform(bits, 9) * zx[layer]
            fast = z < zx[layer + 1]
            out[i, j] = sd * (-z if bits & 256 else z) if fast else nan
            refused += not fast
        if refused:
            for j in range(d):
                if out[i, j] != out[i, j]:
                    out[i, j] = sd * _ziggurat_slow(base, j, zx, zf)


def init_rows(keys, seed, std, out):
    """Initial values of the rows of ``keys``: ``N(0, std**2)`` per key (``out``: ``(len(keys), D)``
    float32), drawn by the ziggurat method (Marsaglia & Tsang 2000, 256 strips) from a counter-based
    stream, SplitMix64's finalizer of (the key and ``seed``'s hash + n x the golden ratio), so a
    key's first row does not depend on when, where or on which rank it is admitted. Value ``j``
    first tries draw ``j + 1`` alone; 98.5% pass the ziggurat's fast test, in a loop without
    branches (vectorised); the rest take the full test on draws of their own. Measured on 2 cores
    (45k rows x 16): 1.2 ms, against 2.7 ms for Marsaglia's polar method, which this replaced."""
    _init_rows(keys, seed, std, out, ZIG_X, ZIG_F)
