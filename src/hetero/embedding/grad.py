"""Sparse gradients of table groups, and the one place a group keeps them until its optimizer steps."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from hetero.embedding.exchange import RowSpace
from hetero.embedding.kernels import kernels


class SparseGrad:
    """Gradient of a table group for one step: only the rows the batch touched.

    Attributes:
        ids: ``(U,)`` int64, host, unique row indices in the space ``space`` names (see
            :class:`~hetero.embedding.exchange.RowSpace`), in first-occurrence order.
        space: what ``ids`` count: ``GROUP`` rows (as a lookup captures them) or this process's
            ``LOCAL`` storage rows (as an exchange delivers them to a shard's optimizer).
        rows: ``(U, D)`` float32, host, the coalesced gradient of each of those rows. On the CPU
            it is computed on first access: until then the gradient is kept per id (``per_id``:
            the output gradient, the inverse map, bag offsets and scales) so that the optimizer
            can coalesce and update in one pass; ``chain`` holds the occurrence chains
            (``first``, ``next``; see :class:`~hetero.embedding.plan.LookupPlan`).
        ready: on CUDA, the event recorded after the async device->host copy of ``rows``;
            :meth:`wait` blocks on it before the host reads ``rows``. ``None`` on CPU.
    """

    def __init__(self, ids: Tensor, rows: Tensor | None, space: RowSpace, ready: "torch.cuda.Event | None" = None,
                 per_id: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
                 chain: tuple[Tensor, Tensor] | None = None) -> None:
        assert rows is not None or per_id is not None
        self.ids, self._rows, self.space, self.ready, self.per_id, self.chain = ids, rows, space, ready, per_id, chain
        self._part_of: tuple[SparseGrad, Tensor] | None = None

    @staticmethod
    def empty(dim: int, space: RowSpace) -> "SparseGrad":
        return SparseGrad(torch.empty(0, dtype=torch.int64), torch.empty(0, dim), space)

    @property
    def rows(self) -> Tensor:
        if self._rows is None and self._part_of is not None:
            whole, at = self._part_of
            self._rows = whole.rows[at]
        if self._rows is None:
            K = kernels()
            src, inverse, offsets, scale = (t.numpy() for t in self.per_id)
            self._rows = torch.from_numpy(K.pool_backward(src, inverse, offsets, scale, self.ids.numel(), K.num_threads()))
        return self._rows

    @property
    def is_coalesced(self) -> bool:
        return self._rows is not None

    def wait(self) -> "SparseGrad":
        if self.ready is not None:
            self.ready.synchronize()  # sync point: host waits for the device->host gradient copy
            self.ready = None
        return self

    def without(self, rows: np.ndarray) -> "SparseGrad":
        """This gradient less its rows ``rows`` (sorted int64, in ``space``): a dynamic table's
        default row, which takes no update. Itself when none of them is here."""
        ids = self.ids.numpy()
        if rows.shape[0] <= 8:  # (a group's few default rows: a compare each, 10x faster than isin's table at 65k ids)
            hit = ids == rows[0]
            for r in rows[1:]:
                hit |= ids == r
            keep = ~hit
        else:
            keep = ~np.isin(ids, rows, assume_unique=True)
        if keep.all():
            return self
        at = torch.from_numpy(np.flatnonzero(keep))
        if self.per_id is not None and self.chain is not None and self.chain[0].numel() and not self.per_id[2].numel():
            # per-id lookups with occurrence chains: the kept rows' chains only (the rest are never walked)
            chain = (self.chain[0][at], self.chain[1])
            kept = SparseGrad(self.ids[at], None, self.space, per_id=self.per_id, chain=chain)
            kept._part_of = (self, at)  # (its coalesced rows, if asked for: this gradient's, at the kept rows)
            return kept
        return SparseGrad(self.ids[at], self.wait().rows[at], self.space)

    @staticmethod
    def coalesce(grads: list["SparseGrad"]) -> "SparseGrad":
        """Sum several sparse gradients of one group in one row space (gradient accumulation
        over micro-batches)."""
        if len(grads) == 1:
            return grads[0].wait()
        space = grads[0].space
        assert all(g.space is space for g in grads), "sparse gradients of different row spaces"
        for g in grads:
            g.wait()
        ids, inverse = torch.unique(torch.cat([g.ids for g in grads]), return_inverse=True)
        rows = torch.zeros(ids.numel(), grads[0].rows.shape[1], dtype=torch.float32)
        rows.index_add_(0, inverse, torch.cat([g.rows for g in grads]))
        return SparseGrad(ids, rows, space)


class PendingGrads:
    """The sparse gradients a table group received since its optimizer last stepped.

    Backward adds one per lookup (:meth:`add`); an exchange may replace them all by the reduced
    gradient this process applies (:meth:`set`); the optimizer takes their sum (:meth:`take`).
    """

    def __init__(self) -> None:
        self._grads: list[SparseGrad] = []

    def __len__(self) -> int:
        return len(self._grads)

    def add(self, grad: SparseGrad) -> None:
        self._grads.append(grad)

    def set(self, grad: SparseGrad) -> None:
        self._grads = [grad]

    def clear(self) -> None:
        self._grads = []

    def take(self) -> SparseGrad | None:
        """The sum of the pending gradients (``None`` if there are none); the queue is emptied."""
        if not self._grads:
            return None
        grads, self._grads = self._grads, []
        return SparseGrad.coalesce(grads)
