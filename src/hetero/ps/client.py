"""The worker side: lookups pull rows from the servers, optimizer steps push gradients.

A lookup of a table group on a worker (``group.exchange`` is a :class:`PSClient`):

1. check and dedup the batch's ids locally (``torch.unique``; out-of-range ids raise here,
   before anything is sent, naming the table);
2. in ``BOUNDED`` mode take the rows the :class:`RowCache` still holds; pull the others from
   their owners (``id % S``), one request per server, all servers in flight at once;
3. pool as a local table does: where the device is the host, with the host kernels
   (:class:`~hetero.embedding.capture.HostPool`, whose backward keeps the gradient per id and
   coalesces it into one row per unique id when the push takes it); on a device with
   ``F.embedding_bag``, whose backward leaves one gradient row per unique id.

A lookup can be started ahead (:meth:`PSClient.start`, through
``HostEmbeddingCollection.start``): its requests go out and the next lookup given the same plan
takes the replies, so that a model's second collection's servers work while the first's lookup
waits (Wide & Deep starts its deep tables before its wide ones). Each group's replies come on a
tag of its own (:func:`hetero.ps.transport.reply_tag`), so a worker may take them in any order; a
started pull nobody takes is read and dropped before the group's next request.

``PSSparse.step()`` takes every group's coalesced gradient rows; they go to their owners with
the group's next pull, in the same message (``Op.PUSH_PULL``: the server applies the push, then
reads the rows, the order a push and then a pull would have), to every server - empty if none of
its rows were touched, so that a ``SYNC`` server knows when a step is complete. So a training
step costs one message per server and group each way instead of two. Anything else a server
must see the update before (a key lookup, a checkpoint, the end of an epoch, the stop) sends the
push alone first (``PSSparse.flush``), waiting for the servers' receipts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hetero._numba import load
from hetero.dynamic import DynamicStats
from hetero.embedding import RowExchange, RowPlacement
from hetero.embedding.capture import HostPool
from hetero.embedding.dynamic_rows import KeyedTable
from hetero.embedding.exchange import RowSpace
from hetero.embedding.grad import PendingGrads, SparseGrad
from hetero.embedding.group import TableGroup
from hetero.embedding.plan import LookupPlan, Request
from hetero.placement import copy_to
from hetero.ps.keys import STATS, key_shards
from hetero.ps.transport import Channel, Op, encode, spec_bytes, unpack


class LookupGrad:
    """One lookup's unique group rows and, after backward, their gradient: the
    :class:`~hetero.embedding.capture.CaptureGroup` its pooling hands the gradient to."""

    def __init__(self, unique: Tensor) -> None:
        self.unique, self.pending = unique, PendingGrads()

    def pool_and_dedup(self, plan: LookupPlan, out: Tensor) -> None:
        raise AssertionError("a parameter-server lookup's plan is deduplicated before its rows are pulled")


class RowCache:
    """Rows a worker pulled, reused for at most ``staleness`` of its steps (``PSMode.BOUNDED``).

    Entries are kept sorted by id; an entry older than ``staleness`` steps is dropped at the next
    lookup, so a row used at step ``t`` was pulled at step ``t - staleness`` or later. Counters
    (``hits``, ``misses``, ``max_age``: the oldest entry ever used, in steps) make the bound
    observable.
    """

    def __init__(self, staleness: int) -> None:
        self.staleness = staleness
        self.ids = torch.empty(0, dtype=torch.int64)
        self.rows: Tensor | None = None
        self.born = torch.empty(0, dtype=torch.int64)
        self.hits = self.misses = self.max_age = 0

    def lookup(self, unique: Tensor, step: int) -> tuple[Tensor, Tensor | None]:
        """``(hit mask over unique, rows of the hits)`` for sorted unique ids at worker step ``step``."""
        fresh = step - self.born <= self.staleness
        if not bool(fresh.all()):
            self.ids, self.born, self.rows = self.ids[fresh], self.born[fresh], self.rows[fresh]
        hit = torch.zeros(unique.numel(), dtype=torch.bool)
        if self.ids.numel() == 0 or unique.numel() == 0:
            self.misses += unique.numel()
            return hit, None
        pos = torch.searchsorted(self.ids, unique).clamp(max=self.ids.numel() - 1)
        hit = self.ids[pos] == unique
        pos = pos[hit]
        if pos.numel():
            self.max_age = max(self.max_age, int((step - self.born[pos]).max()))
        self.hits += pos.numel()
        self.misses += unique.numel() - pos.numel()
        return hit, self.rows[pos]

    def insert(self, ids: Tensor, rows: Tensor, step: int) -> None:
        """Add rows pulled at ``step`` (ids not in the cache: they were misses)."""
        if ids.numel() == 0:
            return
        merged = torch.cat([self.ids, ids])
        order = torch.argsort(merged)
        self.ids = merged[order]
        self.born = torch.cat([self.born, torch.full((ids.numel(),), step, dtype=torch.int64)])[order]
        self.rows = (rows if self.rows is None else torch.cat([self.rows, rows]))[order]


class PSClient(RowExchange):
    """``group.exchange`` on a worker: the group's rows live on ``len(servers)`` servers.

    Its ``lookups`` are this step's lookups (:class:`LookupGrad`: their gradient arrives in
    backward); :meth:`push` sends their sum.

    Args:
        index: the group's position in the model's table groups (its name in requests).
        servers: the server ranks, shard ``s`` on ``servers[s]``.
        cache_staleness: ``None``: no cache (``SYNC``/``ASYNC``); else :class:`RowCache`'s bound.
    """

    placement = RowPlacement.PARAMETER_SERVER

    def __init__(self, group: TableGroup, index: int, servers: list[int], channel: Channel,
                 cache_staleness: int | None) -> None:
        self.group, self.index, self.servers, self.channel = group, index, servers, channel
        self._global_rows = group.num_rows
        self.name = ",".join(t.name for t in group.tables)
        self.step = 0  # pushes so far: the sequence number servers order this worker's requests by
        self.translated = 0  # training key lookups in this step (dynamic tables: hetero.ps.keys)
        self.key_counts: dict[tuple[str, int], Tensor] = {}  # (table, server) -> its counts there, last reported
        if group.dynamic.tables:
            group.dynamic.route = self.translate
        self.lookups: list[LookupGrad] = []  # this step's lookups (their gradient after backward)
        self.pending: tuple[int, Tensor, Tensor] | None = None  # a push not sent yet: (its step, ids, gradient rows)
        self.started: tuple[LookupPlan, tuple] | None = None  # a pull sent ahead of its lookup (start())
        self.starts_taken = self.starts_dropped = 0  # started pulls a lookup took / nobody took (read and dropped)
        self.cache = RowCache(cache_staleness) if cache_staleness is not None else None

    def reset(self) -> None:
        """Forget the step count and cached rows (after a checkpoint load)."""
        assert self.pending is None, "a checkpoint load follows a flush"
        self.step, self.lookups, self.translated = 0, [], 0
        if self.cache is not None:
            self.cache = RowCache(self.cache.staleness)

    @property
    def global_rows(self) -> int:
        return self._global_rows

    def clear(self) -> None:
        self.lookups = []

    # ------------------------------------------------------------------------------ pull
    def lookup(self, group: TableGroup, requests: list[Request], plan: LookupPlan | None) -> list[Tensor]:
        anchor = requests[0].table._device_anchor
        pin = anchor.device.type == "cuda"  # received straight into pinned memory: the upload is an async DMA
        if plan is not None and self.started is not None and self.started[0] is plan:
            rows = self._receive(self.started[1], pin)  # (started: :meth:`start`)
            self.started, self.starts_taken = None, self.starts_taken + 1
        else:  # (or a plan whose started pull was dropped: a flush for a checkpoint came between)
            self._drop_started()
            if plan is None or plan.unique is None:
                plan = group.plan(requests)  # ids checked (IndexError before any communication) and deduplicated
            rows = self.fetch(plan.unique, pin)
        entry = LookupGrad(plan.unique)
        if torch.is_grad_enabled():
            self.lookups.append(entry)
        if anchor.device.type == "cpu":
            # The device is the host: pool with the host kernels, as a local table does; the
            # backward keeps the gradient per id (coalesced when the push takes it, one pass) and
            # the zero-size sink only puts the op on the tape.
            sink = torch.empty(0, requires_grad=torch.is_grad_enabled())
            outs = HostPool.apply(rows, plan.inverse, plan.offsets, plan.scale, sink, entry, plan)
            return [o.to(anchor.dtype) for o in outs]
        rows = copy_to(rows, anchor.device).to(anchor.dtype)  # host -> device: U rows
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            # Runs inside backward: keep the coalesced gradient; the push runs in the optimizer step.
            # device -> host copy (a sync point on CUDA)
            rows.register_hook(lambda grad: entry.pending.add(
                SparseGrad(entry.unique, grad.detach().to("cpu", torch.float32), RowSpace.GROUP)))
        return plan.pool(rows)

    def starts_lookups(self) -> bool:
        return self.cache is None  # (bounded mode's cache is consulted at the lookup's step)

    def start(self, plan: LookupPlan) -> None:
        """Send the pull of ``plan``'s unique rows (with the pending push) now; :meth:`lookup`
        given ``plan`` receives the rows. A lookup of other ids first reads and drops them."""
        self._drop_started()
        self.started = (plan, self._send(plan.unique))

    def _drop_started(self) -> None:
        """Read a started pull's reply nobody will use (the next reply must be the next request's)."""
        if self.started is not None:
            started, self.started, self.starts_dropped = self.started, None, self.starts_dropped + 1
            self._receive(started[1], False)

    def fetch(self, unique: Tensor, pin: bool = False) -> Tensor:
        """Rows ``(U, D)`` (storage dtype, host; pinned with ``pin``) of the sorted unique group rows ``unique``."""
        if self.cache is None:
            return self.pull(unique, pin)
        hit, cached = self.cache.lookup(unique, self.step)
        missing = unique[~hit]
        pulled = self.pull(missing)
        self.cache.insert(missing, pulled, self.step)
        rows = torch.empty(unique.numel(), self.group.dim, dtype=self.group.dtype, pin_memory=pin)
        rows[~hit] = pulled
        if cached is not None:
            rows[hit] = cached
        return rows

    def _route(self, ids: Tensor) -> list[Tensor | None]:
        """Per shard, the positions in ``ids`` of the ids it owns, in their order (``None``: one
        server owns all)."""
        n = len(self.servers)
        if n == 1:
            return [None]
        # one kernel (a counting sort by owner), not n masks each indexed through nonzero
        order, starts = load("hetero.ps._kernels").route(ids.numpy(), n)
        order = torch.from_numpy(order)
        return [order[starts[s] : starts[s + 1]] for s in range(n)]

    def pull(self, ids: Tensor, pin: bool = False) -> Tensor:
        """Rows ``(len(ids), D)`` (storage dtype, host; pinned with ``pin``) of group rows ``ids``
        from their servers, in the order of ``ids``. A pending push (:meth:`push`) travels in the
        same message to every server, which applies it before it reads the rows.

        Raises:
            IndexError / ValueError: the owning server rejected an id (its message names the table).
            ServerTimeoutError / ServerLostError: a server did not answer (naming its rank).
        """
        self._drop_started()
        return self._receive(self._send(ids), pin)

    def _send(self, ids: Tensor) -> tuple[Tensor, list, list, str]:
        """Start :meth:`pull`: the requests sent; what :meth:`_receive` needs."""
        pending, self.pending = self.pending, None
        routes = self._route(ids)
        ch = self.channel
        what = f"a {'push and ' if pending is not None else ''}pull of table group {self.name!r}"
        asked = [(server, at, ids if at is None else ids[at]) for server, at in zip(self.servers, routes)]
        if pending is None:
            asked = [a for a in asked if a[2].numel()]
            sends = [(s, ch.request(s, Op.PULL, [p], step=self.step, group=self.index, n=p.numel()))
                     for s, _, p in asked]
        else:  # every server gets the push (empty if none of its rows), so a SYNC server sees the step complete
            step, pushed, grads = pending
            sends = []
            for (server, _, part), at in zip(asked, self._route(pushed)):
                p, g = (pushed, grads) if at is None else (pushed[at], grads[at])
                sends.append((server, ch.request(server, Op.PUSH_PULL, [p, g, part], step=step, group=self.index,
                                                 n=p.numel(), extra=pushed.numel(), fields=(part.numel(),))))
        return ids, asked, sends, what

    def _receive(self, sent: tuple[Tensor, list, list, str], pin: bool) -> Tensor:
        """Finish :meth:`pull`: the replies' rows in the order of its ids."""
        ids, asked, sends, what = sent
        one = len(asked) == 1 and asked[0][1] is None  # one server holds them all: its reply is the rows
        out = None if one else torch.empty(ids.numel(), self.group.dim, dtype=self.group.dtype, pin_memory=pin)
        row_bytes = self.group.dim * self.group.dtype.itemsize
        for server, at, part in asked:
            # (one server: received in pinned memory, unpacked in place; else copied into its rows of out)
            _, payload = self.channel.reply(server, self.index, part.numel() * row_bytes, what, part.numel(),
                                            pin=pin and one)
            rows, = unpack(payload, [((part.numel(), self.group.dim), self.group.dtype)])
            if one:
                out = rows
            else:
                out.index_copy_(0, at, rows)
        for server, works in sends:
            for w in works:
                self.channel.wait(w, server, what)
        return out

    # ------------------------------------------------------------------------------ push
    def push(self) -> None:
        """Take this step's gradient rows (one row per unique id). They are sent with this worker's
        next pull of the group, one message to each server that applies them before reading the
        rows (sync mode stays exact: the same order as a push then a pull), or alone by
        :meth:`flush` - before a key lookup, a checkpoint, the end of an epoch and the stop."""
        # lookups without a gradient changed nothing; several (micro-batches) are summed, one row per id
        done = [g for g in (e.pending.take() for e in self.lookups) if g is not None]
        self.lookups = []
        if done:
            grad = SparseGrad.coalesce(done)
            ids, rows = grad.ids, grad.rows
        else:
            ids, rows = torch.empty(0, dtype=torch.int64), torch.empty(0, self.group.dim)
        self.flush()  # (the previous step's push, when no pull came between: bounded mode's cache hits)
        self.pending = (self.step, ids, rows)
        self.step, self.translated = self.step + 1, 0

    def flush(self) -> None:
        """Send the pending push alone (every server gets a message) and wait for the receipts
        (a started pull's reply read first)."""
        self._drop_started()
        if self.pending is None:
            return
        (step, ids, rows), self.pending = self.pending, None
        ch, what = self.channel, f"a push of table group {self.name!r}"
        sends = []
        for server, at in zip(self.servers, self._route(ids)):
            part, grad = (ids, rows) if at is None else (ids[at], rows[at])
            sends.append((server, part.numel(), ch.request(server, Op.PUSH, [part, grad], step=step,
                                                           group=self.index, n=part.numel(), extra=ids.numel())))
        for server, n, works in sends:
            ch.reply(server, self.index, 0, what, n)  # the server's receipt (for the n ids sent)
            for w in works:
                ch.wait(w, server, what)

    # ------------------------------------------------------------------------------ keys
    def translate(self, lookups: list[tuple[KeyedTable, Tensor]], training: bool) -> list[Tensor]:
        """``DynamicRows.route``: the table rows (``(N,)`` int64 each) of dynamic tables' keys
        (``(table, (N,) int64 keys)`` pairs, one lookup), each key translated by the server owning
        it: one request to every server, all in flight (:mod:`hetero.ps.keys`). The tables' counts
        the servers report go to ``group.dynamic.remote_stats``.

        Raises:
            ValueError: a server found keys of another shard (workers and servers disagree).
            ServerTimeoutError / ServerLostError: a server did not answer (naming its rank).
        """
        self.flush()  # the previous step's update first: translating may evict the keys it updates
        n = len(self.servers)
        index = [next(i for i, t in enumerate(self.group.tables) if t is table) for table, _ in lookups]
        owners = [torch.from_numpy(key_shards(k.numpy(), t.group_row, t.config.num_embeddings, n)) for t, k in lookups]
        ch, what = self.channel, f"a key lookup of table group {self.name!r}"
        asked = []
        for s, server in enumerate(self.servers):
            masks = [o == s for o in owners]
            entries = torch.tensor([[i, int(m.sum())] for i, m in zip(index, masks)], dtype=torch.int64).reshape(-1, 2)
            keys = torch.cat([k[m] for (_, k), m in zip(lookups, masks)])
            works = ch.request(server, Op.TRANSLATE, [entries, keys], step=self.step, group=self.index, n=keys.numel(),
                               extra=int(training), fields=(len(lookups), self.translated))
            asked.append((server, masks, entries[:, 1].tolist(), works))
        out = [torch.empty(k.numel(), dtype=torch.int64) for _, k in lookups]
        for server, masks, sizes, works in asked:
            specs = [((sum(sizes),), torch.int64), ((len(lookups), STATS), torch.int64)]
            _, payload = ch.reply(server, self.index, spec_bytes(specs), what, sum(sizes))
            rows, counts = unpack(payload, specs)
            for (table, _), o, m, part, c in zip(lookups, out, masks, rows.split(sizes), counts):
                o[m] = part
                self.key_counts[(table.name, server)] = c
            for w in works:
                ch.wait(w, server, what)
        self.translated += training
        for table, _ in lookups:  # (each server's latest, summed)
            total = sum(self.key_counts[(table.name, server)] for server in self.servers)
            self.group.dynamic.remote_stats[table.name] = DynamicStats(*total.tolist())
        return out


def broadcast(channel: Channel, servers: list[int], op: Op, path: str) -> None:
    """Tell every server to join a checkpoint save or load of ``path`` (the DCP call follows)."""
    for server in servers:
        for w in channel.request(server, op, [encode(path)], n=len(path.encode())):
            channel.wait(w, server, f"a checkpoint {op.name.lower()}")


class PSSparse:
    """A sparse optimizer whose tables live on parameter servers: ``step()`` pushes the gradients
    (the servers apply this optimizer); its state dict holds configuration and step counts only
    (the rows' state is in the servers' part of the checkpoint)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.clients = [g.exchange for g in optimizer.groups]

    def zero_grad(self) -> None:
        for c in self.clients:
            c.clear()

    def step(self) -> None:
        for c in self.clients:
            c.push()

    def flush(self) -> None:
        """Send the pushes still pending (:meth:`PSClient.push`): before anything that is not this
        worker's next lookup of the group."""
        for c in self.clients:
            c.flush()

    def state_dict(self, include_state: bool = True) -> dict[str, Any]:
        return self.optimizer.state_dict(include_state=False)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict({k: v for k, v in state.items() if k != "state"})
