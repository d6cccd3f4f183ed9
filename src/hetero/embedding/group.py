"""Table groups: tables of one width and dtype stored, looked up and updated together.

A :class:`TableGroup` owns one host storage of shape ``(sum of vocab sizes, D)``; each table's
``weight`` is a view of its row range (FBGEMM's "table-batched embedding" layout). A lookup of
any number of the group's tables is one :class:`~hetero.embedding.plan.LookupPlan` (built by
:mod:`hetero.embedding.plan`) - one id check, one dedup, one gather, one host->device copy, one
pooling op - its gradient is captured by :mod:`hetero.embedding.capture` into ``pending``, and the
optimizer updates the group in one kernel call. Where the rows live is the group's ``exchange``
(:mod:`hetero.embedding.exchange`). This module holds the storage and the local lookup.

Separate weight and state arrays were kept over an interleaved ``[w | m | v]`` row: on this
project's 2-core benchmark machine interleaving gained about 10% on the LazyAdam update but would
tie the table's memory layout to its optimizer (and put optimizer state into every model
``state_dict``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hetero.dynamic import KeyMap, Keys
from hetero.embedding.capture import HostPool, capture_device_grad
from hetero.embedding.config import TableConfig, init_rows
from hetero.embedding.dedup import GroupDedup
from hetero.embedding.dynamic_rows import DynamicRows
from hetero.embedding.exchange import LocalRows, RowExchange, RowPlacement
from hetero.embedding.grad import PendingGrads, SparseGrad
from hetero.embedding.kernels import dedup_kernels, kernels, num_threads
from hetero.embedding.plan import LookupPlan, Request, build_plan, fake_output
from hetero.placement import StorageTier, copy_to, host_empty
from hetero.storage.tier import SsdRows

# Groups of this many bytes of rows or more dedup by sorting (the update then walks their rows in
# address order), smaller ones through a marker (first-occurrence order): measured in
# hetero.embedding._numba_dedup's docstring, the sort wins from 16M rows of 64 bytes.
SORTED_DEDUP_BYTES = 1 << 30


class GroupedTable(Protocol):
    """What a group holds of each of its tables (a :class:`~hetero.embedding.table.HostEmbedding`):
    its config and weight, and the group's place for it, which the group sets."""

    config: TableConfig
    weight: torch.nn.Parameter
    init_seed: int  # seeds its initial rows (init_rows)
    keymap: KeyMap | None  # a dynamic table's keys -> rows (None: a fixed table)
    group_row: int
    group: Any  # the TableGroup itself (set here)


