"""Dynamic tables on parameter servers: the key maps live where the rows do.

A dynamic table (:mod:`hetero.dynamic`) of ``C`` rows starting at group row ``G`` has, on server
shard ``s`` of ``S``, the table rows ``i`` with ``(G + i) % S == s`` (the servers' hash partition
of group rows, :mod:`hetero.ps.server`): ``i = first + j * S`` for ``j < rows``, which are the
shard's storage rows ``local + j``, contiguous (:class:`ShardSpan`). A key belongs to the shard
holding its home row (:func:`hetero.dynamic.sharding.home_rows`), so each shard gets keys in
proportion to its rows; that shard's own :class:`~hetero.dynamic.KeyMap` (capacity ``rows``)
admits, counts and evicts it and gives it one of its rows. MindSpore's EmbeddingService and
TensorFlow Recommenders-Addons keep their key maps on the parameter servers the same way.

A worker's lookup sends each server the keys it owns (``Op.TRANSLATE``: every server a message,
empty or not, each key as often as it occurs); a ``SYNC`` server translates a training step's keys
once every worker sent them and the step before is applied, each table's keys in one call,
worker 0's first: what one process given the workers' batches one after the other sees. At one
server a run equals one process exactly, eviction included; at several, each shard evicts among
its own rows, as a row-sharded table's ranks do. A new key's row takes its initial value on the
server, and its optimizer state starts afresh at the step's update.

Checkpoints: each server writes its maps (``ps_keys.<group>.shard<s>``, :meth:`ServerKeys.state`);
:func:`whole_keymaps` merges them into each table's map, what one process would hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from hetero.dynamic import KeyMap, Keys
from hetero.dynamic.sharding import home_rows, merged_counts
from hetero.embedding.group import TableGroup

STATS = 4  # a table's counts in a reply: admitted, evicted, default lookups, rows held (DynamicStats)


@dataclasses.dataclass(frozen=True)
class ShardSpan:
    """A dynamic table's rows on one server shard.

    Attributes:
        first: the first table row here; the others follow every ``stride`` rows.
        rows: how many (the shard's key map capacity; 0 when the table has fewer rows than servers).
        local: the shard's storage row of ``first``; the next ones follow it.
        stride: the number of servers.
        capacity: the table's rows for keys; table row ``capacity`` is its default row.
    """

    first: int
    rows: int
    local: int
    stride: int
    capacity: int

    @classmethod
    def of(cls, first_row: int, capacity: int, shard: int, servers: int) -> "ShardSpan":
        first = (shard - first_row) % servers
        return cls(first, max(0, -(-(capacity - first) // servers)), (first_row + first) // servers, servers, capacity)

    def table_rows(self, rows: np.ndarray) -> np.ndarray:
        """The table rows of the shard's key map rows (its default row: the table's)."""
        return np.where(rows < self.rows, self.first + rows * self.stride, self.capacity)


def key_shards(keys: np.ndarray, first_row: int, capacity: int, servers: int) -> np.ndarray:
    """The server shard owning each key (``(K,)`` int64) of a dynamic table of ``capacity`` rows
    starting at group row ``first_row``: the shard of the key's home row."""
    return (first_row + home_rows(keys, capacity)) % servers


