"""A table group's bookkeeping for its dynamic tables (:class:`DynamicRows`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from hetero.dynamic import DynamicStats
from hetero.dynamic.sharding import KeyShard
from hetero.embedding.config import TableConfig
from hetero.embedding.grad import SparseGrad


class KeyedTable(Protocol):
    """What a lookup's route (row-sharded, or to parameter servers) reads of a dynamic table (a
    :class:`~hetero.embedding.table.HostEmbedding`)."""

    key_shard: KeyShard | None  # its spans over the ranks
    training: bool  # (nn.Module's mode)
    name: str
    group_row: int  # its first row in the group
    config: TableConfig

    def own_rows(self, keys: Tensor, training: bool) -> Tensor: ...  # the keys this rank owns -> their rows


class DynamicRows:
    """What a :class:`~hetero.embedding.group.TableGroup` keeps for its dynamic tables
    (:mod:`hetero.dynamic`): their default rows, which no update changes; the rows given to new
    keys since the optimizer last stepped, whose state it resets; and the group's optimizer steps,
    the tables' clock.

    Args:
        tables: the names of the group's dynamic tables (none: every method is a no-op).
        frozen: their default rows, group rows (``(T,)`` int64, sorted).

    Replicated over data-parallel ranks, every rank admits and evicts every rank's keys (``gather``,
    in rank order), so the replicas' maps, rows and state stay equal. Row-sharded, each rank
    admits and evicts the keys it owns (``route``); ``frozen`` and the new keys' rows are then
    this rank's storage rows.

    Thread contract: the training thread's (lookups and the optimizer step).
    """

    def __init__(self, tables: list[str], frozen: np.ndarray) -> None:
        self.tables, self.frozen = tables, frozen
        self.steps_taken = 0  # optimizer steps of the group, with a gradient or not
        self._fresh: list[np.ndarray] = []
        # replicated over data-parallel ranks (set by hetero.parallel.DistributedSparse): a training
        # lookup's keys, table by table -> every replica's keys in rank order, and this rank's [lo, hi)
        self.gather: Callable[[list[Tensor]], list[tuple[Tensor, int, int]]] | None = None
        # row-sharded (set by hetero.parallel.shard_rows): a lookup's [(table, keys)], training -> their
        # rows, each key translated by the rank that owns it (hetero.parallel.sharded_keys: one exchange);
        # on parameter servers, by the server that owns it (hetero.ps.client.PSClient.translate)
        self.route: Callable[[list[tuple[KeyedTable, Tensor]], bool], list[Tensor]] | None = None
        # on parameter servers: each table's counts, as the servers last reported them (summed)
        self.remote_stats: dict[str, DynamicStats] = {}

    def refuse(self, what: str) -> None:
        """Raise where a dynamic table cannot go yet (``what``: the mechanism).

        Raises:
            ValueError: naming the dynamic tables and ``what``.
        """
        if self.tables:
            raise ValueError(f"dynamic tables {self.tables} train in one process, or replicated or row-sharded over "
                             f"data-parallel ranks, for now; not with {what}: drop that, or give these "
                             f"tables a fixed vocabulary (keys=Keys.FIXED; in a job file's schema, no dynamic = true)")

    def rows_of(self, lookups: list[tuple[KeyedTable, Tensor]]) -> list[Tensor]:
        """The rows of several of the group's dynamic tables' keys (``(table, (N,) int64 keys)``
        pairs, one lookup): row-sharded, one exchange for all (``route``); replicated, a training
        lookup's keys gathered from every rank at once (``gather``); else each table's own key map."""
        modes = {t.training for t, _ in lookups}
        assert len(modes) == 1, "the tables of one lookup share their module's mode"
        training = modes.pop() and torch.is_grad_enabled()
        if self.route is not None:
            return self.route(lookups, training)
        if self.gather is not None and training:
            everyone = self.gather([k for _, k in lookups])
            return [t.own_rows(keys, True)[lo:hi] for (t, _), (keys, lo, hi) in zip(lookups, everyone)]
        return [t.own_rows(k, training) for t, k in lookups]

    def add_fresh(self, rows: np.ndarray) -> None:
        """Storage rows ``rows`` now belong to new keys: their state is reset at the next step."""
        self._fresh.append(rows)
        if len(self._fresh) > 64:  # (lookups without a step between: keep the list short)
            self._fresh = [np.unique(np.concatenate(self._fresh))]

    def begin_step(self, grad: SparseGrad | None, state: dict[str, Tensor],
                   initial: Callable[[str], float]) -> SparseGrad | None:
        """The optimizer's step begins: count it, reset the state (``{name: (rows, ...) tensor}``)
        of the rows given to new keys to ``initial(name)``, and return ``grad`` less the default
        rows. The lookups after this call are the next step's."""
        self.steps_taken += 1
        if self._fresh:
            fresh = torch.from_numpy(np.concatenate(self._fresh))
            self._fresh = []
            for name, x in state.items():
                x.index_fill_(0, fresh, initial(name))  # (a third faster than x[fresh] = v: 45k rows of 10M)
        return grad.without(self.frozen) if grad is not None and self.frozen.shape[0] else grad
