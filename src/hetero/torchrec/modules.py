"""hetero's tables behind TorchRec's collection interfaces: ``KeyedJaggedTensor`` in,
``KeyedTensor`` (pooled) or ``dict[str, JaggedTensor]`` (sequence) out, TorchRec's ``state_dict``
keys (``embedding_bags.<table>.weight`` / ``embeddings.<table>.weight``).

Both are :class:`~hetero.embedding.HostEmbeddingCollection` s, so every hetero mechanism that acts
on a collection (the SSD tier, row sharding, dynamic tables, parameter servers, prefetch, the
planner) acts on them. The layout of the output follows TorchRec's ``EmbeddingBagCollection`` /
``EmbeddingCollection`` (torchrec/modules/embedding_modules.py): features in table order, then in
each table's ``feature_names`` order; a feature read by several tables is named ``feature@table``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

try:
    import torchrec  # noqa: F401 - an optional dependency: one line saying how to install it
except ModuleNotFoundError:
    raise ModuleNotFoundError("hetero.torchrec needs TorchRec: pip install 'hetero[torchrec]' and then "
                              "pip install --no-deps torchrec==1.8.0 (make does both)") from None
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from hetero.embedding import HostEmbedding, HostEmbeddingCollection, Pooling, TableConfig
from hetero.optim.container import OptimizersContainer
from hetero.parallel.data_parallel import DistributedSparse
from hetero.parallel.env import world_size
from hetero.ps.client import PSSparse
from hetero.torchrec.optimizer import FusedTables
from hetero.planner.table_plan import SparseRule, TablePlan, plan_of

_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
_POOLING = {PoolingType.SUM: Pooling.SUM, PoolingType.MEAN: Pooling.MEAN}
# TorchRec's config fields hetero does not take yet, with the value that means "not used"
_UNSUPPORTED = {"num_embeddings_post_pruning": None, "need_pos": False, "input_dim": None,
                "total_num_buckets": None, "use_virtual_table": False, "virtual_table_eviction_policy": None,
                "enable_embedding_update": False, "stash_weights": False}


def _init(config: BaseEmbeddingConfig) -> dict[str, Any]:
    """TorchRec's initializer as a TableConfig's: ``init_fn`` (TorchRec sets it to
    ``partial(uniform_, a=min, b=max)``, default ``+-sqrt(1 / num_embeddings)``) or the range."""
    fn = config.init_fn
    if fn is None:
        return {"init_range": (config.get_weight_init_min(), config.get_weight_init_max())}
    if isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_ and not fn.args:
        return {"init_range": (fn.keywords.get("a", 0.0), fn.keywords.get("b", 1.0))}
    if isinstance(fn, functools.partial) and fn.func is torch.nn.init.normal_ and not fn.args \
            and fn.keywords.get("mean", 0.0) == 0.0:
        return {"init_std": fn.keywords.get("std", 1.0)}
    raise ValueError(f"TorchRec table {config.name!r}: init_fn={fn!r} is not supported by hetero yet (uniform_ or "
                     f"normal_ of mean 0); build the module on the CPU, not on meta, and its rows are copied")


def table_config(config: BaseEmbeddingConfig, pooling: Pooling, has_rows: bool = False) -> TableConfig:
    """The hetero :class:`TableConfig` of a TorchRec ``EmbeddingBagConfig`` / ``EmbeddingConfig``:
    its name, rows, width, dtype and (``has_rows=False``: a module on ``meta``, whose rows hetero
    initialises) TorchRec's initializer. Where it lives is the plan's (:mod:`hetero.torchrec.plan`).

    Raises:
        ValueError: a field hetero does not support yet, named with its value (nothing is dropped
            silently), or a data type other than FP32 / FP16 / BF16.
    """
    for field, unused in _UNSUPPORTED.items():
        value = getattr(config, field, unused)
        if value != unused and not (field == "use_virtual_table" and value is False):
            hint = "; a table keyed by raw ids is a dynamic table: give it TablePlan(keys=Keys.DYNAMIC)" \
                if field in ("use_virtual_table", "total_num_buckets", "virtual_table_eviction_policy") else ""
            raise ValueError(f"TorchRec table {config.name!r}: {field}={value!r} is not supported by hetero yet{hint}")
    if config.data_type not in _DTYPES:
        raise ValueError(f"TorchRec table {config.name!r}: data_type {config.data_type.name} is not supported by hetero "
                         f"(FP32, FP16 or BF16)")
    init = {"init_range": (config.get_weight_init_min(), config.get_weight_init_max())} if has_rows else _init(config)
    return TableConfig(name=config.name, num_embeddings=config.num_embeddings, embedding_dim=config.embedding_dim,
                       pooling=pooling, dtype=_DTYPES[config.data_type], **init)


def _lookups(configs: list[BaseEmbeddingConfig]) -> tuple[list[tuple[str, str]], list[str]]:
    """Each (feature, table) lookup in TorchRec's output order, and its output name."""
    pairs = [(f, c.name) for c in configs for f in (c.feature_names or [c.name])]
    names = [n for names in get_embedding_names_by_table(configs) for n in names]
    return pairs, names


