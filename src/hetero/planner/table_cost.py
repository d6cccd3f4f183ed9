"""The tables' side of the cost model (:class:`~hetero.planner.cost.MeasuredCost` holds one):
a unit of host tables priced from the captured id frequencies and this machine's table-kernel
rates - lookups per pass and the rows each step's update touches, moved tables with torch's
embedding and sparse optimizer, and beside ``dp`` the sparse exchange the table placement
implies (replicated: an all-gather of every rank's rows; row-sharded: all-to-alls to the rows'
owners). Reference: TorchRec's planner (its storage and perf estimators) for pricing a
table's placement from its lookups and its bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hetero.optim import SparseOptimizerKind
from hetero.planner.calibration import Calibration
from hetero.planner.calibration_types import DiskRate
from hetero.storage import SsdConfig
from hetero.planner.graph import ModelGraph, TableInfo, Unit
from hetero.parallel.comm import Collective
from hetero.planner.space import Candidate, TablePlacement, sparse_optimizer_of

_TABLE_STATE = {SparseOptimizerKind.LAZY_ADAM: 2, SparseOptimizerKind.FTRL: 2, SparseOptimizerKind.ADAGRAD: 1,
                SparseOptimizerKind.ROWWISE_ADAGRAD: 0, SparseOptimizerKind.SGD: 0}  # table-sized states
_DEVICE_TABLE_STATE = {SparseOptimizerKind.LAZY_ADAM: 2, SparseOptimizerKind.ADAGRAD: 1}  # torch's, table-sized


class TablePricing:
    """Prices host (and moved) tables for :class:`~hetero.planner.cost.MeasuredCost`.

    Args:
        graph: the captured model (its tables' id traffic).
        calibration: this machine's table kernels, device tables and gloo collectives.
        sparse: each table's sparse optimizer by qualified-name prefix.
        ssd, disk: the SSD tier's settings and its disk's rates (tables on the tier), or ``None``.
    """

    def __init__(self, graph: ModelGraph, calibration: Calibration, sparse: Mapping[str, SparseOptimizerKind],
                 ssd: SsdConfig | None = None, disk: DiskRate | None = None) -> None:
        self.graph, self.cal, self.sparse, self.ssd, self.disk = graph, calibration, sparse, ssd, disk
        # (table, dp, passes) -> ids a pass, distinct rows a step, distinct rows a pass
        self._row_counts: dict[tuple[str, int, int], tuple[float, float, float]] = {}

    def ids(self, t: TableInfo) -> float:
        """Ids table ``t`` looks up per captured batch (0 without sampled traffic)."""
        traffic = self.graph.traffic.get(t.name)
        return traffic.ids_per_batch if traffic is not None else 0.0

    def device_bytes(self, t: TableInfo) -> int:
        """A device table's rows and its torch optimizer's state (in the rows' dtype)."""
        return t.rows * t.row_bytes * (1 + _DEVICE_TABLE_STATE.get(sparse_optimizer_of(t.name, self.sparse), 0))

    def rows(self, t: TableInfo, c: Candidate) -> tuple[float, float]:
        """A table's ids per pass and distinct rows per step on one rank of ``c`` (remembered:
        the expectation over the id frequencies is the search's hot spot)."""
        return self._counts(t, c)[:2]

    def _counts(self, t: TableInfo, c: Candidate) -> tuple[float, float, float]:
        """Ids per pass, distinct rows per step and distinct rows per pass of ``t`` on one rank."""
        key = (t.name, c.dp, c.micro_batches)
        if key not in self._row_counts:
            traffic = self.graph.traffic.get(t.name)
            if traffic is None:
                self._row_counts[key] = (0.0, 0.0, 0.0)
            else:
                per_pass = traffic.ids_per_batch / (c.dp * c.micro_batches)
                self._row_counts[key] = (per_pass, traffic.unique(per_pass * c.micro_batches), traffic.unique(per_pass))
        return self._row_counts[key]

    def unit(self, u: Unit, c: Candidate, on_device: list[TableInfo], on_ssd: list[TableInfo] = ()) -> tuple[float, int, int]:
        """Seconds, device bytes and host bytes of unit ``u``'s tables on one rank of ``c``, the
        ``on_device`` ones moved there and the ``on_ssd`` ones on the SSD tier: their lookups and
        updates per pass and step (each group's kernels on the host, torch's embedding and sparse
        optimizer on the device) and, beside ``dp``, the host tables' sparse exchange; the tier's
        misses and write-backs (:meth:`ssd`)."""
        moved = {t.name for t in on_device}
        seconds, static = 0.0, 0
        for t in on_device:  # one torch embedding call per table and pass, torch's sparse optimizer
            kind = sparse_optimizer_of(t.name, self.sparse)
            ids, rows = self.rows(t, c)
            seconds += self.cal.device_tables[kind.value].seconds(c.micro_batches, 1, ids, rows, t.dim)
            # rows and state, and the step's sparse gradient (values and indices, uncoalesced) until the update
            static += self.device_bytes(t) + int(ids * c.micro_batches * (t.row_bytes + 8))
        host = 0
        groups: dict[str, list] = {}
        tier = {t.name for t in on_ssd}
        share = c.dp if c.tables is TablePlacement.ROW_SHARDED else 1
        for t in (t for t in u.tables if t.name not in moved):
            kind = sparse_optimizer_of(t.name, self.sparse)
            groups.setdefault((t.group, kind), []).append(t)
            host += t.map_bytes // share + t.sketch_bytes  # (a dynamic table's key map: host memory, on the tier too)
            if t.name in tier:
                continue
            state_rows = t.rows * (1 + _TABLE_STATE[kind]) if kind is not SparseOptimizerKind.ROWWISE_ADAGRAD \
                else t.rows + t.rows / t.dim
            host += int(state_rows * t.row_bytes / share)
        for (_, kind), tables in groups.items():  # one kernel call per group and pass
            ids = sum(self.rows(t, c)[0] for t in tables)
            rows = sum(self.updated_rows(t, c) for t in tables)
            seconds += self.cal.tables[kind.value].seconds(c.micro_batches, len(tables), ids, rows, tables[0].dim)
        seconds += self.exchange([t for t in u.tables if t.name not in moved], c)
        if on_ssd:
            ssd_seconds, ssd_host, _ = self.ssd_cost(list(on_ssd), c)
            seconds, host = seconds + ssd_seconds, host + ssd_host
        # the host lookups' outputs reach the device each pass (the boundary after this unit copies them)
        return seconds, static, host

    def record_bytes(self, t: TableInfo) -> int:
        """A row of ``t`` with its sparse optimizer's state, as the SSD tier stores it."""
        kind = sparse_optimizer_of(t.name, self.sparse)
        return t.row_bytes + (4 if kind is SparseOptimizerKind.ROWWISE_ADAGRAD else 4 * t.dim * _TABLE_STATE[kind])

    def ssd_cost(self, tables: list[TableInfo], c: Candidate) -> tuple[float, int, float]:
        """Seconds, host bytes and expected row hit rate of ``tables`` on the SSD tier on one
        rank of ``c`` (a group per width and dtype, each a cache of ``ssd.cache_bytes``). A cache
        is assumed to hold the rows looked up most often (an ideal LFU) of the captured id
        frequencies: its hit rate is their share of the distinct rows a step touches (``sum 1 -
        exp(-n p)`` over the cached rows, over all). Rows the samples never saw are misses, and
        they take the Good-Turing share of the ids: the fraction of ids whose row the samples saw
        once (Good 1953; a row seen once is as likely a new row as a returning one).
        A miss is a random read and, the row being updated, a write-back later (its record
        appended); host bytes are the caches and their bookkeeping (17 bytes a slot), and the
        indexes of the rows (the cache's slot, 4 bytes a row; the file's position, 8)."""
        share = c.dp if c.tables is TablePlacement.ROW_SHARDED else 1
        groups: dict[tuple[int, int], list[TableInfo]] = {}
        for t in tables:
            groups.setdefault((t.dim, t.row_bytes), []).append(t)
        seconds, host, hits, distinct = 0.0, 0, 0.0, 0.0
        for members in groups.values():
            record = max(self.record_bytes(t) for t in members)
            slots = max(1, self.ssd.cache_bytes // record)
            touched, new_rows = [], 0.0
            for t in members:
                traffic = self.graph.traffic.get(t.name)
                if traffic is not None and traffic.counts:
                    n = self.rows(t, c)[0] * c.micro_batches  # ids a step on one rank
                    counts = np.asarray(traffic.counts, dtype=np.float64)
                    unseen = float((counts == 1).sum() / counts.sum())  # Good-Turing: ids of rows never seen
                    touched.append(-np.expm1(-n * (1 - unseen) * counts / counts.sum()))  # a seen row's chance a step
                    new_rows += n * unseen  # (each a distinct row, a miss)
            chances = np.sort(np.concatenate(touched))[::-1] if touched else np.zeros(0)
            rate = float(chances[:slots].sum() / (chances.sum() + new_rows)) if chances.size else 0.0
            rows = sum(self.updated_rows(t, c) for t in members)
            seconds += rows * (1.0 - rate) * (self.disk.read_s + (record + 8) * self.disk.write_s_per_byte)
            host += slots * (record + 17) + 12 * sum(t.rows for t in members) // share
            hits, distinct = hits + rows * rate, distinct + rows
        return seconds, int(host), hits / distinct if distinct else 0.0

    def updated_rows(self, t: TableInfo, c: Candidate) -> float:
        """Rows of table ``t`` one rank's sparse optimizer updates per step: its own distinct
        rows; beside ``dp`` every rank's (replicated: the exchanged sum's rows), or the share
        of them it owns (row-sharded)."""
        rows = self.rows(t, c)[1]
        if c.dp == 1:
            return rows
        every = self.rows(t, Candidate(micro_batches=c.micro_batches))[1]  # the global batch's
        return every / c.dp if c.tables is TablePlacement.ROW_SHARDED else every

    def exchange(self, tables: list[TableInfo], c: Candidate) -> float:
        """Seconds of the host tables' sparse exchange over ``dp`` ranks per step
        (:class:`hetero.parallel.data_parallel.DistributedSparse`; an all-to-all priced as an
        all-gather of its per-destination share, as for tp): replicated - once per step, every
        table group's distinct rows (ids and gradient rows) all-gathered after a count
        all-gather; row-sharded - each pass's lookups (counts, ids, rows back: three
        all-to-alls per group) and, once per step, a flag all-reduce and one all-to-all of every
        pass's gradient rows to their owners (:mod:`hetero.parallel.row_sharded`)."""
        curves = self.cal.collective_curves(c.dp) if c.dp > 1 and tables else None
        if not curves:
            return 0.0
        n, gather = c.dp, curves[Collective.ALL_GATHER]
        groups: dict[str, list[TableInfo]] = {}
        for t in tables:
            groups.setdefault(t.group or t.name, []).append(t)
        if c.tables is not TablePlacement.ROW_SHARDED:
            rows = sum(self.rows(t, c)[1] * (8 + 4 * t.dim) for t in tables)
            return gather.seconds(8 * len(groups)) + gather.seconds(rows)
        seconds, sent = curves[Collective.ALL_REDUCE].seconds(8 * len(groups)), 0.0
        for group in groups.values():
            unique = sum(self._counts(t, c)[2] for t in group)  # a pass's distinct ids (each owner asked once)
            dim = group[0].dim
            seconds += c.micro_batches * (gather.seconds(8) + gather.seconds(8 * unique / n) +
                                          gather.seconds(4 * dim * unique / n))
            sent += c.micro_batches * 4 * dim * unique
        return seconds + gather.seconds(sent / n)
