"""Table groups: tables of one width and dtype stored, looked up and updated together.

A :class:`TableGroup` owns one host storage of shape ``(sum of vocab sizes, D)``; each table's
``weight`` is a view of its row range (FBGEMM's "table-batched embedding" layout). A lookup of
any number of the group's tables is one :class:`LookupPlan` - one id check, one dedup, one gather,
one host->device copy, one pooling op - and the optimizer updates the group in one kernel call.

Separate weight and state arrays were kept over an interleaved ``[w | m | v]`` row: on this
project's 2-core benchmark machine interleaving gained about 10% on the LazyAdam update but would
tie the table's memory layout to its optimizer (and put optimizer state into every model
``state_dict``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hetero.embedding.config import Pooling
from hetero.embedding.kernels import kernels
from hetero.placement import copy_to, host_empty

if TYPE_CHECKING:
    from hetero.embedding.table import HostEmbedding, SparseGrad


@dataclasses.dataclass
class Request:
    """One table's part of a lookup: its ids, optional bag offsets, and the output shape."""

    table: "HostEmbedding"
    ids: Tensor
    offsets: Tensor | None = None


@dataclasses.dataclass
class LookupPlan:
    """Host-side index work of one lookup; it reads no table values.

    Attributes:
        unique: ``(U,)`` int64 group rows, first-occurrence order. ``None`` (and so are
            ``inverse``, ``first`` and ``next``) in a plan built with ``dedup=False`` until the
            lookup's pooling kernel has deduplicated alongside (the host-device case; under
            ``torch.no_grad()`` it stays ``None``: nothing needs the dedup without a backward).
        inverse: ``(N,)`` int64 position in ``unique`` of each looked-up id.
        first: ``(U,)`` int64 position of each unique id's first occurrence; ``next``: ``(N,)``
            int64 position of the next occurrence of the same id, -1 at the last (the
            occurrence chains the optimizer kernels sum per-id gradients along).
        index: ``(N,)`` int64 group row of each looked-up id (``unique[inverse]``); for a lookup
            of one table at group row 0, the caller's ids themselves (read-only).
        offsets: ``(num_bags + 1,)`` int64 bag boundaries over the ``N`` ids, or empty when every
            id is its own bag (only per-id lookups).
        scale: ``(N,)`` float32 per-id weight (``1/len(bag)`` for mean pooling), or ``None``.
        bag_ranges: per request, its ``[start, end)`` range of bags and output shape.
        version: the group's update count when the rows were gathered (prefetch).
    """

    unique: Tensor | None
    inverse: Tensor | None
    first: Tensor | None
    next: Tensor | None
    index: Tensor
    offsets: Tensor
    scale: Tensor | None
    bag_ranges: list[tuple[int, int, tuple[int, ...]]]
    version: int = -1
    rows: Tensor | None = None  # gathered rows (host, pinned on CUDA) once gather() ran
    rows_device: Tensor | None = None  # their device copy, when prefetched
    copy_done: "torch.cuda.Event | None" = None  # end of the prefetch host->device copy
    max_staleness: int = 0  # optimizer steps the gathered rows may lag behind
    refreshed: int = 0  # rows gathered again because an update overtook the prefetch


