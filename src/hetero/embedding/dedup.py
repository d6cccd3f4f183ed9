"""A table group's dedup (:class:`GroupDedup`): its marker, stamp and scratch, shared by every
lookup of the group under one lock, and the two kernel calls that use them
(:mod:`hetero.embedding._numba_dedup`)."""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import Tensor

from hetero.embedding.kernels import dedup_kernels, kernels, num_threads
from hetero.embedding.plan import LookupPlan

# Kernel threads from which a lookup without occurrence chains dedups in parallel: its passes over
# the ids beat the serial dedup's one only with several threads to share them (106k ids: 1.2 ms at
# 2 threads against 0.8 ms serial on the 2-core VM; 2.0-2.9 ms serial on the H200 host's 16 cores,
# where the parallel one took the step from 0.67 to 0.75 of its dense part; docs/embedding.md).
PARALLEL_DEDUP_THREADS = 4


class GroupDedup:
    """The dedup of one group's lookups.

    Args:
        rows: the group's rows with a marker word each (8 bytes a row); 0: the group dedups by
            sorting (large groups: the update then walks rows in address order).
    """

    def __init__(self, rows: int) -> None:
        self.marker = np.zeros(rows, np.int64)
        self.stamp = 0
        self._scratch = (np.empty(0, np.int64), np.empty(0, np.int64))
        self.lock = threading.Lock()  # all of them are shared by every lookup of the group

    def _scratch_for(self, n: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
        """The marker, a fresh stamp and the two int64 scratch arrays for ``n`` ids (under the lock)."""
        self.stamp += 1
        if self.stamp >= 1 << 31:  # the stamp lives in the upper 32 bits of the marker
            self.marker[:] = 0
            self.stamp = 1
        if self._scratch[0].shape[0] < n:
            size = max(n, 2 * self._scratch[0].shape[0])
            self._scratch = (np.empty(size, np.int64), np.empty(size, np.int64))
        return (self.marker, self.stamp, *self._scratch)

    def dedup(self, plan: LookupPlan, chains: bool = True) -> None:
        """Fill ``unique`` and ``inverse`` of a plan built with ``dedup=False``, and with
        ``chains`` its ``first`` and ``next`` (the occurrence chains the host pooling's backward needs).

        Without chains and with :data:`PARALLEL_DEDUP_THREADS` or more kernel threads, the dedup
        runs in parallel (:func:`~hetero.embedding._numba_dedup.dedup_unique`: the same result)."""
        index = plan.index.numpy()
        K, threads = dedup_kernels(), num_threads()
        with self.lock:
            scratch = self._scratch_for(index.shape[0])
            if chains or threads < PARALLEL_DEDUP_THREADS:
                found = K.dedup(index, *scratch)
                plan.first, plan.next = torch.from_numpy(found[2]), torch.from_numpy(found[3])
            else:
                found = K.dedup_unique(index, *scratch, threads)
        plan.unique, plan.inverse = torch.from_numpy(found[0]), torch.from_numpy(found[1])

    def pool_and_dedup(self, plan: LookupPlan, storage: Tensor, out: Tensor) -> None:
        """Pool ``storage``'s rows (fp32) at ``plan.index`` into ``out`` and dedup ``plan.index``
        at the same time (one kernel), filling the plan's ``unique``, ``inverse``, ``first`` and ``next``."""
        K = kernels()
        scale = plan.scale.numpy() if plan.scale is not None else np.empty(0, np.float32)
        index = plan.index.numpy()
        with self.lock:
            found = K.dedup_pool(index, *self._scratch_for(index.shape[0]), storage.numpy(),
                                 plan.offsets.numpy(), scale, out.numpy(), K.num_threads())
        plan.unique, plan.inverse, plan.first, plan.next = map(torch.from_numpy, found)
