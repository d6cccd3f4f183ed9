"""Lookup plans: the host-side index work of one lookup of a table group, which reads no rows.

A :class:`LookupPlan` of any number of a group's tables is one id check (or hash), one
globalization into the group's row space, one dedup and the bag layout (FBGEMM's "table-batched
embedding" lookup). :func:`build_plan` makes one; a prefetcher builds them a batch ahead.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hetero.dynamic import Keys
from hetero.embedding.config import Pooling, TableConfig
from hetero.embedding.kernels import dedup_kernels, kernels
from hetero.placement import copy_to
from hetero.storage.layout import StagedRecords


class PlannedTable(Protocol):
    """What a lookup plan reads of a table (a :class:`~hetero.embedding.table.HostEmbedding`)."""

    config: TableConfig
    group_row: int  # the table's first row in its group's row space

    def raise_out_of_range(self, bad: int) -> None: ...


class KeyRows(Protocol):
    """What :func:`build_plan` asks of a group's dynamic tables: the rows of their keys, one lookup's
    ``(table, keys)`` pairs at once."""

    def rows_of(self, lookups: list[tuple[PlannedTable, Tensor]]) -> list[Tensor]: ...


class DedupGroup(Protocol):
    """What :func:`build_plan` needs of a table group (a :class:`~hetero.embedding.group.TableGroup`)."""

    local_dedup: bool  # False: dedup as the plan is built, sorted, without chains (its gradient arrives coalesced)
    dynamic: KeyRows  # its dynamic tables' keys -> rows (hetero.embedding.dynamic_rows.DynamicRows)

    def dedup(self, plan: "LookupPlan", chains: bool = True) -> None: ...


@dataclasses.dataclass
class Request:
    """One table's part of a lookup: its ids, optional bag offsets, and the output shape.

    ``weights``: a pooled lookup's per-sample weights, ``(N,)`` floating, one per id (TorchRec's
    weighted ``KeyedJaggedTensor``): bag ``b`` pools ``sum_i weights[i] * row(ids[i])`` (times
    ``1/len(bag)`` for a mean). They take no gradient.
    """

    table: PlannedTable
    ids: Tensor
    offsets: Tensor | None = None
    weights: Tensor | None = None


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
        staged: a group on the SSD tier: the records of its uncached unique rows, read ahead by a
            prefetch worker (:meth:`~hetero.storage.cache.RowCache.stage`), or ``None``.
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
    inverse_device: Tensor | None = None  # the inverse map's device copy, when prefetched
    copy_done: "torch.cuda.Event | None" = None  # end of the prefetch host->device copy
    max_staleness: int = 0  # optimizer steps the gathered rows may lag behind
    refreshed: int = 0  # rows gathered again because an update overtook the prefetch
    staged: StagedRecords | None = None  # SSD tier: records read ahead (checked when used)

    def await_device_copy(self) -> None:
        """Order the current CUDA stream after the prefetcher's host->device copies (if any)."""
        if self.copy_done is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.copy_done)  # the device waits for the prefetch copy, not the host
        # Allocated on the side stream, used on this one: keep the allocator from handing the
        # memory to the side stream again before this stream's kernels that read it have run.
        for t in (self.rows_device, self.inverse_device):
            if t is not None:
                t.record_stream(stream)
        self.copy_done = None

    def pool(self, rows: Tensor) -> list[Tensor]:
        """The per-request outputs from the unique rows ``rows`` (``(U, D)``, on the output device
        and dtype): ``F.embedding_bag`` (``F.embedding`` when every id is its own bag), whose
        backward coalesces the gradient of repeated ids into one row per unique id."""
        dev = rows.device
        inverse = self.inverse_device if self.inverse_device is not None else copy_to(self.inverse, dev)
        if not self.offsets.numel() and self.scale is None:  # (no offsets to build and copy)
            return self.split(F.embedding(inverse, rows))
        offsets = self.offsets if self.offsets.numel() else torch.arange(self.inverse.numel() + 1)
        pooled = F.embedding_bag(
            inverse, rows, copy_to(offsets, dev), mode="sum",
            per_sample_weights=None if self.scale is None else copy_to(self.scale, dev).to(rows.dtype),
            include_last_offset=True,
        )
        return self.split(pooled)

    def split(self, pooled: Tensor) -> list[Tensor]:
        """The per-request outputs of the pooled ``(bags, D)`` result."""
        dim = pooled.shape[-1]
        if len(self.bag_ranges) == 1:  # no slicing: its backward would zero-fill and copy the gradient
            return [pooled.reshape(*self.bag_ranges[0][2], dim)]
        parts = pooled.split([b - a for a, b, _ in self.bag_ranges])
        return [p.reshape(*shape, dim) for p, (_, _, shape) in zip(parts, self.bag_ranges)]

    def outputs(self, pooled: Tensor) -> tuple[Tensor, ...]:
        """The per-request outputs of the pooled ``(bags, D)`` contiguous result as tensors of their
        own over its memory, not views of it: the outputs of a custom autograd Function
        (:class:`~hetero.embedding.capture.HostPool`), which autograd lets the caller modify in
        place only when they are not views. Each has its own gradient in the backward, so no
        split's backward (a zero-fill and a copy of the whole gradient) runs."""
        dim, storage, off = pooled.shape[-1], pooled.untyped_storage(), pooled.storage_offset()
        outs = []
        for a, b, shape in self.bag_ranges:
            size = (*shape, dim)
            stride = [1] * len(size)  # (contiguous strides of that shape)
            for i in range(len(size) - 2, -1, -1):
                stride[i] = stride[i + 1] * size[i + 1]
            outs.append(pooled.new_empty(0).set_(storage, off + a * dim, size, stride))
        return tuple(outs)