class TableGroup:
    """Shared host storage of tables with equal ``embedding_dim`` and dtype.

    Not constructed by users: every :class:`HostEmbedding` starts in a group of its own, and a
    :class:`HostEmbeddingCollection` merges its tables into groups.
    """

    def __init__(self, tables: list["HostEmbedding"]) -> None:
        dims = {(t.config.embedding_dim, t.weight.dtype) for t in tables}
        assert len(dims) == 1, f"a group holds one width and dtype, got {dims}"
        self.dim, self.dtype = dims.pop()
        self.tables = list(tables)
        total = sum(t.config.num_embeddings for t in tables)
        deferred = any(t.weight.is_meta for t in tables)  # rows held elsewhere (hetero.ps)
        if len(tables) == 1:
            storage = tables[0].weight.data
        elif deferred:
            storage = torch.empty((total, self.dim), dtype=self.dtype, device="meta")
        else:
            storage = host_empty((total, self.dim), self.dtype)
        start = 0
        for t in tables:
            v = t.config.num_embeddings
            if storage is not t.weight.data:
                storage[start : start + v].copy_(t.weight.data)
                t.weight.data = storage[start : start + v]  # the table's parameter becomes a view
            t.group_row = start  # the table's first row in the group's storage
            t.group = self
            start += v
        self.storage = storage
        # dedup scratch: 8 bytes per row; None for a row-sharded group (``torch.unique`` instead:
        # a marker over the global row space on every rank would not shrink with more ranks)
        self.marker: np.ndarray | None = None if deferred else np.zeros(total, np.int64)
        # set by hetero.parallel.shard_rows or hetero.ps.shard_tables: the lookup talks to other ranks
        self.exchange = None
        self.stamp = 0
        self._last = np.empty(0, np.int64)  # dedup scratch, reused (under the lock)
        self.lock = threading.Lock()  # the marker is shared by every lookup of the group
        self.pending: list["SparseGrad"] = []
        self.version = 0  # optimizer updates applied so far
        self.row_version: np.ndarray | None = None  # per-row update version, while prefetching

    @property
    def num_rows(self) -> int:
        return self.storage.shape[0]

    # ------------------------------------------------------------------------------ plan
    def plan(self, requests: list[Request], dedup: bool = True) -> LookupPlan:
        """Check, globalize and dedup the ids of ``requests``; build bags. Reads no table rows.

        ``dedup=False`` leaves the dedup to the lookup, which then runs it beside the pooling
        (only where the device is the host and the table fp32, see :meth:`lookup`).

        Raises:
            IndexError: an out-of-range id of a table that is not ``hashed``, naming the table,
                the id and the vocab size; raised before any state changes.
            ValueError: bad dtype or offsets.
        """
        K = kernels()
        flat, offsets, lengths, ranges = [], [], [], []
        n = bags = 0
        singleton = all(r.offsets is None and r.table.config.pooling is Pooling.NONE for r in requests)
        for r in requests:
            cfg = r.table.config
            if r.ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"table {cfg.name!r}: ids must be int64 or int32, got {r.ids.dtype}")
            ids = r.ids.to("cpu", torch.int64).reshape(-1)  # sync point if ids live on the device
            if singleton:  # per-id lookups: bag i is id i, no offsets needed
                ranges.append((n, n + ids.numel(), tuple(r.ids.shape)))
            else:
                off, shape = _bags(r, ids.numel())
                lengths.append(off[1:] - off[:-1])
                offsets.append(off[:-1] + n)
                ranges.append((bags, bags + len(lengths[-1]), shape))
                bags += len(lengths[-1])
            flat.append(ids)
            n += ids.numel()
        ids = flat[0] if len(flat) == 1 else torch.cat(flat)
        seg = np.zeros(len(requests) + 1, np.int64)
        np.cumsum([f.numel() for f in flat], out=seg[1:])
        vocab, row_offset, hashed = self._segment_meta(requests)
        if len(requests) == 1 and row_offset[0] == 0 and not hashed[0]:
            # The ids are the group rows already: check them in place (no copy; ``index`` may
            # then share memory with the caller's ids, read-only).
            rows = ids.numpy()
            bad = K.first_out_of_range(rows, vocab[0])
        else:
            rows = np.empty(n, np.int64)
            bad = K.globalize(ids.numpy(), seg, vocab, row_offset, hashed, rows)
        if bad >= 0:
            s = int(np.searchsorted(seg, bad, side="right") - 1)
            requests[s].table.raise_out_of_range(int(ids[bad]))
        dedup_out = (None,) * 4
        if self.marker is None:
            unique_t, inverse_t = torch.unique(torch.from_numpy(rows), return_inverse=True)
            no_chain = torch.empty(0, dtype=torch.int64)  # no occurrence chains: the gradient arrives coalesced
            dedup_out = (unique_t, inverse_t, no_chain, no_chain)
        scale = None
        if singleton:
            all_offsets = torch.empty(0, dtype=torch.int64)
        else:
            all_offsets = torch.cat([*offsets, torch.tensor([n])])
            if any(r.table.config.pooling is Pooling.MEAN for r in requests):
                per_bag = [(ln.clamp(min=1).reciprocal() if r.table.config.pooling is Pooling.MEAN else torch.ones(len(ln)))
                           for r, ln in zip(requests, lengths)]
                scale = torch.cat(per_bag).to(torch.float32).repeat_interleave(torch.cat(lengths))
        plan = LookupPlan(*dedup_out, torch.from_numpy(rows), all_offsets, scale, ranges)
        if dedup and self.marker is not None:
            self.dedup(plan)
        return plan

    def _dedup_scratch(self, n: int) -> tuple[int, np.ndarray]:
        """A fresh stamp and the ``last`` scratch of :func:`dedup` for ``n`` ids (under the lock)."""
        self.stamp += 1
        if self.stamp >= 1 << 31:  # the stamp lives in the upper 32 bits of the marker
            self.marker[:] = 0
            self.stamp = 1
        if self._last.shape[0] < n:
            self._last = np.empty(max(n, 2 * self._last.shape[0]), np.int64)
        return self.stamp, self._last

    def dedup(self, plan: LookupPlan) -> None:
        """Fill ``unique``, ``inverse``, ``first`` and ``next`` of a plan built with ``dedup=False``."""
        with self.lock:
            found = kernels().dedup(plan.index.numpy(), self.marker, *self._dedup_scratch(plan.index.numel()))
        plan.unique, plan.inverse, plan.first, plan.next = map(torch.from_numpy, found)

    def pool_and_dedup(self, plan: LookupPlan, out: Tensor) -> None:
        """Pool the table's rows at ``plan.index`` into ``out`` and dedup ``plan.index`` at the
        same time (one kernel), filling the plan's ``unique``, ``inverse``, ``first`` and ``next``."""
        K = kernels()
        scale = plan.scale.numpy() if plan.scale is not None else np.empty(0, np.float32)
        index = plan.index.numpy()
        with self.lock:
            stamp, last = self._dedup_scratch(index.shape[0])
            found = K.dedup_pool(index, self.marker, stamp, last, self.storage.numpy(), plan.offsets.numpy(), scale,
                                 out.numpy(), K.num_threads())
        plan.unique, plan.inverse, plan.first, plan.next = map(torch.from_numpy, found)

    def _segment_meta(self, requests: list[Request]):
        vocab = np.array([r.table.config.num_embeddings for r in requests], np.int64)
        offset = np.array([r.table.group_row for r in requests], np.int64)
        hashed = np.array([r.table.config.hashed for r in requests], np.bool_)
        return vocab, offset, hashed

    # ------------------------------------------------------------------------------ rows
    def gather(self, plan: LookupPlan, pin: bool) -> Tensor:
        """Copy the plan's unique rows out of the table (the only read of the table per lookup)."""
        out = torch.empty(plan.unique.numel(), self.dim, dtype=self.dtype, pin_memory=pin)
        # Record the version before reading: an update racing with this gather is then seen as
        # newer than the gather and its rows are refreshed before use (conservative).
        plan.version = self.version
        torch.index_select(self.storage, 0, plan.unique, out=out)
        plan.rows = out
        return out

    def refresh_stale(self, plan: LookupPlan) -> int:
        """Re-gather the rows an optimizer step updated after ``plan`` gathered them.

        The prefetch read-after-write fix: returns how many rows were refreshed.
        """
        if plan.copy_done is not None:
            torch.cuda.current_stream().wait_event(plan.copy_done)  # device waits for the prefetch copy, not the host
            # Allocated on the side stream, used on this one: keep the allocator from handing the
            # memory to the side stream again before this stream's kernels that read it have run.
            plan.rows_device.record_stream(torch.cuda.current_stream())
            plan.copy_done = None
        if self.row_version is None or self.version - plan.version <= plan.max_staleness:
            return 0
        stale = torch.from_numpy(kernels().stale_positions(self.row_version, plan.unique.numpy(), plan.version))
        if stale.numel():
            fresh = self.storage.index_select(0, plan.unique[stale])
            plan.rows[stale] = fresh
            if plan.rows_device is not None:
                # host -> device copy of the refreshed rows only, ordered after the prefetch copy
                dev = plan.rows_device.device
                plan.rows_device[copy_to(stale, dev)] = copy_to(fresh, dev).to(plan.rows_device.dtype)
        plan.version = self.version
        plan.refreshed += stale.numel()
        return stale.numel()

    def lookup(self, requests: list[Request], plan: LookupPlan | None = None) -> list[Tensor]:
        """Outputs of ``requests`` on the device of the first table's anchor (autograd-aware)."""
        if self.exchange is not None:
            return self.exchange.lookup(self, requests)
        anchor = requests[0].table._device_anchor
        device, dtype = anchor.device, anchor.dtype
        # The device is the host and the table fp32: the pooling reads the table at the ids and
        # does not need the dedup, so the kernel runs both at once (the dedup is serial).
        fused = plan is None and device.type == "cpu" and self.dtype == torch.float32 and self.marker is not None
        if plan is None:
            plan = self.plan(requests, dedup=not fused)
        elif plan.unique is None and not (device.type == "cpu" and self.dtype == torch.float32):
            self.dedup(plan)  # a plan built with dedup=False, used where the pooling cannot do it
        if device.type == "cpu":
            # The backward of _HostPool hands the gradient (per id; the optimizer coalesces it as
            # it updates) to this group itself; the zero-size sink only puts the op on the tape.
            sink = torch.empty(0, requires_grad=torch.is_grad_enabled())
            if self.dtype == torch.float32 and plan.rows is None:
                # The device is the host: pool straight from the table rows (read at this moment,
                # so always fresh); there is nothing to transfer, hence no staging copy.
                rows, index = self.storage, plan.index
            else:
                rows, index = (self.gather(plan, pin=False) if plan.rows is None else plan.rows), plan.inverse
                self.refresh_stale(plan)
            pooled = _HostPool.apply(rows, index, plan.offsets, plan.scale, sink, self, plan).to(dtype)
        else:
            if plan.rows is None:
                self.gather(plan, pin=True)
            else:
                self.refresh_stale(plan)
            rows = plan.rows_device if plan.rows_device is not None else copy_to(plan.rows, device)  # host -> device: U rows
            rows = rows.to(dtype)
            if torch.is_grad_enabled():
                rows.requires_grad_(True)
                rows.register_hook(lambda grad, unique=plan.unique: self._capture_grad(unique, grad))
            return self.pool(rows, plan)
        return self.split_outputs(pooled, plan)

    def pool(self, rows: Tensor, plan: LookupPlan) -> list[Tensor]:
        """The per-request outputs of ``plan`` from its unique rows ``rows`` (``(U, D)``, on the
        output device and dtype): ``F.embedding_bag``, whose backward coalesces the gradient of
        repeated ids into one row per unique id."""
        dev = rows.device
        offsets = plan.offsets if plan.offsets.numel() else torch.arange(plan.inverse.numel() + 1)
        pooled = F.embedding_bag(
            copy_to(plan.inverse, dev), rows, copy_to(offsets, dev), mode="sum",
            per_sample_weights=None if plan.scale is None else copy_to(plan.scale, dev).to(rows.dtype),
            include_last_offset=True,
        )
        return self.split_outputs(pooled, plan)

    def split_outputs(self, pooled: Tensor, plan: LookupPlan) -> list[Tensor]:
        """The per-request outputs of the pooled ``(bags, D)`` result of ``plan``."""
        if len(plan.bag_ranges) == 1:  # no slicing: its backward would zero-fill and copy the gradient
            return [pooled.reshape(*plan.bag_ranges[0][2], self.dim)]
        parts = pooled.split([b - a for a, b, _ in plan.bag_ranges])
        return [p.reshape(*shape, self.dim) for p, (_, _, shape) in zip(parts, plan.bag_ranges)]

    # ------------------------------------------------------------------------------ grads
    def _capture_grad(self, unique: Tensor, grad: Tensor) -> None:
        from hetero.embedding.table import SparseGrad

        # Runs inside backward; ``grad`` is coalesced per unique row already.
        if grad.device.type == "cuda":
            rows = torch.empty(grad.shape, dtype=torch.float32, pin_memory=True)
            rows.copy_(grad, non_blocking=True)  # device -> host into pinned memory, async
            ready = torch.cuda.Event()
            ready.record()
            self.pending.append(SparseGrad(unique, rows, ready))
        else:
            self.pending.append(SparseGrad(unique, grad.detach().to(torch.float32)))

    def pop_sparse_grad(self) -> "SparseGrad | None":
        from hetero.embedding.table import SparseGrad

        if not self.pending:
            return None
        grads, self.pending = self.pending, []
        return SparseGrad.coalesce(grads)

    def note_update(self, rows: Tensor) -> None:
        """Called by optimizers after updating ``rows``: advances the version for prefetch checks."""
        self.version += 1
        if self.row_version is not None:
            kernels().stamp_rows(self.row_version, rows.numpy(), self.version)

    def track_row_versions(self) -> None:
        if self.row_version is None:
            self.row_version = np.zeros(self.num_rows, np.int64)


