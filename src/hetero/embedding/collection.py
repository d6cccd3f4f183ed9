"""Several host tables looked up together, one kernel call per table group."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from hetero.embedding.group import LookupPlan, Request, TableGroup
from hetero.embedding.table import HostEmbedding, TableConfig


class HostEmbeddingCollection(nn.Module):
    """Tables keyed by name; ``forward`` maps feature name -> ids, returns table name -> output.

    Tables of equal ``embedding_dim`` and dtype share one host storage (a :class:`TableGroup`):
    the 26 tables of a Criteo model are checked, deduplicated, gathered, pooled and updated in
    one call per group, not in a Python loop over tables.

    Input: a mapping from feature name to ids (a tensor) or to ``(ids, offsets)`` for bags (see
    :class:`HostEmbedding` for shapes). Output: a dict from table name to the table's output.

    Raises:
        KeyError: a table's feature is missing from the input.
        ValueError: duplicate table names.
    """

    def __init__(self, tables: list[TableConfig] | tuple[TableConfig, ...]) -> None:
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        self.tables = nn.ModuleDict({t.name: HostEmbedding(t) for t in tables})
        by_kind: dict[tuple, list[HostEmbedding]] = {}
        for t in self.tables.values():
            by_kind.setdefault((t.config.embedding_dim, t.config.dtype), []).append(t)
        self.groups = [TableGroup(ts) for ts in by_kind.values()]
        # id(features) -> (features, plans); holding ``features`` keeps its id from being reused
        self._prepared: dict[int, tuple[Mapping, list[LookupPlan]]] = {}

    def requests(self, features: Mapping[str, Tensor | tuple[Tensor, Tensor]]) -> list[list[Request]]:
        """The lookup requests of ``features``, one list per group."""
        out = []
        for group in self.groups:
            reqs = []
            for table in group.tables:
                key = table.config.feature_name
                if key not in features:
                    raise KeyError(f"table {table.name!r} looks up feature {key!r}, which is not in the batch; "
                                   f"batch features: {sorted(features)}")
                x = features[key]
                reqs.append(Request(table, *x) if isinstance(x, tuple) else Request(table, x))
            out.append(reqs)
        return out

    def prepare(self, features: Mapping[str, Tensor | tuple[Tensor, Tensor]], plans: list[LookupPlan]) -> None:
        """Hand over plans built ahead of time (by a prefetcher) for the lookup of ``features``."""
        self._prepared[id(features)] = (features, plans)

    def forward(self, features: Mapping[str, Tensor | tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        entry = self._prepared.pop(id(features), None)
        plans = entry[1] if entry is not None and entry[0] is features else None
        out = {}
        for i, (group, reqs) in enumerate(zip(self.groups, self.requests(features))):
            for r, y in zip(reqs, group.lookup(reqs, None if plans is None else plans[i])):
                out[r.table.name] = y
        return {name: out[name] for name in self.tables}
