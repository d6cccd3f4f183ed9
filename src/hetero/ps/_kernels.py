"""numba kernels of the worker's routing (loaded through :func:`hetero._numba.load`)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def route(ids, n):
    """Group the positions of ``ids`` (int64, ``>= 0``) by owner ``id % n``, keeping their order
    within an owner: ``(order, starts)``, owner ``s``'s positions being
    ``order[starts[s]:starts[s + 1]]``. Two passes over ``ids`` (a counting sort by owner)."""
    starts = np.zeros(n + 1, np.int64)
    for i in range(ids.shape[0]):
        starts[ids[i] % n + 1] += 1
    for s in range(n):
        starts[s + 1] += starts[s]
    at = starts[:n].copy()
    order = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        s = ids[i] % n
        order[at[s]] = i
        at[s] += 1
    return order, starts
