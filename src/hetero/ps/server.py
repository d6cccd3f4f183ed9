"""The server side: a shard of every table group (:mod:`hetero.ps.shard`), its sparse optimizer
state, and the serve loop.

A group on the SSD tier (:mod:`hetero.storage`) keeps its shard there: the rows and their
optimizer state in the server's record store under its row cache, laid out from the same seeds
when first needed; pulls read through the cache, pushes update in it. A checkpoint holds such a
shard as the tier's snapshot inside the DCP directory (``ps-tier/shard<s>of<S>/<group>/``,
written and swapped in with the DCP files: :class:`hetero.checkpoint.sharded.OwnFiles`).

The serve loop takes requests from any worker in arrival order (see
:mod:`hetero.ps.transport`); it is single-threaded, so a pull never sees a half-applied update.
Updates use the same fused optimizer kernels as a local table (:mod:`hetero.optim`).
"""

from __future__ import annotations

import io
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from hetero.checkpoint.io import CheckpointError
from hetero.embedding import RowSpace, SparseGrad
from hetero.embedding.group import TableGroup
from hetero.ps.config import PSMode
from hetero.ps.keys import ServerKeys
from hetero.ps.shard import shard_bytes
from hetero.storage import snapshot
from hetero.ps.transport import (CAPACITY, HEADER_BYTES, MESSAGE_BYTES, SEPARATE, TAG_PAYLOAD, TAG_REQUEST,
                                 Op, Status, decode, encode, header, header_of, pack, reply_tag, unpack)

log = logging.getLogger("hetero")