def build_plan(group: DedupGroup, requests: list[Request], dedup: bool = True, chains: bool = True) -> LookupPlan:
    """Check, globalize and dedup the ids of ``requests``; build bags. Reads no table rows.

    ``dedup=False`` leaves the dedup to the lookup, which then runs it beside the pooling
    (only where the device is the host and the table fp32, see :meth:`TableGroup.lookup_local`).
    ``chains=False``: no occurrence chains (``first``, ``next``), which only the host pooling's
    backward uses; the dedup may then run in parallel.

    Raises:
        IndexError: an out-of-range id of a table that is not ``hashed``, naming the table,
            the id and the vocab size; raised before any state changes.
        ValueError: bad dtype or offsets.
    """
    K = kernels()
    flat, offsets, lengths, ranges = [], [], [], []
    n = bags = 0
    per_id = [_per_id_shape(r) for r in requests]
    singleton = all(shape is not None for shape in per_id)
    for r in requests:
        if r.ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"table {r.table.config.name!r}: ids must be int64 or int32, got {r.ids.dtype}")
    given = [r.ids.to("cpu", torch.int64).reshape(-1) for r in requests]  # sync point if ids live on the device
    keyed = [i for i, r in enumerate(requests) if r.table.config.keys is Keys.DYNAMIC]
    if keyed:  # raw keys -> the tables' rows (one compiled pass a table; training admits; row-sharded, one exchange)
        for i, rows in zip(keyed, group.dynamic.rows_of([(requests[i].table, given[i]) for i in keyed])):
            given[i] = rows
    for r, ids, shape in zip(requests, given, per_id):
        if singleton:  # per-id lookups (or bags of one id): output row i is id i's row, no offsets needed
            ranges.append((n, n + ids.numel(), shape))
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
    vocab, row_offset, hashed = _segment_meta(requests)
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
    if not group.local_dedup:
        unique_t, inverse_t = map(torch.from_numpy, dedup_kernels().sorted_unique(rows))  # (as torch.unique: sorted)
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
        if any(r.weights is not None for r in requests):
            weights = torch.cat([_weights(r, ids.numel()) for r, ids in zip(requests, given)])
            scale = weights if scale is None else scale * weights
    plan = LookupPlan(*dedup_out, torch.from_numpy(rows), all_offsets, scale, ranges)
    if dedup and group.local_dedup:
        group.dedup(plan, chains)
    return plan


def _segment_meta(requests: list[Request]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    vocab = np.array([r.table.config.num_rows for r in requests], np.int64)
    offset = np.array([r.table.group_row for r in requests], np.int64)
    hashed = np.array([r.table.config.hashed for r in requests], np.bool_)
    return vocab, offset, hashed


def fake_output(request: Request) -> Tensor:
    """A fake lookup's output, of the shape the real one has: a row per bag (pooled: offsets'
    bags, or the rows of ``(B, L)`` ids), else ``ids.shape`` rows (per id); on the anchor's
    device, as a leaf that takes a gradient (what the backward would send to the host)."""
    table, anchor, ids = request.table, request.table._device_anchor, request.ids
    if table.config.pooling is Pooling.NONE:
        shape = tuple(ids.shape)
    elif request.offsets is not None:
        shape = (request.offsets.numel() - 1,)
    elif ids.dim() == 2:
        shape = (ids.shape[0],)
    else:
        raise ValueError(f"table {table.config.name!r}: pooled lookup without offsets needs 2-D ids (B, L), "
                         f"got {tuple(ids.shape)}")
    return torch.zeros(*shape, table.config.embedding_dim, dtype=anchor.dtype, device=anchor.device,
                       requires_grad=torch.is_grad_enabled())


def _per_id_shape(r: Request) -> tuple[int, ...] | None:
    """The output shape (without ``D``) of a request each of whose output rows is one id's row:
    per-id lookups, or pooled bags of exactly one id (``(B, 1)`` ids: a sum or a mean of one row is
    the row, so the bag machinery is skipped); ``None`` for any other."""
    if r.offsets is not None or r.weights is not None:
        return None
    if r.table.config.pooling is Pooling.NONE:
        return tuple(r.ids.shape)
    return (r.ids.shape[0],) if r.ids.dim() == 2 and r.ids.shape[1] == 1 else None


def _weights(r: Request, n: int) -> Tensor:
    """A request's per-id weights as ``(n,)`` float32 on the host (ones without weights)."""
    if r.weights is None:
        return torch.ones(n)
    name = r.table.config.name
    if r.table.config.pooling is Pooling.NONE:
        raise ValueError(f"table {name!r}: per-sample weights given but pooling is 'none'; they weight a bag's pooling "
                         f"(use SUM or MEAN, or drop the weights)")
    if not r.weights.is_floating_point() or r.weights.numel() != n:
        raise ValueError(f"table {name!r}: per-sample weights must be floating, one per id ({n}), got "
                         f"{r.weights.dtype} of shape {tuple(r.weights.shape)}")
    if r.weights.requires_grad:  # (the pooling kernels give them none: dropping it would be a silent wrong result)
        raise ValueError(f"table {name!r}: per-sample weights that require a gradient are not supported yet; detach "
                         f"them, or keep the table where their gradient is computed")
    return r.weights.detach().to("cpu", torch.float32).reshape(-1)  # sync point if the weights live on the device


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