def _features(kjt: KeyedJaggedTensor, weighted: bool, needed: list[str], who: str) -> dict[str, tuple[Tensor, ...]]:
    """A KJT's features as ``(ids,)`` - ``(B, 1)`` ids when every bag holds one id (hetero's lookup
    of bags of one, no offsets) - or ``(values, offsets[, weights])``, per key: one split of its
    values (and of its lengths and weights), no per-key ``JaggedTensor``."""
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"{who} takes a torchrec KeyedJaggedTensor, got {type(kjt).__name__}")
    if kjt.variable_stride_per_key():
        raise ValueError(f"{who}: a KeyedJaggedTensor of a batch size per key (variable batch) is not supported yet")
    weights = kjt.weights_or_none()
    if weighted and weights is None:
        raise ValueError(f"{who} is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights")
    if not weighted and weights is not None:  # (TorchRec would drop them: refused, never silently ignored)
        raise ValueError(f"{who} is not weighted but the KeyedJaggedTensor carries per-sample weights: build the "
                         f"collection with is_weighted=True, or drop the weights")
    keys, per_key = kjt.keys(), kjt.length_per_key()
    if missing := [f for f in needed if f not in keys]:
        raise KeyError(f"{who} looks up features {missing}, which are not in the KeyedJaggedTensor (keys {keys})")
    values, lengths, batch = kjt.values(), kjt.lengths(), kjt.stride()
    if not weighted and values.numel() == lengths.numel() and bool((lengths == 1).all()):  # (one pass over F x B)
        return {k: (v.view(-1, 1),) for k, v in zip(keys, values.split(per_key))}
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    out = {}
    per_id = weights.split(per_key) if weighted else [None] * len(keys)  # (one weight an id: split as the values)
    for i, (k, v, w) in enumerate(zip(keys, values.split(per_key), per_id)):
        off = offsets[i * batch : (i + 1) * batch + 1]
        off = off - off[0]  # (a key's bags from 0 over its own values)
        out[k] = (v, off, w) if weighted else (v, off)
    return out


class _Trained:
    """What both collections add to :class:`HostEmbeddingCollection`: each table's sparse rule
    (tables of one group share one) and the ``fused_optimizer`` built over them."""

    _rules: Mapping[str, SparseRule]
    fused_optimizer: FusedTables | None = None

    def group_key(self, table: HostEmbedding) -> tuple:
        return (*super().group_key(table), self._rules.get(table.name))

    def build_optimizer(self, prefix: str, remote: bool = False) -> FusedTables:
        """The tables' sparse optimizers, one per rule (over the ranks when there are several:
        ``DistributedSparse``; ``remote``: pushed to parameter servers, ``PSSparse``), as
        :attr:`fused_optimizer`; build after the tables are placed."""
        tables = {f"{prefix}.{self.tables_attribute}.{n}".lstrip("."): t for n, t in self.tables.items()}
        sparse = {}
        for i, rule in enumerate(dict.fromkeys(self._rules.values())):  # (names stable across runs and world sizes)
            own = {q: t for q, t in tables.items() if self._rules[t.name] == rule}
            sparse[f"{prefix}.{rule.kind.optimizer.__name__}.{i}".lstrip(".")] = rule.kind.optimizer(own, rule.config)
        wrap = PSSparse if remote else DistributedSparse if world_size() > 1 else None
        steppers = {k: wrap(o) for k, o in sparse.items()} if wrap is not None else {}
        self.fused_optimizer = FusedTables(tables, OptimizersContainer(sparse=sparse, steppers=steppers, remote=remote))
        return self.fused_optimizer

    def trained(self, out: Tensor) -> Tensor:
        """``out`` (an output of this collection), its gradient queueing the tables' update."""
        if self.fused_optimizer is not None and out.requires_grad:
            out.register_hook(self.fused_optimizer.queue)  # (fires in backward, before the tables' own nodes)
        return out


