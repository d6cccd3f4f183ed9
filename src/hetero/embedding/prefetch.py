"""Prefetch pipeline: prepare the host side of batch i+1's lookups while batch i trains.

A worker thread takes the next batch, builds the lookup plans of every
:class:`~hetero.embedding.HostEmbeddingCollection` in the model (id checks and dedup, numba
kernels that release the GIL) and, when rows must travel, gathers them into a pinned staging
buffer and starts the host->device copy on a side CUDA stream (an event marks its end; the
compute stream waits on that event, not the host).

Tables on the SSD tier (:mod:`hetero.storage`): the worker reads ahead the records of the next
batch's rows that are not in the row cache (the disk reads, overlapped); the training thread takes
them into the cache when the batch is reached, each only if it is still its row's current record
(else read again), so these rows are never stale whatever ``max_staleness`` says.

Dynamic tables (:mod:`hetero.dynamic`) are not prepared ahead: translating a batch's keys admits
and evicts, which a step early would change what the current step's update reaches. Their groups
are looked up at their step, as without a prefetcher; the other groups are prepared ahead.

Read-after-write: rows gathered for batch i+1 may be updated by batch i's optimizer step
afterwards. Each group whose rows are gathered ahead keeps a per-row update version (only those:
it costs a random write per updated row); when batch i+1 is consumed, rows updated
after their gather are gathered again (and re-sent), so a lookup never sees a stale row unless
``max_staleness`` allows it. On a CPU-only machine fp32 tables are read in place at compute time
and cannot be stale; there only the id checks are prefetched (the dedup runs beside the pooling).

What is prepared ahead by default: the ids' checks and dedup and, with a GPU, the inverse map's
host->device copy; the rows themselves only where ``max_staleness`` lets them be stale. Gathering
them ahead as well (``gather_rows=True``) made the exact DLRM step slower on an H200 host (0.57
and 0.80 of its dense part, Zipf and uniform ids, against 0.67 and 0.86 without; the plain step
0.73 and 0.84): the rows the previous update overtook must be found and sent again on the
training thread (``benchmarks/dlrm_step.py``; docs/embedding.md).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future
from typing import Any

import torch
from torch import nn

from hetero.embedding.collection import HostEmbeddingCollection
from hetero.embedding.exchange import RowPlacement
from hetero.embedding.group import TableGroup
from hetero.embedding.plan import LookupPlan
from hetero.placement import copy_to
from hetero.placement.threads import ThreadContext, host_worker


def looked_up_at_step(model: nn.Module) -> list[str]:
    """The dynamic tables of ``model``'s collections, which a :class:`Prefetcher` leaves to their step
    (see the module docstring)."""
    return [n for m in model.modules() if isinstance(m, HostEmbeddingCollection) for g in m.groups
            for n in g.dynamic.tables]


def _read_in_place(group: TableGroup, device: torch.device) -> bool:
    """Whether ``group``'s lookups for ``device`` pool straight from the table (fp32 rows for the
    CPU): no rows are gathered, so none can be stale."""
    return device.type == "cpu" and group.dtype == torch.float32


@dataclasses.dataclass(frozen=True)
class PrefetchConfig:
    depth: int = 1  # batches prepared ahead of the one being trained
    max_staleness: int = 0  # optimizer steps a prefetched row may lag behind; 0 = never stale
    gather_rows: bool | None = None  # gather rows ahead; None = when they must travel and may be stale
    worker: bool = True  # False: prepare the next batch on the calling thread (same look-ahead, no overlap)


class Prefetcher:
    """Iterate ``batches`` with their embedding lookups prepared one step ahead on a worker thread.

    Args:
        model: the module whose :class:`HostEmbeddingCollection` s look up ``features(batch)``.
        batches: any iterable of batches.
        features: maps a batch to the feature mapping the collections receive. The model may
            receive another mapping around the same tensors; a lookup whose ids differ from the
            prepared ones (a batch skipped) is looked up afresh, never from the wrong plan.

    Raises:
        ValueError: ``depth < 1``, or a row-sharded table (its lookup is a collective).

    Yields the batches in order. Exceptions of the worker (an out-of-range id) are raised when
    the batch that caused them is reached, before anything of that batch is applied.
    """

    def __init__(self, model: nn.Module, batches: Iterable[Any], config: PrefetchConfig = PrefetchConfig(),
                 features: Callable[[Any], Mapping] = lambda b: b.features) -> None:
        if config.depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {config.depth}")
        self.config, self.features = config, features
        self.collections = [m for m in model.modules() if isinstance(m, HostEmbeddingCollection)]
        for c in self.collections:
            for g in c.groups:
                if g.dynamic.tables:
                    continue
                if g.exchange.placement is not RowPlacement.LOCAL:
                    raise ValueError(f"tables {[t.name for t in g.tables]} are {g.exchange.placement.value}: their lookup "
                                     f"talks to other ranks and cannot be prefetched; prefetch replicated tables only")
                if g.ssd_config is not None:
                    g.ssd_rows()  # laid out here, on the training thread: the worker only reads ahead
                elif self._gathers_ahead(g, g.tables[0].output_device):
                    # (only then: stamping each step's updated rows is a random write a row into a
                    # table-sized array, 15 ms a step of the CPU DLRM benchmark's 26 x 1M rows)
                    g.track_row_versions()
        self.batches = batches
        self.refreshed_rows = 0  # rows re-gathered because an update overtook their prefetch
        cuda = any(c.tables and next(iter(c.tables.values())).output_device.type == "cuda" for c in self.collections)
        self.stream = torch.cuda.Stream() if cuda else None

    def _gathers_ahead(self, group: TableGroup, device: torch.device) -> bool:
        """Whether the worker gathers ``group``'s rows ahead (then an update may overtake them, and
        the group tracks its rows' update versions): ``gather_rows``, or by default where the rows
        are not read in place for ``device`` (fp32 tables pooled on the CPU are) and may be stale."""
        if self.config.gather_rows is not None:
            return self.config.gather_rows
        return not _read_in_place(group, device) and self.config.max_staleness > 0

    def _prepare(self, batch: Any, context: ThreadContext) -> list[list[LookupPlan | None]]:
        # Runs on the worker thread: numba kernels (plan; parallel ones too: hetero selects numba's
        # threadsafe layer, hetero._numba) and torch ops (gather).
        with context.applied():  # the training thread's CUDA device (the side stream is ours)
            return self._prepare_batch(batch)

    def _prepare_batch(self, batch: Any) -> list[list[LookupPlan | None]]:
        feats = self.features(batch)
        out = []
        for c in self.collections:
            plans = []
            for group, reqs in zip(c.groups, c.requests(feats)):
                if group.dynamic.tables:  # (looked up at its step: its translation admits and evicts)
                    plans.append(None)
                    continue
                device = reqs[0].table.output_device
                if group.ssd is not None:
                    # The SSD tier: the cache belongs to the training thread, which gathers from it; here
                    # the uncached rows' records are read ahead (checked when used: never stale).
                    plan = group.plan(reqs, chains=device.type == "cpu")
                    plan.staged = group.ssd.cache.stage(plan.unique.numpy())
                    plans.append(plan)
                    continue
                in_place = _read_in_place(group, device)
                # (not gathered: exact, the rows are read at their step, after the update)
                gather = self._gathers_ahead(group, device)
                if gather and group.row_version is None:  # (an update could overtake them unseen: refused)
                    raise RuntimeError(f"tables {[t.name for t in group.tables]} moved to {device} after the "
                                       f"Prefetcher was built; build it after placing the model")
                # Rows read in place are deduplicated beside their pooling, on the training thread
                # (no extra pass there); a dedup here would only compete with it for the cores.
                plan = group.plan(reqs, dedup=gather or not in_place, chains=device.type == "cpu")
                plan.max_staleness = self.config.max_staleness
                if gather:
                    group.gather(plan, pin=device.type == "cuda")
                if self.stream is not None and device.type == "cuda":
                    with torch.cuda.stream(self.stream):  # host -> device on the side stream
                        if gather:
                            plan.rows_device = plan.rows.to(device, non_blocking=True)
                        plan.inverse_device = copy_to(plan.inverse, device)  # (pinned, then host -> device)
                        plan.copy_done = torch.cuda.Event()
                        plan.copy_done.record(self.stream)
                plans.append(plan)
            out.append(plans)
        return out

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.batches)
        pending: deque[tuple[Any, Future]] = deque()
        pool_cm = host_worker("hetero-prefetch") if self.config.worker else _Inline()
        with pool_cm as pool:
            def refill() -> None:
                while len(pending) < self.config.depth:
                    batch = next(it, None)
                    if batch is None:
                        return
                    pending.append((batch, pool.submit(self._prepare, batch, ThreadContext.capture())))

            try:
                refill()
                while pending:
                    batch, future = pending.popleft()
                    plans = future.result()  # sync point: wait for this batch's host-side preparation
                    feats = self.features(batch)
                    for c, p in zip(self.collections, plans):
                        c.prepare(feats, p)
                    refill()  # the next batch is prepared while this one trains
                    yield batch
                    self.refreshed_rows += sum(p.refreshed for ps in plans for p in ps if p is not None)
            finally:  # stopped early (max_steps, an error): drop plans nobody will consume
                for c in self.collections:
                    c.drop_prepared()


class _Inline(Executor):
    """Runs each submitted call at once on the calling thread (``PrefetchConfig(worker=False)``)."""

    def submit(self, fn, /, *args, **kwargs):  # noqa: ANN001, ANN201 - Executor API
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # delivered when the batch is reached, like the worker's errors
            future.set_exception(e)
        return future
