"""Several host tables looked up together, one kernel call per table group."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from hetero.embedding.group import TableGroup
from hetero.embedding.plan import LookupPlan, Request
from hetero.embedding.table import DeviceEmbedding, HostEmbedding, TableConfig
from hetero.placement import StorageTier
from hetero.storage import SsdConfig, SsdRows


Lookup = tuple[str, str]  # (feature, table name): one lookup of a collection


class HostEmbeddingCollection(nn.Module):
    """Tables keyed by name; ``forward`` maps feature name -> ids, returns table name -> output.

    Tables of equal ``embedding_dim`` and dtype share one host storage (a :class:`TableGroup`):
    the 26 tables of a Criteo model are checked, deduplicated, gathered, pooled and updated in
    one call per group, not in a Python loop over tables.

    Input: a mapping from feature name to ids (a tensor), to ``(ids, offsets)`` for bags, or to
    ``(ids, offsets, weights)`` for weighted bags (see :class:`HostEmbedding` for shapes). Output:
    a dict from table name to the table's output.

    Args:
        tables: the tables.
        lookups: ``(feature, table name)`` pairs, the lookups of a forward in output order (default:
            each table once, of its ``feature_name``). A table may be looked up by several
            features (TorchRec's shared tables): :meth:`lookup` gives one output a pair, and
            ``forward``, which keys its output by table, needs one pair a table.

    Raises:
        KeyError: a table's feature is missing from the input.
        ValueError: duplicate table names, or a lookup of a table that is not given.
    """

    # The name of the module dict holding the tables: their state_dict keys are <name>.<table>.weight
    # (TorchRec's collections name it "embedding_bags" / "embeddings": hetero.torchrec).
    tables_attribute: ClassVar[str] = "tables"

    def __init__(self, tables: list[TableConfig] | tuple[TableConfig, ...], lookups: Sequence[Lookup] | None = None) -> None:
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        # (registered by hand: add_module refuses a name the class has, the property below)
        self._modules[self.tables_attribute] = nn.ModuleDict({t.name: HostEmbedding(t) for t in tables})
        self.lookups: list[Lookup] = list(lookups) if lookups is not None else [(t.feature_name, t.name) for t in tables]
        if unknown := [n for _, n in self.lookups if n not in names]:
            raise ValueError(f"lookups of tables {unknown}, which are not among the collection's tables {names}")
        # Plans handed over by a prefetcher, in batch order, with the requests they were built for
        # (before regroup(), which drops them).
        self._prepared: collections.deque[tuple[list[list[Request]], list[LookupPlan | None]]] = collections.deque()
        self.regroup()
        self.mismatched_plans = 0  # prepared plans dropped because the lookup asked for other ids

    @property
    def tables(self) -> nn.ModuleDict:
        """The tables by name (:class:`HostEmbedding`, or :class:`DeviceEmbedding` once moved)."""
        return self._modules[self.tables_attribute]

    def regroup(self) -> None:
        """Merge the host tables into groups of one width and dtype (at construction, and after
        some tables moved to the device: their rows leave the groups' storage)."""
        by_kind: dict[tuple, list[HostEmbedding]] = {}
        for t in self.tables.values():
            if isinstance(t, HostEmbedding):
                by_kind.setdefault(self.group_key(t), []).append(t)
        self.groups = [TableGroup(ts) for ts in by_kind.values()]
        self._prepared.clear()  # plans of the old groups

    def group_key(self, table: HostEmbedding) -> tuple:
        """What tables must share to share a group: width, dtype and storage (a subclass adds
        what else must be one a group, e.g. its sparse optimizer)."""
        c = table.config
        return c.embedding_dim, c.dtype, c.storage, c.ssd

    def feature_inputs(self, features: Any) -> Mapping[str, Tensor | tuple[Tensor, ...]]:  # noqa: ANN401
        """The forward's input as feature name -> ids / ``(ids, offsets[, weights])`` (the input
        itself here; a ``KeyedJaggedTensor``'s features in hetero.torchrec's collections)."""
        return features

    def requests(self, features: Any) -> list[list[Request]]:  # noqa: ANN401 - what forward takes
        """The lookup requests of ``features`` (what ``forward`` takes), one list per group (in
        lookup order within it)."""
        return self._requests(self.feature_inputs(features))

    def _requests(self, features: Mapping[str, Tensor | tuple[Tensor, ...]]) -> list[list[Request]]:
        out = []
        for group in self.groups:
            reqs = []
            for feature, name in self.lookups:
                table = self.tables[name]
                if isinstance(table, HostEmbedding) and table.group is group:
                    x = _feature(table, feature, features)
                    reqs.append(Request(table, *x) if isinstance(x, tuple) else Request(table, x))
            out.append(reqs)
        return out

    def prepare(self, features: Mapping[str, Tensor | tuple[Tensor, Tensor]], plans: list[LookupPlan | None]) -> None:
        """Queue plans built ahead of time (by a prefetcher) for the next lookup, of ``features``, one a
        group (``None``: the group builds its plan at the lookup)."""
        self._prepared.append((self.requests(features), plans))

    def start(self, features: Mapping[str, Tensor | tuple[Tensor, Tensor]]) -> None:
        """Start this collection's lookups of ``features`` whose rows come from other processes
        (parameter servers: :meth:`RowExchange.start`), so that the servers work while the caller
        does something else - a model's other collection's lookups; the next forward with the same
        features takes them (other features: it looks up afresh, the started replies read and
        dropped). Does nothing where no group starts lookups, when plans are queued already (a
        prefetcher's), or for fake ids (:mod:`hetero.planner`)."""
        if self._prepared or not any(g.exchange.starts_lookups() for g in self.groups):
            return
        requests = self.requests(features)
        if any(is_fake(r.ids) for reqs in requests for r in reqs):
            return
        plans = [g.plan(reqs) if g.exchange.starts_lookups() and reqs else None for g, reqs in zip(self.groups, requests)]
        for group, plan in zip(self.groups, plans):
            if plan is not None:
                group.exchange.start(plan)
        self._prepared.append((requests, plans))

    def drop_prepared(self) -> None:
        """Forget queued plans (a prefetcher stopped early)."""
        self._prepared.clear()

    def lookup(self, features: Any) -> list[Tensor]:  # noqa: ANN401 - what forward takes
        """The output of each of :attr:`lookups`, in their order (one call per table group)."""
        features = self.feature_inputs(features)
        requests = self._requests(features)
        plans = None
        if self._prepared:
            prepared, plans = self._prepared.popleft()
            if not _same_requests(prepared, requests):
                # The model was called with other ids than the prefetcher prepared (a batch skipped,
                # or features changed between them): the plans do not apply; look up afresh.
                self.mismatched_plans += 1
                self._prepared.clear()
                plans = None
        host: dict[int, list[Tensor]] = {}  # a group's outputs by group index, in its requests' order
        for i, (group, reqs) in enumerate(zip(self.groups, requests)):
            host[i] = list(group.lookup(reqs, None if plans is None else plans[i])) if reqs else []
        taken = [0] * len(self.groups)
        index = {g: i for i, g in enumerate(self.groups)}  # (groups hash by identity)
        out = []
        for feature, name in self.lookups:
            table = self.tables[name]
            if isinstance(table, DeviceEmbedding):
                x = _feature(table, feature, features)
                out.append(table(*x) if isinstance(x, tuple) else table(x))
                continue
            i = index[table.group]
            out.append(host[i][taken[i]])
            taken[i] += 1
        return out

    def forward(self, features: Mapping[str, Tensor | tuple[Tensor, ...]]) -> dict[str, Tensor]:
        names = [name for _, name in self.lookups]
        if len(set(names)) != len(names):
            raise ValueError(f"a table looked up by several features has several outputs: call lookup(), not forward "
                             f"(tables {sorted({n for n in names if names.count(n) > 1})})")
        out = dict(zip(names, self.lookup(features)))
        return {name: out[name] for name in self.tables if name in out}


def _feature(table: HostEmbedding | DeviceEmbedding, key: str, features: Mapping[str, Any]) -> Any:  # noqa: ANN401
    if key not in features:
        raise KeyError(f"table {table.name!r} looks up feature {key!r}, which is not in the batch; "
                       f"batch features: {sorted(features)}")
    return features[key]


def _same_requests(a: list[list[Request]], b: list[list[Request]]) -> bool:
    """Whether two lookups ask for the same ids and bags: the same tensors (a feature mapping
    rebuilt around them), or equal ones (one pass over the ids when they are copies)."""
    for ra, rb in zip((r for g in a for r in g), (r for g in b for r in g)):
        for x, y in ((ra.ids, rb.ids), (ra.offsets, rb.offsets), (ra.weights, rb.weights)):
            if x is y:
                continue
            if x is None or y is None or x.shape != y.shape or x.device != y.device or not torch.equal(x, y):
                return False
    return True


def move_tables_to_ssd(model: nn.Module, names: list[str], ssd: SsdConfig, write: bool = True) -> None:
    """Put the host tables ``names`` (qualified names) of ``model`` on the SSD tier ``ssd``: the
    collections holding them regroup, and each new group's store is written with the tables'
    rows as they are now (then their host memory is let go); ``write=False``: nothing written,
    the stores are restored from a checkpoint next. Build sparse optimizers after it.

    Raises:
        ValueError: a name that is no host table of ``model`` (listing them), or tables on the
            tier ``ssd`` already.
    """
    modules = dict(model.named_modules())
    rows: dict[HostEmbedding, Tensor] = {}  # (modules hash by identity)
    there = [n for n, m in modules.items() if isinstance(m, HostEmbedding) and m.config.ssd == ssd]
    if there:  # (they would regroup with the moved ones into a new store)
        raise ValueError(f"tables {there} are on the SSD tier {ssd.directory} already: move the others to another "
                         f"directory, or build them all there")
    bad = [n for n in names if not isinstance(modules.get(n), HostEmbedding)]
    if bad:  # (before anything changes)
        tables = [n for n, m in modules.items() if isinstance(m, HostEmbedding)]
        raise ValueError(f"{bad[0]!r} is not a host table of {type(model).__name__}; its host tables are {tables}")
    for name in names:
        table = modules[name]
        rows[table] = table.weight.data
        table.config = dataclasses.replace(table.config, storage=StorageTier.SSD, ssd=ssd)
        # (a new parameter: a host tensor's data cannot become a meta tensor)
        table.weight = nn.Parameter(torch.empty(tuple(table.weight.shape), dtype=table.weight.dtype, device="meta"),
                                    requires_grad=False)
        TableGroup([table])  # (a table outside any collection: a group of its own)
    for m in model.modules():
        if isinstance(m, HostEmbeddingCollection) and any(t in rows for t in m.tables.values()):
            m.regroup()
    moved = [m for m in modules.values() if isinstance(m, HostEmbedding) and m in rows and write]
    for g in dict.fromkeys(m.group for m in moved):  # (each new group once, in model order; groups hash by identity)
        def initial(lo: int, hi: int, g: TableGroup = g) -> Tensor:  # (the tables' current rows, not their seeds')
            out = torch.empty(hi - lo, g.dim, dtype=g.dtype)
            for t in g.tables:
                a, b = max(lo, t.group_row), min(hi, t.group_row + t.config.num_rows)  # (a dynamic table's default row too)
                if a < b:
                    out[a - lo : b - lo] = rows[t][a - t.group_row : b - t.group_row]
            return out

        g.place(g.exchange, ssd=SsdRows(g.ssd_name, g.num_rows, g.dim, g.dtype, ssd, initial, g.ssd_state or {}))


def start_lookups(model: nn.Module, features: Mapping[str, Tensor | tuple[Tensor, Tensor]]) -> None:
    """:meth:`HostEmbeddingCollection.start` of every collection of ``model``, in model order, with
    the batch's ``features`` (a trainer starting the next batch's lookups while it finishes this
    step). For models whose collections look up the batch's features as given (the built-in ones);
    a collection then looking up other ids wastes only its started pulls (read and dropped)."""
    for m in model.modules():
        if isinstance(m, HostEmbeddingCollection):
            m.start(features)


def drop_started_lookups(model: nn.Module) -> None:
    """Forget every collection's started or prefetched plans (:meth:`HostEmbeddingCollection.drop_prepared`)."""
    for m in model.modules():
        if isinstance(m, HostEmbeddingCollection):
            m.drop_prepared()


def move_tables_to_device(model: nn.Module, names: list[str], device: torch.device) -> dict[str, DeviceEmbedding]:
    """Replace the host tables ``names`` (qualified names) of ``model`` by
    :class:`DeviceEmbedding` copies on ``device`` (one host->device copy of each table; the
    collections holding them regroup their remaining host tables). Returns them by name.

    Raises:
        ValueError: a name that is no host table of ``model`` (listing them), or a table that is
            not float32.
    """
    modules = dict(model.named_modules())
    out = {}
    for name in names:
        table = modules.get(name)
        if not isinstance(table, HostEmbedding):
            tables = [n for n, m in modules.items() if isinstance(m, HostEmbedding)]
            raise ValueError(f"{name!r} is not a host table of {type(model).__name__}; its host tables are {tables}")
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name]
        out[name] = DeviceEmbedding.from_host(table, device)
        setattr(parent, attr, out[name])  # (a ModuleDict's item or a module's attribute)
    for m in model.modules():
        if isinstance(m, HostEmbeddingCollection) and any(isinstance(t, DeviceEmbedding) for t in m.tables.values()):
            m.regroup()
    return out
