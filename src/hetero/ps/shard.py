"""A server's shard of a table group: which rows it holds and how they are first laid out.

Rows are hash-partitioned: global group row ``g`` lives on shard ``g % S`` at local row
``g // S`` (PaddlePaddle's and Persia's rule), so a vocabulary's hot low ids spread over all
servers. A shard is built from the tables' seeds (:func:`hetero.embedding.init_rows`) without
materialising any other row, so a table needs only its shards' memory anywhere in the job.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hetero.embedding import INIT_CHUNK, RowExchange, RowPlacement, init_rows
from hetero.embedding.group import TableGroup
from hetero.embedding.plan import LookupPlan, Request
from hetero.placement import host_empty


class ServerShard(RowExchange):
    """``group.exchange`` on a server: the group's storage is hash shard ``shard`` of ``servers``
    (group row ``g`` at local row ``g // servers``)."""

    placement = RowPlacement.SERVER_SHARD

    def __init__(self, global_rows: int, shard: int, servers: int) -> None:
        self._global_rows, self.shard, self.servers = global_rows, shard, servers

    @property
    def global_rows(self) -> int:
        return self._global_rows

    def lookup(self, group: TableGroup, requests: list[Request], plan: LookupPlan | None) -> list[Tensor]:
        raise RuntimeError("a parameter server does not run the model; only workers look up rows")


def shard_rows_count(global_rows: int, shard: int, servers: int) -> int:
    return max(0, -(-(global_rows - shard) // servers))


def shard_rows(group: TableGroup, shard: int, servers: int, lo: int, hi: int) -> Tensor:
    """Rows ``[lo, hi)`` of ``group``'s shard ``shard`` of ``servers`` (global rows
    ``shard + servers * [lo, hi)``), initialised as the full table would be (:func:`init_rows`
    of each table's seed; the rows between are generated and dropped: ``servers`` times the
    rows' bytes for a moment)."""
    out = torch.empty((max(hi - lo, 0), group.dim), dtype=group.dtype)
    first, last = shard + servers * lo, shard + servers * (hi - 1)  # global rows
    for t in group.tables:
        start, vocab = t.group_row, t.config.num_rows  # (a dynamic table's default row included)
        a = max(first, start + (shard - start) % servers)  # this shard's first row in the table
        b = min(last, start + vocab - 1)
        if a > b:
            continue
        block = init_rows(t.config, t.init_seed, a - start, b - start + 1)[::servers]
        out[(a - shard) // servers - lo : (b - shard) // servers - lo + 1] = block
    return out


def build_shard(group: TableGroup, shard: int, servers: int) -> Tensor:
    """The ``(rows of this shard, D)`` storage of ``group``'s shard, initialised as the full table
    would be, one block of rows at a time (:func:`shard_rows`; peak extra memory: one block)."""
    out = host_empty((shard_rows_count(group.num_rows, shard, servers), group.dim), group.dtype)
    step = max(1, INIT_CHUNK // servers)
    for lo in range(0, out.shape[0], step):
        hi = min(lo + step, out.shape[0])
        out[lo:hi] = shard_rows(group, shard, servers, lo, hi)
    return out


def shard_bytes(group: TableGroup) -> int:
    """Memory of ``group``'s storage here: its rows, or (on the SSD tier) its row cache's budget."""
    if group.ssd_config is not None:
        return group.ssd_config.cache_bytes
    return group.storage.numel() * group.storage.element_size()