class ServerKeys:
    """The key maps of one table group's dynamic tables on server shard ``shard`` of ``servers``.

    Building it gives each dynamic table of ``group`` a map of its rows here (``keep_floor`` shared
    out in proportion, ``evict_chunk`` capped at the span) and makes the group's default rows its
    storage rows. Thread contract: the server's loop.
    """

    def __init__(self, group: TableGroup, shard: int, servers: int) -> None:
        self.group, self.shard, self.servers = group, shard, servers
        self.maps: dict[int, tuple[str, ShardSpan, KeyMap | None]] = {}  # group table index -> ...
        for i, t in enumerate(group.tables):
            if t.config.keys is not Keys.DYNAMIC:
                continue
            span = ShardSpan.of(t.group_row, t.config.num_embeddings, shard, servers)
            config = t.config.dynamic.share(span.rows, span.capacity)
            self.maps[i] = (t.name, span, KeyMap(t.name, span.rows, config, t.init_seed) if span.rows else None)
        frozen = group.dynamic.frozen  # the default rows: group rows -> this shard's storage rows
        group.dynamic.frozen = frozen[frozen % servers == shard] // servers

    @property
    def nbytes(self) -> int:
        """Host memory of the maps and their admission sketches, bytes."""
        return sum(m.nbytes + m.sketch.nbytes for _, _, m in self.maps.values() if m is not None)

    def check(self, entries: Tensor, keys: Tensor) -> str | None:
        """What is wrong with a request (``entries``: ``(L, 2)`` int64 of (group table index, key
        count); ``keys`` in that order), as a message naming the table; ``None``: nothing."""
        at = 0
        for index, count in entries.tolist():
            if index not in self.maps:
                return f"table #{index} of the group is not a dynamic table: workers and servers built other models"
            name, span, m = self.maps[index]
            part = keys[at : at + count].numpy()
            at += count
            owned = key_shards(part, self.group.tables[index].group_row, span.capacity, self.servers) == self.shard
            if part.shape[0] and (m is None or not owned.all()):
                return (f"table {name!r}: keys of another shard came to shard {self.shard} of {self.servers}; workers "
                        f"and servers disagree on the number of servers")
        return None if at == keys.numel() else f"a key request of {keys.numel()} keys announced {at}"

    def translate(self, index: int, keys: np.ndarray, training: bool) -> np.ndarray:
        """Table rows (``(N,)`` int64; ``capacity``, the default row, for a key without one) of
        ``keys`` of group table ``index``, all owned here. Training counts, admits and evicts
        (:meth:`KeyMap.translate` at the group's optimizer step), and a new key's row takes its
        initial value now (:meth:`TableGroup.reset_rows`: its state is reset at the update)."""
        _, span, m = self.maps[index]
        if not training:
            return span.table_rows(m.lookup(keys))
        rows, new = m.translate(keys, self.group.dynamic.steps_taken)
        if new.rows.shape[0]:
            config = self.group.tables[index].config
            dim, std = config.embedding_dim, config.init_std
            self.group.reset_rows(torch.from_numpy(span.local + new.rows), torch.from_numpy(m.init_rows(new.keys, dim, std)))
        return span.table_rows(rows)

    def translate_all(self, asked: list[tuple[Tensor, Tensor]], training: bool) -> list[tuple[Tensor, Tensor]]:
        """Each worker's request ``(entries, keys)`` -> its reply ``(rows, counts)``: lookup entry
        ``j``'s keys of every worker translated in one call, in the order given (worker 0's first);
        ``counts``: ``(L, STATS)`` int64, each entry's table's counts on this shard.

        Raises:
            ValueError: the workers looked up different tables.
        """
        first = asked[0][0][:, 0]
        if any(not torch.equal(e[:, 0], first) for e, _ in asked):
            raise ValueError(f"workers looked up different dynamic tables in one step on shard {self.shard}: "
                             f"{[e[:, 0].tolist() for e, _ in asked]}")
        bounds = [np.concatenate([[0], np.cumsum(e[:, 1].numpy())]) for e, _ in asked]
        outs = [np.empty(k.numel(), np.int64) for _, k in asked]
        counts = torch.zeros((first.numel(), STATS), dtype=torch.int64)
        for j, index in enumerate(first.tolist()):
            parts = [k.numpy()[b[j] : b[j + 1]] for (_, k), b in zip(asked, bounds)]
            # (no keys here: translated all the same, so that the map's age scan runs at the steps one process's does)
            if self.maps[index][2] is not None:
                rows = self.translate(index, np.concatenate(parts), training)
                at = 0
                for out, b in zip(outs, bounds):
                    out[b[j] : b[j + 1]] = rows[at : at + b[j + 1] - b[j]]
                    at += b[j + 1] - b[j]
            m = self.maps[index][2]
            if m is not None:
                counts[j] = torch.tensor(dataclasses.astuple(m.stats))
        return [(torch.from_numpy(o), counts) for o in outs]

    # ------------------------------------------------------------------------------ checkpoints
    def state(self, live: bool = False) -> dict[str, Tensor]:
        """The maps (``table<i>.<KeyMap.STATE>``: copies, or with ``live`` views that later lookups
        change) and the tables' clock (``step``)."""
        out = {"step": torch.tensor(self.group.dynamic.steps_taken)}
        for i, (_, _, m) in self.maps.items():
            if m is not None:
                out.update({f"table{i}.{k}": torch.from_numpy(v) for k, v in m.state_dict(copy=not live).items()})
        return out

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Restore :meth:`state` (as loaded: the same shard of the same number of servers)."""
        for i, (_, _, m) in self.maps.items():
            if m is not None:
                m.load_state_dict({k: state[f"table{i}.{k}"].numpy() for k in KeyMap.STATE})
        self.group.dynamic.steps_taken = int(state["step"])


def whole_keymaps(shards: Mapping[str, Mapping[str, Tensor]], servers: int,
                  tables: list[tuple[str, int, int]]) -> dict[str, Tensor]:
    """Each dynamic table's map whole (``<name>.keymap.*`` entries of a model state, what one process
    would hold) from the servers' :meth:`ServerKeys.state` (``shards["shard<s>"]``); ``tables``:
    the group's ``(qualified name, first group row, rows)`` in group order. A key keeps its table
    row; the admission sketches are summed (saturating, as a row-sharded table's are) and so are
    the counts; the next age scan is the latest."""
    out: dict[str, Tensor] = {}
    for i, (name, first_row, num_rows) in enumerate(tables):
        parts = {s: shards[f"shard{s}"] for s in range(servers) if f"table{i}.row_key" in shards[f"shard{s}"]}
        if not parts:
            continue
        capacity = num_rows - 1
        some = next(iter(parts.values()))
        whole = {"row_key": torch.zeros(capacity, dtype=some[f"table{i}.row_key"].dtype),
                 "row_count": torch.zeros(capacity, dtype=some[f"table{i}.row_count"].dtype),
                 "row_last": torch.full((capacity,), -1, dtype=some[f"table{i}.row_last"].dtype)}
        for s, p in parts.items():
            span = ShardSpan.of(first_row, capacity, s, servers)
            for k, x in whole.items():
                x[span.first :: servers] = p[f"table{i}.{k}"]
        counts = merged_counts([{k: p[f"table{i}.{k}"].numpy() for k in ("sketch", "stats", "next_scan")}
                                for p in parts.values()])
        whole.update({k: torch.from_numpy(v) for k, v in counts.items()}, step=some["step"])
        out.update({f"{name}.keymap.{k}": v for k, v in whole.items()})
    return out