class EmbeddingBagCollection(_Trained, HostEmbeddingCollection):
    """hetero's counterpart of ``torchrec.EmbeddingBagCollection`` (pooled lookups).

    Args:
        configs: TorchRec ``EmbeddingBagConfig`` s (SUM or MEAN pooling).
        is_weighted: the input carries per-sample weights (``KeyedJaggedTensor.weights()``), which
            scale each id's row in its bag's pooling; they take no gradient.
        rules: each table's sparse optimizer (:func:`hetero.torchrec.shard_modules` reads them).
        plan: where the tables live (their keys here; the rest :func:`~hetero.torchrec.shard_modules` applies).
        has_rows: the caller copies the tables' rows in (TorchRec's initializer is then not needed).

    Forward: a ``KeyedJaggedTensor`` of ``F`` keys over a batch of ``B`` (lengths or offsets; empty
    bags pool to zeros) -> a ``KeyedTensor`` of values ``(B, sum of D)`` float32, keys and
    ``length_per_key`` as TorchRec's. Rows live on the host (or where the plan put them); the output
    goes where the module was moved (``.to(device)``).

    Raises:
        ValueError: an unsupported config (:func:`table_config`), NONE pooling, weights where the
            collection is unweighted or none where it is weighted.
        KeyError: a feature missing from the input.
    """

    tables_attribute: ClassVar[str] = "embedding_bags"

    def __init__(self, configs: list[Any], is_weighted: bool = False,  # noqa: ANN401 - TorchRec configs
                 rules: Mapping[str, SparseRule] | None = None,
                 plan: TablePlan | Mapping[str, TablePlan] = TablePlan(), has_rows: bool = False) -> None:
        for c in configs:
            if c.pooling not in _POOLING:
                raise ValueError(f"TorchRec table {c.name!r}: pooling {c.pooling.name} in an EmbeddingBagCollection; "
                                 f"use an EmbeddingCollection for per-id lookups")
        pairs, self._names = _lookups(configs)
        self._rules = dict(rules or {})  # (before the groups form: they split by rule)
        super().__init__([plan_of(plan, c.name).table(table_config(c, _POOLING[c.pooling], has_rows)) for c in configs], pairs)
        self._configs, self._is_weighted = list(configs), is_weighted
        self._dims = [c.embedding_dim for c in configs for _ in (c.feature_names or [c.name])]

    def feature_inputs(self, features: Any) -> Mapping[str, tuple[Tensor, ...]]:  # noqa: ANN401 - a KJT
        if isinstance(features, Mapping):  # (read already: the planner's capture hands them over)
            return features
        return _features(features, self._is_weighted, [f for f, _ in self.lookups], type(self).__name__)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        # (one copy: the pooled outputs side by side, as TorchRec's collection concatenates them)
        values = self.trained(torch.cat(self.lookup(features), dim=1))
        return KeyedTensor(keys=self._names, length_per_key=self._dims, values=values)

    def embedding_bag_configs(self) -> list[Any]:  # noqa: ANN401 - TorchRec's interface
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted


class EmbeddingCollection(_Trained, HostEmbeddingCollection):
    """hetero's counterpart of ``torchrec.EmbeddingCollection`` (a row per id, no pooling).

    Forward: a ``KeyedJaggedTensor`` -> ``dict[str, JaggedTensor]``: per output name, values
    ``(N_f, D)`` float32 (one row per id of feature ``f``) with the input's lengths; with
    ``need_indices``, the ids as its weights (as TorchRec's).

    Raises:
        ValueError: an unsupported config (:func:`table_config`), or tables of different widths
            (TorchRec's collection has one ``embedding_dim``).
    """

    tables_attribute: ClassVar[str] = "embeddings"

    def __init__(self, configs: list[Any], need_indices: bool = False,  # noqa: ANN401 - TorchRec configs
                 rules: Mapping[str, SparseRule] | None = None,
                 plan: TablePlan | Mapping[str, TablePlan] = TablePlan(), has_rows: bool = False) -> None:
        dims = {c.embedding_dim for c in configs}
        if len(dims) > 1:
            raise ValueError(f"an EmbeddingCollection's tables have one embedding_dim, got {sorted(dims)}")
        pairs, self._names = _lookups(configs)
        self._rules = dict(rules or {})
        super().__init__([plan_of(plan, c.name).table(table_config(c, Pooling.NONE, has_rows)) for c in configs], pairs)
        self._configs, self._need_indices, self._dim = list(configs), need_indices, dims.pop()

    def feature_inputs(self, features: Any) -> Mapping[str, tuple[Tensor, ...]]:  # noqa: ANN401 - a KJT
        out = _features(features, False, [f for f, _ in self.lookups], type(self).__name__)
        return {k: v[0].reshape(-1) for k, v in out.items()}  # (per-id lookups: the values alone, (N,))

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        jts = features.to_dict()
        out = {}
        for name, (feature, _), rows in zip(self._names, self.lookups, self.lookup(features)):
            jt = jts[feature]
            out[name] = JaggedTensor(values=self.trained(rows), lengths=jt.lengths(), weights=jt.values() if self._need_indices else None)
        return out

    def embedding_configs(self) -> list[Any]:  # noqa: ANN401 - TorchRec's interface
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return get_embedding_names_by_table(self._configs)