def _bags(r: Request, n: int) -> tuple[Tensor, tuple[int, ...]]:
    """Bag offsets ``(bags + 1,)`` of one request and the shape of its output (without ``D``)."""
    cfg = r.table.config
    if r.offsets is not None:
        if cfg.pooling is Pooling.NONE:
            raise ValueError(f"table {cfg.name!r}: offsets given but pooling is 'none'; use SUM or MEAN")
        off = r.offsets.to("cpu", torch.int64)
        if off.dim() != 1 or off.numel() < 1 or int(off[0]) != 0 or int(off[-1]) != n:
            raise ValueError(
                f"table {cfg.name!r}: offsets must be 1-D of length B + 1 with offsets[0] == 0 and "
                f"offsets[-1] == len(ids) == {n}, got {off.tolist()[:8]}"
            )
        # The kernels index ``ids`` by these bounds without checks: a decreasing pair would read
        # outside ``ids`` (wrong values or a crash). One vectorized pass over B + 1 values.
        down = off[1:] < off[:-1]
        if bool(down.any()):
            b = int(down.nonzero()[0])
            raise ValueError(f"table {cfg.name!r}: offsets must be non-decreasing (bag b is ids[offsets[b]:offsets[b + 1]]), "
                             f"got offsets[{b}] = {int(off[b])} > offsets[{b + 1}] = {int(off[b + 1])}")
        return off, (off.numel() - 1,)
    if cfg.pooling is Pooling.NONE:
        return torch.arange(n + 1), tuple(r.ids.shape)
    if r.ids.dim() != 2:
        raise ValueError(f"table {cfg.name!r}: pooled lookup without offsets needs 2-D ids (B, L), got {tuple(r.ids.shape)}")
    b, length = r.ids.shape
    return torch.arange(0, b * length + 1, max(length, 1)) if length else torch.zeros(b + 1, dtype=torch.int64), (b,)