class ParameterServer:
    """Serves the shard ``shard`` of ``servers`` of every table group of a model.

    Args:
        groups: the model's table groups by checkpoint key (:func:`hetero.embedding.table_groups`),
            in the same order on every rank (a request names a group by its position).
        optimizers: name -> sparse optimizer (built after :func:`hetero.ps.shard_tables`, so its
            state has the shard's rows).
    """

    def __init__(self, groups: dict[str, TableGroup], optimizers: dict[str, Any], shard: int, servers: int,
                 workers: list[int], pg, mode: PSMode, gradients_mean: bool) -> None:  # noqa: ANN001 - ProcessGroup
        self.keys, self.groups = list(groups), list(groups.values())
        self.owner: dict[TableGroup, tuple[str, Any]] = {}  # groups hash by identity
        for name, opt in optimizers.items():
            for g in opt.groups:
                self.owner[g] = (name, opt)
        self.optimizers = optimizers
        self.shard, self.servers, self.workers, self.pg = shard, servers, list(workers), pg
        self.mode, self.mean = mode, gradients_mean
        self.applied = [0] * len(self.groups)  # steps applied per group (SYNC: the step pulls wait for)
        self.inbox: list[dict[int, dict[int, tuple]]] = [{} for _ in self.groups]  # SYNC: step -> worker -> push
        self.deferred: list[list[tuple[int, int, Tensor]]] = [[] for _ in self.groups]  # SYNC: early pulls
        # per (worker, group): replies in flight (their tensors kept alive); a group's replies have a tag of
        # their own, so a worker may take them in another order than the groups' requests went
        self.sends: dict[tuple[int, int], list[tuple[Any, Tensor]]] = {}
        # (worker, group) -> the reply message of its last pull, whose memory the next pull's rows are
        # read into: a fresh 6 MB reply took 1,300-1,900 page faults, 3 ms of a 6 ms pull (ps.py, 100k rows x 16)
        self.row_buffers: dict[tuple[int, int], Tensor] = {}
        # dynamic tables' key maps (hetero.ps.keys), and training key lookups: (step, number) -> worker -> request
        self.keymaps = [ServerKeys(g, shard, servers) if g.dynamic.tables else None for g in self.groups]
        self.asked: list[dict[tuple[int, int], dict[int, tuple[Tensor, Tensor]]]] = [{} for _ in self.groups]
        self.served_rows = self.updated_rows = 0
        self.capacity = CAPACITY  # bytes of a request received in one message (grows: _next_request)
        self.requests: Counter[Op] = Counter()  # requests served, by kind

    def nbytes(self) -> int:
        """Bytes of this shard in memory: table rows and optimizer state; a group on the SSD tier,
        its row cache's budget."""
        total = sum(shard_bytes(g) for g in self.groups) + sum(k.nbytes for k in self.keymaps if k is not None)
        for _, opt in self.optimizers.items():
            for state in opt.group_state.values():
                total += sum(x.numel() * x.element_size() for x in state.values() if not x.is_meta)
        return total

    # ------------------------------------------------------------------------------ loop
    def serve(self, on_checkpoint) -> None:  # noqa: ANN001 - callable(op, path)
        """Answer requests until every worker sent STOP. ``on_checkpoint(op, path)`` runs when all
        workers asked for the same SAVE or LOAD (it joins the job-wide DCP collective)."""
        live, votes = set(self.workers), {}
        while live:
            src, h, payload = self._next_request()
            op, step, g, n, extra = (int(x) for x in h[:5])
            self.requests[Op(op)] += 1
            if op == Op.PULL:
                self._pull(src, step, g, *unpack(payload, [((n,), torch.int64)]))
            elif op == Op.PUSH:
                ids, rows = unpack(payload, [((n,), torch.int64), ((n, self.groups[g].dim), torch.float32)])
                self._push(src, step, g, ids, rows, extra)
            elif op == Op.PUSH_PULL:
                d = self.groups[g].dim
                specs = [((n,), torch.int64), ((n, d), torch.float32), ((int(h[5]),), torch.int64)]
                ids, rows, want = unpack(payload, specs)
                self._push(src, step, g, ids, rows, extra, want)
            elif op == Op.TRANSLATE:
                entries, keys = unpack(payload, [((int(h[5]), 2), torch.int64), ((n,), torch.int64)])
                self._translate(src, (step, int(h[6])), g, bool(extra), entries, keys)
            elif op in (Op.SAVE, Op.LOAD):
                path = decode(*unpack(payload, [((n,), torch.uint8)]))
                voters = votes.setdefault((op, path), set())
                voters.add(src)
                if voters == set(self.workers):
                    del votes[(op, path)]
                    on_checkpoint(Op(op), path)
                    if op == Op.LOAD:  # both sides count steps from the load
                        self.applied, self.asked = [0] * len(self.groups), [{} for _ in self.groups]
            elif op == Op.STOP:
                live.discard(src)
        for sends in self.sends.values():
            for w, _ in sends:
                w.wait()

    def _next_request(self) -> tuple[int, Tensor, Tensor]:
        """The next request from any worker: ``(its rank, its (8,) int64 header, its payload bytes)``.
        Received into a fresh buffer of the current capacity (what the payload views - a push kept
        in the inbox - keeps it); a request sent as header and payload apart grows the capacity to
        its size, as its worker now counts on (:class:`hetero.ps.transport.Channel`)."""
        message = torch.empty(self.capacity, dtype=torch.uint8)
        src = dist.recv(message, None, group=self.pg, tag=TAG_REQUEST)
        h = header_of(message)
        separate = int(h[SEPARATE])
        if not separate:
            return src, h, message[HEADER_BYTES:]
        self.capacity = max(self.capacity, HEADER_BYTES + separate)
        payload = torch.empty(separate, dtype=torch.uint8)
        dist.recv(payload, src, group=self.pg, tag=TAG_PAYLOAD)
        return src, h.clone(), payload

    def _settle(self, dst: int, g: int) -> None:
        """Wait for the replies in flight to ``dst``. A worker asks again only after it received the
        previous answer: they have completed (gloo marks a send complete in wait(), so it is called
        here), and their tensors may be written again."""
        for w, _ in self.sends.pop((dst, g), []):
            w.wait()

    def _send(self, dst: int, g: int, message: Tensor) -> None:
        """Start sending the reply ``message`` (kept alive until it completed)."""
        self._settle(dst, g)
        self.sends[(dst, g)] = [(dist.isend(message, dst, group=self.pg, tag=reply_tag(g)), message)]

    def _reply(self, dst: int, g: int, parts: list[Tensor], n: int = 0, status: Status = Status.OK) -> None:
        self._send(dst, g, pack(header(status, n), parts))

    def _error(self, dst: int, g: int, kind: Status, message: str) -> None:
        # cut to the room every reply buffer has for it, at a character's end
        msg = encode(message.encode()[:MESSAGE_BYTES].decode(errors="ignore"))
        self._reply(dst, g, [msg], msg.numel(), kind)

    def _check(self, g: int, ids: Tensor) -> tuple[Status, str] | None:
        """An id outside the group or not on this shard: the message names the table."""
        group = self.groups[g]
        if ids.numel() == 0:
            return None
        # one pass for the range (a third of three passes' time: 0.1 of 0.3 ms at 100k ids, twice a
        # step), and the shard's only where there are several servers
        lo, hi = torch.aminmax(ids)
        if int(lo) >= 0 and int(hi) < group.exchange.global_rows and (
                self.servers == 1 or not bool((ids % self.servers != self.shard).any())):
            return None
        bad = (ids < 0) | (ids >= group.exchange.global_rows) | (ids % self.servers != self.shard)
        row = int(ids[int(bad.nonzero()[0])])
        starts = [t.group_row for t in group.tables]
        t = group.tables[max(0, int(np.searchsorted(starts, row, side="right")) - 1)]
        tid, vocab = row - t.group_row, t.config.num_embeddings
        where = f"parameter server rank {dist.get_rank()} (shard {self.shard} of {self.servers})"
        if not 0 <= tid < vocab:
            return Status.INDEX_ERROR, (f"{where}: table {t.name!r}: id {tid} is out of range for vocab size {vocab} "
                                        f"(valid ids are 0..{vocab - 1}); fix the feature encoding or set hashed=True")
        return Status.VALUE_ERROR, (f"{where}: table {t.name!r}: id {tid} (group row {row}) belongs to shard "
                                    f"{row % self.servers}, not this one; workers and servers disagree on the number "
                                    f"of servers")

    def _local(self, ids: Tensor) -> Tensor:
        """This shard's storage rows of group rows ``ids`` (row ``g`` lives at ``g // S`` on shard
        ``g % S``); one server's are the ids themselves, not a copy."""
        return ids if self.servers == 1 else ids // self.servers

    def _pull(self, src: int, step: int, g: int, ids: Tensor, checked: bool = False) -> None:
        err = None if checked else self._check(g, ids)
        if err is not None:
            self._error(src, g, *err)
            return
        local = self._local(ids)
        if self.mode is PSMode.SYNC and step > self.applied[g]:
            self.deferred[g].append((src, step, local))  # answered once step - 1 is applied
            return
        self._send_rows(src, g, local)

    def _send_rows(self, dst: int, g: int, local: Tensor) -> None:
        self._settle(dst, g)  # (the previous pull's rows went out: their buffer is free)
        group = self.groups[g]
        size = HEADER_BYTES + local.numel() * group.dim * group.dtype.itemsize
        buf = self.row_buffers.get((dst, g))
        if buf is None or buf.numel() < size:
            buf = self.row_buffers[(dst, g)] = torch.empty(size, dtype=torch.uint8)
        message = buf[:size]
        header_of(message).copy_(header(Status.OK, local.numel()))
        rows = message[HEADER_BYTES:].view(group.dtype).view(local.numel(), group.dim)
        group.read_rows(local, rows)  # into the reply itself (SSD tier: through its row cache)
        self.served_rows += local.numel()
        self._send(dst, g, message)

    def _push(self, src: int, step: int, g: int, ids: Tensor, rows: Tensor, count: int,
              then_pull: Tensor | None = None) -> None:
        """Take a worker's push of ``step`` (applied once every worker's came, in ``SYNC`` mode);
        with ``then_pull`` (``Op.PUSH_PULL``) answer those ids' rows as step ``step + 1``'s pull,
        else a receipt. A bad id in either part refuses the whole request before anything changes."""
        err = self._check(g, ids) or (self._check(g, then_pull) if then_pull is not None else None)
        if err is not None:
            self._error(src, g, *err)
            return
        if then_pull is None:
            self._reply(src, g, [], ids.numel())  # received (not necessarily applied)
        if self.mode is not PSMode.SYNC:  # one worker's share of a global batch: 1/W of its gradient
            self._apply(g, [(ids, rows, count)], 1.0 / len(self.workers) if self.mean else 1.0)
            self.applied[g] += 1
        else:
            self.inbox[g].setdefault(step, {})[src] = (ids, rows, count)
            while len(self.inbox[g].get(self.applied[g], {})) == len(self.workers):
                parts = self.inbox[g].pop(self.applied[g])
                self._apply(g, [parts[w] for w in self.workers], 1.0 / len(self.workers) if self.mean else 1.0)
                self.applied[g] += 1
                ready = [d for d in self.deferred[g] if d[1] <= self.applied[g]]
                self.deferred[g] = [d for d in self.deferred[g] if d[1] > self.applied[g]]
                for dst, _, local in ready:
                    self._send_rows(dst, g, local)
                self._translate_ready(g)
        if then_pull is not None:
            self._pull(src, step + 1, g, then_pull, checked=True)

    def _translate(self, src: int, at: tuple[int, int], g: int, training: bool, entries: Tensor, keys: Tensor) -> None:
        """A key lookup (``Op.TRANSLATE``, :mod:`hetero.ps.keys`): answered at once unless it trains;
        a training one once every worker's lookup ``at`` (step, number) came and the step before is applied."""
        keymaps = self.keymaps[g]
        err = "the group has no dynamic tables" if keymaps is None else keymaps.check(entries, keys)
        if err is not None:
            self._error(src, g, Status.VALUE_ERROR, f"parameter server rank {dist.get_rank()} (shard {self.shard} of "
                                                 f"{self.servers}): {err}")
        elif not training:
            self._reply(src, g, list(keymaps.translate_all([(entries, keys)], False)[0]), keys.numel())
        else:
            self.asked[g].setdefault(at, {})[src] = (entries, keys)
            self._translate_ready(g)

    def _translate_ready(self, g: int) -> None:
        """Translate the training key lookups every worker sent whose step may begin, in order."""
        while self.asked[g]:
            at = min(self.asked[g])
            if at[0] > self.applied[g] or len(self.asked[g][at]) < len(self.workers):
                return
            parts = self.asked[g].pop(at)
            try:
                replies = self.keymaps[g].translate_all([parts[w] for w in self.workers], True)
            except ValueError as e:
                for w in self.workers:
                    self._error(w, g, Status.VALUE_ERROR, str(e))
                continue
            for w, reply in zip(self.workers, replies):
                self._reply(w, g, list(reply), reply[0].numel())

    def _apply(self, g: int, parts: list[tuple[Tensor, Tensor, int]], scale: float) -> None:
        """One optimizer step of group ``g`` from the pushes ``parts`` (summed in the given order)."""
        group = self.groups[g]
        name, opt = self.owner[group]
        ids = torch.cat([p[0] for p in parts])
        if ids.numel() == 0:
            opt.step_group(group)  # (no rows: a dynamic table's clock and new rows' state, hetero.ps.keys)
            if any(p[2] for p in parts):  # the table got rows elsewhere this step: count it here too
                opt.count_step(group)
            return
        if len(parts) == 1 and bool((ids[1:] > ids[:-1]).all()):
            unique, summed = ids, parts[0][1]  # one worker's push: its ids are unique already (sorted)
        else:
            unique, inverse = torch.unique(ids, return_inverse=True)
            # index_add_ on the CPU adds in index order: the sum is the same on every run
            summed = torch.zeros(unique.numel(), group.dim).index_add_(0, inverse, torch.cat([p[1] for p in parts]))
        if scale != 1.0:
            summed *= scale
        group.pending.set(SparseGrad(self._local(unique), summed, RowSpace.LOCAL))
        opt.step_group(group)
        self.updated_rows += unique.numel()

    # ------------------------------------------------------------------------------ state
    def state(self, live: bool = False) -> dict[str, Any]:
        """This shard's part of the job's DCP checkpoint: the rows and optimizer state of every
        group (live tensors: a load writes into them), one blob with the step counts, and the dynamic
        tables' key maps (copies, or with ``live`` views that the next lookups change: for a save)."""
        tables = {}
        for key, group in zip(self.keys, self.groups):
            if group.ssd_config is not None:  # (the tier's snapshot: OwnFiles)
                continue
            entry = {"weight": group.storage}
            name, opt = self.owner[group]
            for s, x in opt.group_state[group].items():
                entry[f"{name}.{s}"] = x
            tables[key] = {f"shard{self.shard}": entry}
        keys = {k: {f"shard{self.shard}": m.state(live)} for k, m in zip(self.keys, self.keymaps) if m is not None}
        return {"ps": tables, "ps_meta": {f"shard{self.shard}": io.BytesIO()}, **({"ps_keys": keys} if keys else {})}

    def save_blob(self, state: dict[str, Any]) -> None:
        counts = {name: opt.state_dict(include_state=False) for name, opt in self.optimizers.items()}
        torch.save({"sparse_optimizers": counts, "servers": self.servers}, state["ps_meta"][f"shard{self.shard}"])

    def load_blob(self, state: dict[str, Any]) -> None:
        buf = state["ps_meta"][f"shard{self.shard}"]
        buf.seek(0)
        saved = torch.load(buf, map_location="cpu", weights_only=True)
        for name, opt in self.optimizers.items():
            opt.load_state_dict(saved["sparse_optimizers"][name])  # counts only; the rows were loaded in place
        for key, keymaps in zip(self.keys, self.keymaps):
            if keymaps is not None:
                keymaps.load(state["ps_keys"][key][f"shard{self.shard}"])

    # ------------------------------------------------------------------------------ SSD tier
    def _tier_dir(self, directory: Path, group: TableGroup) -> Path:
        return Path(directory) / PS_TIER / f"shard{self.shard}of{self.servers}" / group.ssd_name

    def write(self, directory: Path) -> None:
        """:class:`~hetero.checkpoint.sharded.OwnFiles`: snapshot each group on the SSD tier
        (the cache written back first) into the new checkpoint ``directory``."""
        for group in self.groups:
            if group.ssd_config is not None:
                group.ssd_checkpoint(self._tier_dir(directory, group))

    def check(self, directory: Path) -> Callable[[], None]:
        """:class:`~hetero.checkpoint.sharded.OwnFiles`: verify this shard's snapshots in
        ``directory`` (sizes and CRCs); return what restores them.

        Raises:
            CheckpointError: a snapshot missing (another number of servers saved it: resume with
                as many) or damaged, naming it.
        """
        parts = []
        for key, group in zip(self.keys, self.groups):
            if group.ssd_config is None:
                continue
            where = self._tier_dir(directory, group)
            if not where.is_dir():
                saved = sorted(p.name for p in (Path(directory) / PS_TIER).glob("shard*"))
                raise CheckpointError(f"checkpoint {directory} has no SSD tier snapshot of tables {key} for shard "
                                      f"{self.shard} of {self.servers} servers (it holds {saved or 'none'}): resume "
                                      f"with the number of servers it was saved with, and the tables on the tier")
            parts.append((group, where, snapshot.verify(where)))

        def restore() -> None:
            for group, where, manifest in parts:
                group.ssd_restore([(where, manifest)])  # (linked back into the server's store)
        return restore


PS_TIER = "ps-tier"  # a checkpoint's directory of the servers' SSD tier snapshots