class TableGroup:
    """Shared host storage of tables with equal ``embedding_dim`` and dtype.

    Not constructed by users: every :class:`HostEmbedding` starts in a group of its own, and a
    :class:`HostEmbeddingCollection` merges its tables into groups.
    """

    def __init__(self, tables: list[GroupedTable]) -> None:
        dims = {(t.config.embedding_dim, t.weight.dtype) for t in tables}
        assert len(dims) == 1, f"a group holds one width and dtype, got {dims}"
        self.dim, self.dtype = dims.pop()
        self.tables = list(tables)
        total = sum(t.config.num_rows for t in tables)
        deferred = any(t.weight.is_meta for t in tables)  # rows held elsewhere (hetero.ps)
        if len(tables) == 1:
            storage = tables[0].weight.data
        elif deferred:
            storage = torch.empty((total, self.dim), dtype=self.dtype, device="meta")
        else:
            storage = host_empty((total, self.dim), self.dtype)
        start = 0
        for t in tables:
            v = t.config.num_rows
            if storage is not t.weight.data:
                storage[start : start + v].copy_(t.weight.data)
                t.weight.data = storage[start : start + v]  # the table's parameter becomes a view
            t.group_row = start  # the table's first row in the group's storage
            t.group = self
            start += v
        self.storage = storage
        self.first_row = 0  # the global row of storage row 0 (a row-sharded group: its shard's start)
        # the SSD tier: the rows' settings, and the rows once laid out (ssd_rows)
        self.ssd_config = tables[0].config.ssd if tables[0].config.storage is StorageTier.SSD else None
        assert all(t.config.ssd == self.ssd_config for t in tables), "a group's tables share one SSD tier"
        self.ssd: SsdRows | None = None
        self.ssd_state: dict[str, tuple[bool, float]] | None = None  # the declared layout (ssd_layout)
        # what the tier's first rows are when storage row r is not global row first_row + r: a parameter
        # server's hash shard (set by hetero.ps.shard_tables; rows [lo, hi) -> (hi - lo, dim) tensor)
        self.initial_rows: Callable[[int, int], Tensor] | None = None
        # False: the state dicts (the tables', their optimizer's) leave this group's rows out - a checkpoint
        # holds them on its own, as the SSD tier's snapshots (set by hetero.train for its groups on the tier)
        self.rows_in_state_dict = True
        # False: lookups are deduped as the plan is built, without occurrence chains (a row-sharded
        # group, or rows held elsewhere: their gradient arrives coalesced per unique row)
        self.local_dedup = not deferred
        # where the rows live: replaced by hetero.parallel.shard_rows or hetero.ps.shard_tables
        self.exchange: RowExchange = LocalRows(total)
        # the dedup's marker (8 bytes a row; empty: the group sorts), stamp and scratch, reused
        small = total * self.dim * self.dtype.itemsize < SORTED_DEDUP_BYTES
        self.deduper = GroupDedup(total if self.local_dedup and small else 0)
        self.pending = PendingGrads()  # gradients of this step's lookups, until the optimizer steps
        self.version = 0  # optimizer updates applied so far
        self.row_version: np.ndarray | None = None  # per-row update version, while prefetching
        dynamic = [t for t in tables if t.config.keys is Keys.DYNAMIC]
        self.dynamic = DynamicRows([t.config.name for t in dynamic],  # (their default rows: the last of each)
                                   np.array(sorted(t.group_row + t.config.num_embeddings for t in dynamic), np.int64))

    @property
    def num_rows(self) -> int:
        """Rows this process holds (a row-sharded group: its shard's)."""
        return self.storage.shape[0]

    def place(self, exchange: RowExchange, storage: Tensor | None = None, first_row: int = 0,
              initial_rows: Callable[[int, int], Tensor] | None = None, ssd: SsdRows | None = None,
              views: bool = True) -> None:
        """Where the group's rows live from now on - the one way another package changes it
        (:func:`hetero.parallel.shard_rows`, :meth:`hetero.ps.PSJob.shard_tables`): ``exchange``
        serves the lookups; ``storage`` (given) holds this process's rows from global row
        ``first_row`` (``meta``: on the SSD tier), each table's ``weight`` becoming its view of them
        (possibly empty; ``views=False``: a server's hash shard, not a block of rows, the weights
        stay placeholders); ``initial_rows`` are the tier's first rows where they are not the
        seeds' at ``first_row`` (a server's shard); ``ssd``: rows laid out already.
        Rows not held whole here are deduplicated as the plan is built (their gradient arrives
        coalesced per unique row)."""
        if storage is not None:
            hi = first_row + storage.shape[0]
            for t in self.tables if views else ():
                a, b = min(max(t.group_row, first_row), hi), min(max(t.group_row + t.config.num_rows, first_row), hi)
                t.weight.data = storage[a - first_row : b - first_row]  # (the table's rows here)
            self.storage, self.first_row = storage, first_row
        self.initial_rows = initial_rows if initial_rows is not None else self.initial_rows
        self.ssd = ssd if ssd is not None else self.ssd
        self.exchange = exchange
        if not exchange.placement.rows_here:
            self.local_dedup, self.deduper = False, GroupDedup(0)

    def checkpoint_rows_apart(self) -> None:
        """Leave the rows (and their optimizer state) out of the state dicts: a checkpoint holds
        them on its own, as the SSD tier's snapshots (:mod:`hetero.train.tier`)."""
        self.rows_in_state_dict = False

    def local_start(self, table: GroupedTable) -> int:
        """The storage row of ``table``'s first row here (its ``weight`` holds the table's rows in
        this process: all of them, or a row-sharded group's part)."""
        return min(max(table.group_row - self.first_row, 0), self.num_rows)

    def local_weight(self) -> Tensor:
        """Every row this process holds (``(num_rows, dim)``): the storage, or a copy read from the SSD
        tier (tables that fit in memory)."""
        return self.ssd_read(0, self.num_rows, ("weight",))["weight"] if self.ssd_config is not None else self.storage

    def read_rows(self, rows: Tensor, out: Tensor | None = None) -> Tensor:
        """Copies of storage rows ``rows`` (int64, repeats allowed: a row-sharded owner serving
        several ranks' lookups): from the storage, or through the SSD row cache (misses read from
        disk). ``out``: an earlier call's tensor to reuse (resized to ``(N, dim)``)."""
        if out is not None:
            out.resize_(rows.numel(), self.dim)
        if self.ssd_config is None:
            return torch.index_select(self.storage, 0, rows, out=out)
        unique, inverse = dedup_kernels().sorted_unique(rows.numpy())  # (the cache takes each row once)
        slots = torch.from_numpy(self.ssd_rows().cache.acquire(unique))
        return torch.index_select(self.ssd.cache.fields["weight"], 0, slots[torch.from_numpy(inverse)], out=out)

    # ------------------------------------------------------------------------------ SSD tier
    @property
    def ssd_here(self) -> bool:
        """Whether this process holds rows of the group on the SSD tier (a parameter-server worker
        holds none: its servers do, and its placeholders stay ``meta``, as in memory)."""
        return self.ssd_config is not None and self.exchange.placement is not RowPlacement.PARAMETER_SERVER

    def ssd_rows(self) -> SsdRows:
        """The group's rows on the SSD tier. The first call lays them out - writes the initial rows
        (each table's seeded values) with the declared state (:meth:`ssd_layout`; none: the row
        alone) - unless a checkpoint was restored first (:meth:`ssd_restore`).

        Raises:
            ValueError: on a parameter-server worker, which holds none of the rows (its tier
                would hold the initial rows, not the servers').
        """
        assert self.ssd_config is not None, "not a group on the SSD tier"
        if not self.ssd_here:
            raise ValueError(f"the rows of tables {[t.config.name for t in self.tables]} live on the parameter "
                             f"servers' SSD tier, not in this worker: read them from a checkpoint (hetero checkpoint "
                             f"merge)")
        if self.ssd is None:
            self.ssd = SsdRows(self.ssd_name, self.num_rows, self.dim, self.dtype, self.ssd_config,
                               self.initial_rows or self._initial_rows,
                               self.ssd_state or {})
        return self.ssd

    def ssd_layout(self, state: dict[str, tuple[bool, float]]) -> None:
        """Declare the records' state (name -> (one value per row, initial value): the sparse
        optimizer's). Rows already laid out are re-laid out now (one sequential pass); otherwise
        it applies when they are first needed, so a resume that restores a checkpoint before any
        lookup writes no initial rows."""
        self.ssd_state = dict(state)
        if self.ssd is not None:
            self.ssd = SsdRows.for_state(self.ssd, state)

    @property
    def ssd_name(self) -> str:
        """The name of the group's store on the SSD tier: its tables' names joined."""
        name = "-".join(t.config.name for t in self.tables)
        if len(name) > 100:  # (a file name has at most 255 bytes): the first and last table, and a digest of all
            name = f"{self.tables[0].config.name}-{self.tables[-1].config.name}-{zlib.crc32(name.encode()):08x}"
        return name

    def _initial_rows(self, lo: int, hi: int) -> Tensor:
        """Storage rows ``[lo, hi)`` as the tables' seeds make them (:func:`init_rows`)."""
        lo, hi = lo + self.first_row, hi + self.first_row  # (global rows)
        out = torch.empty(hi - lo, self.dim, dtype=self.dtype)
        for t in self.tables:
            a, b = max(lo, t.group_row), min(hi, t.group_row + t.config.num_rows)
            if a < b:
                out[a - lo : b - lo] = init_rows(t.config, t.init_seed, a - t.group_row, b - t.group_row)
        return out

    def ssd_read(self, lo: int, n: int, names: tuple[str, ...] | None = None) -> dict[str, Tensor]:
        """Fields ``names`` (default: every one: ``weight``, then the optimizer's state) of storage
        rows ``[lo, lo + n)``, copies."""
        return self.ssd_rows().read(lo, lo + n, names)

    def ssd_assign(self, name: str, lo: int, values: Tensor) -> None:
        """Set field ``name`` of storage rows ``[lo, lo + len(values))`` (a loaded checkpoint)."""
        self.ssd_rows().assign(name, lo, values)

    def ssd_checkpoint(self, dest: Path) -> dict:
        """Snapshot the rows on the SSD tier into the new directory ``dest``
        (:meth:`SsdRows.checkpoint`); returns its manifest."""
        return self.ssd_rows().checkpoint(dest, self.first_row)

    def ssd_restore(self, parts: list[tuple[Path, dict]]) -> None:
        """The rows on the SSD tier from snapshots ``parts`` (:meth:`SsdRows.restore`), in the
        declared or current layout (the optimizer's state included), or, with none declared, as saved."""
        if self.ssd is None:  # (no initial rows written: the store is the snapshot's)
            self.ssd = SsdRows.from_snapshots(self.ssd_name, self.num_rows, self.dim, self.dtype, self.ssd_config, parts,
                                              self.first_row, self.ssd_state)
        else:
            self.ssd.restore(parts, self.first_row)

    def plan(self, requests: list[Request], dedup: bool = True, chains: bool = True) -> LookupPlan:
        """:func:`~hetero.embedding.plan.build_plan` for this group (reads no table rows)."""
        return build_plan(self, requests, dedup, chains)

    def lookup(self, requests: list[Request], plan: LookupPlan | None = None) -> list[Tensor]:
        """Outputs of ``requests`` on the device of the first table's anchor (autograd-aware),
        wherever the rows live (``exchange``); ``plan``: one a prefetcher built.

        Fake ids (``torch._subclasses.FakeTensorMode``: :mod:`hetero.planner` capturing a model's
        costs) give outputs of the right shape that read no row."""
        if is_fake(requests[0].ids):
            return [fake_output(r) for r in requests]
        return self.exchange.lookup(self, requests, plan)

    def dedup(self, plan: LookupPlan, chains: bool = True) -> None:
        """:meth:`GroupDedup.dedup` of the plan's ids."""
        self.deduper.dedup(plan, chains)

    def pool_and_dedup(self, plan: LookupPlan, out: Tensor) -> None:
        """:meth:`GroupDedup.pool_and_dedup` over this group's (fp32) storage."""
        self.deduper.pool_and_dedup(plan, self.storage, out)

    # ------------------------------------------------------------------------------ rows
    def gather(self, plan: LookupPlan, pin: bool) -> Tensor:
        """Copy the plan's unique rows out of the table (the only read of the table per lookup)."""
        out = torch.empty(plan.unique.numel(), self.dim, dtype=self.dtype, pin_memory=pin)
        # Record the version before reading: an update racing with this gather is then seen as
        # newer than the gather and its rows are refreshed before use (conservative).
        plan.version = self.version
        if self.ssd_config is not None and not self._fits_cache(plan):  # (no update follows: read in pieces)
            self.ssd_rows().read_in_pieces(plan.unique.numpy(), out)
        elif self.ssd_config is not None:  # the rows into the cache (misses read ahead or from disk), then out of it
            slots = self._cached(plan)  # (lays the rows out on first use: before self.ssd is read)
            torch.index_select(self.ssd.cache.fields["weight"], 0, slots, out=out)
        else:
            torch.index_select(self.storage, 0, plan.unique, out=out)
        plan.rows = out
        return out

    def _fits_cache(self, plan: LookupPlan) -> bool:
        """Whether the plan's rows go through the SSD row cache at once (a step updates them: with
        gradients on they must fit); an evaluation or predict batch of more is read in pieces."""
        return torch.is_grad_enabled() or plan.unique is None or len(plan.unique) <= self.ssd_rows().cache.capacity

    def _cached(self, plan: LookupPlan) -> Tensor:
        """The cache slots of the plan's unique rows on the SSD tier (misses read ahead or from
        disk), resident until the cache's next acquire."""
        slots = self.ssd_rows().cache.acquire(plan.unique.numpy(), staged=plan.staged)
        plan.staged = None  # (used: its memory goes)
        return torch.from_numpy(slots)

    def refresh_stale(self, plan: LookupPlan) -> int:
        """Re-gather the rows an optimizer step updated after ``plan`` gathered them.

        The prefetch read-after-write fix: returns how many rows were refreshed.
        """
        plan.await_device_copy()
        if self.row_version is None or self.version - plan.version <= plan.max_staleness:
            return 0
        stale = torch.from_numpy(dedup_kernels().stale_positions(self.row_version, plan.unique.numpy(), plan.version, num_threads()))
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

    def lookup_local(self, requests: list[Request], plan: LookupPlan | None = None) -> list[Tensor]:
        """:meth:`lookup` when every row is in this process's storage (:class:`LocalRows`)."""
        anchor = requests[0].table._device_anchor
        device, dtype = anchor.device, anchor.dtype
        # The device is the host and the table fp32: the pooling reads the table at the ids and
        # does not need the dedup, so the kernel runs both at once (the dedup is serial).
        fused = plan is None and device.type == "cpu" and self.dtype == torch.float32 and self.local_dedup
        # Occurrence chains: only the host pooling's backward uses them (the device's arrives coalesced).
        chains = device.type == "cpu"
        if plan is None:
            plan = self.plan(requests, dedup=not fused, chains=chains)
        elif plan.unique is None and not (device.type == "cpu" and self.dtype == torch.float32):
            self.dedup(plan, chains)  # a plan built with dedup=False, used where the pooling cannot do it
        if device.type == "cpu":
            # The backward of HostPool hands the gradient (per id; the optimizer coalesces it as
            # it updates) to this group itself; the zero-size sink only puts the op on the tape.
            sink = torch.empty(0, requires_grad=torch.is_grad_enabled())
            if self.dtype == torch.float32 and plan.rows is None and self.ssd_config is None:
                # The device is the host: pool straight from the table rows (read at this moment,
                # so always fresh); there is nothing to transfer, hence no staging copy.
                rows, index = self.storage, plan.index
            elif self.dtype == torch.float32 and plan.rows is None and self._fits_cache(plan):
                # The same on the SSD tier: pool straight from the cache, at each id's slot (the
                # slots stay resident until the cache's next acquire: this step's update)
                plan.version = self.version
                index = self._cached(plan)[plan.inverse]
                rows = self.ssd.cache.fields["weight"]
            else:
                rows, index = (self.gather(plan, pin=False) if plan.rows is None else plan.rows), plan.inverse
                self.refresh_stale(plan)
            outs = HostPool.apply(rows, index, plan.offsets, plan.scale, sink, self, plan)
            return [o.to(dtype) for o in outs]
        else:
            plan.await_device_copy()
            if plan.rows is None:
                self.gather(plan, pin=True)  # (a plan prefetched without its rows: read now, after the update)
            else:
                self.refresh_stale(plan)
            rows = plan.rows_device if plan.rows_device is not None else copy_to(plan.rows, device)  # host -> device: U rows
            rows = rows.to(dtype)
            if torch.is_grad_enabled():
                rows.requires_grad_(True)
                rows.register_hook(lambda grad, unique=plan.unique: capture_device_grad(self, unique, grad))
            return plan.pool(rows)

    # ------------------------------------------------------------------------------ grads
    def pop_sparse_grad(self) -> SparseGrad | None:
        """The sum of the gradients pending since the last call (``None`` if none)."""
        return self.pending.take()

    def note_update(self, rows: Tensor) -> None:
        """Called by optimizers after updating ``rows``: advances the version for prefetch checks."""
        self.version += 1
        if self.row_version is not None:
            dedup_kernels().stamp_rows(self.row_version, rows.numpy(), self.version)

    def reset_rows(self, rows: Tensor, values: Tensor) -> None:
        """Group rows ``rows`` (``(A,)`` int64; row-sharded, this rank's own) belong to new keys of a
        dynamic table: they take ``values`` (``(A, dim)`` float32) now, and their optimizer state starts
        afresh at the next step (:meth:`DynamicRows.begin_step`; on the SSD tier now, :meth:`SsdRows.reset`)."""
        here = rows - self.first_row  # (storage rows)
        if self.ssd_config is not None:
            return self.ssd_rows().reset(here.numpy(), values.to(self.dtype))  # (row and fresh state, now)
        self.storage.index_copy_(0, here, values.to(self.dtype))  # (faster than storage[here] = values)
        self.dynamic.add_fresh(here.numpy())

    def track_row_versions(self) -> None:
        if self.row_version is None:
            self.row_version = np.zeros(self.num_rows, np.int64)