class _HostPool(torch.autograd.Function):
    """Pool (or expand) unique rows into bags on the CPU with the numba kernels.

    The backward hands the group a :class:`SparseGrad` that keeps the gradient per id; the
    optimizer coalesces it into one row per unique id as it updates (no gradient flows to
    ``rows``, which is a copy). On CUDA, ``F.embedding_bag``'s backward coalesces on the device.
    """

    @staticmethod
    def forward(ctx, rows, index, offsets, scale, sink, group, plan):
        bags = offsets.numel() - 1 if offsets.numel() else index.numel()
        out = torch.empty(bags, rows.shape[1], dtype=torch.float32)
        if plan.unique is None and sink.requires_grad:  # rows is the fp32 table, index the ids: dedup as it pools
            group.pool_and_dedup(plan, out)  # (without grad, e.g. evaluation, nothing needs the dedup: pool only)
        else:
            scale_np = scale.numpy() if scale is not None else np.empty(0, np.float32)
            kernels().pool_forward(rows.detach().float().numpy(), index.numpy(), offsets.numpy(), scale_np, out.numpy())
        ctx.group, ctx.plan = group, plan  # index tensors only: nothing autograd needs to version-check
        return out  # fp32 whatever the storage dtype: the backward then receives an fp32 gradient

    @staticmethod
    def backward(ctx, grad_out):
        from hetero.embedding.table import SparseGrad

        plan = ctx.plan
        # Keep the gradient per id: the optimizer coalesces it and updates in one pass.
        src = grad_out.detach().float().contiguous()
        scale = plan.scale if plan.scale is not None else torch.empty(0)
        ctx.group.pending.append(SparseGrad(plan.unique, None, per_id=(src, plan.inverse, plan.offsets, scale),
                                            chain=(plan.first, plan.next)))
        return None, None, None, None, torch.empty(0), None, None
