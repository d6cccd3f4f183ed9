"""A TorchRec model on hetero's tables: :func:`shard_modules` and :class:`DistributedModelParallel`,
in the style of TorchRec's own (``torchrec.distributed.shard_modules`` /
``DistributedModelParallel``, torchrec/distributed/model_parallel.py).

Every ``torchrec`` ``EmbeddingBagCollection``, ``FusedEmbeddingBagCollection`` and
``EmbeddingCollection`` of a model (found by type) is replaced by hetero's counterpart
(:mod:`hetero.torchrec.modules`) holding the same rows, placed by the plan
(:mod:`hetero.torchrec.plan`) and trained by hetero's kernel of its TorchRec sparse optimizer
(:mod:`hetero.torchrec.optimizer`), inside ``loss.backward()`` as TorchRec's fused ones run.
Order, on every rank: convert, move the SSD tier's tables there (their current rows written),
row-shard (a collective), build the sparse optimizers (their state per shard), wrap the dense
part in DDP (``init_data_parallel``, several ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, EmbeddingCollectionInterface
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchRecEC
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection as TorchRecFusedEBC
from torchrec.optim.keyed import CombinedOptimizer

from hetero.dynamic import Keys
from hetero.embedding import host_tables, move_tables_to_ssd
from hetero.parallel.data_parallel import check_replicas, data_parallel
from hetero.parallel.env import DataParallelGroup, world_size
from hetero.parallel.row_sharded import shard_rows
from hetero.planner.space import TablePlacement
from hetero.ps import PSJob
from hetero.placement import StorageTier
from hetero.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection
from hetero.torchrec.optimizer import FusedTables, rule_of_class, rule_of_fused_params
from hetero.planner.table_plan import SparseRule, TablePlan, plan_of

log = logging.getLogger("hetero")
_COLLECTIONS = (TorchRecEBC, TorchRecFusedEBC, TorchRecEC)


def _parts(module: nn.Module) -> tuple[list[Any], nn.ModuleDict]:
    """A TorchRec collection's table configs and its tables' modules (``embeddings`` / ``embedding_bags``)."""
    if isinstance(module, TorchRecEC):
        return module.embedding_configs(), module.embeddings
    return module.embedding_bag_configs(), module.embedding_bags


def _rules(module: nn.Module, plan: TablePlan | Mapping[str, TablePlan], fused_params: Mapping[str, Any] | None,
           where: str) -> dict[str, SparseRule]:
    """Each table's sparse optimizer: the plan's, else the TorchRec module's own (a fused module's
    type and kwargs, ``apply_optimizer_in_backward``'s on the weight), else ``fused_params``."""
    configs, old = _parts(module)
    rules = {}
    for c in configs:
        source = f"{where}: table {c.name!r}"
        planned = plan_of(plan, c.name).optimizer
        weight = old[c.name].weight
        classes = getattr(weight, "_optimizer_classes", [])
        if planned is not None:
            rules[c.name] = planned
        elif isinstance(module, TorchRecFusedEBC):
            rules[c.name] = rule_of_class(module.optimizer_type(), module._optimizer_kwargs, True, source)
        elif classes:
            if len(classes) > 1:
                raise ValueError(f"{source} has {len(classes)} optimizers in backward; hetero takes one")
            rules[c.name] = rule_of_class(classes[0], weight._optimizer_kwargs[0], False, source)
        elif fused_params is not None:
            rules[c.name] = rule_of_fused_params(fused_params, source)
        else:
            raise ValueError(f"{source} has no sparse optimizer: apply_optimizer_in_backward(...) to its weight, give "
                             f"fused_params, or a rule in the plan (TablePlan(optimizer=...))")
    return rules


def _convert(module: nn.Module, plan: TablePlan | Mapping[str, TablePlan], rules: Mapping[str, SparseRule]) -> nn.Module:
    """hetero's collection in place of the TorchRec one ``module``, holding its rows."""
    configs, old = _parts(module)
    rows = not any(m.weight.is_meta for m in old.values())
    if isinstance(module, TorchRecEC):
        new: nn.Module = EmbeddingCollection(configs, module.need_indices(), rules=rules, plan=plan, has_rows=rows)
    else:
        new = EmbeddingBagCollection(configs, module.is_weighted(), rules=rules, plan=plan, has_rows=rows)
    for c in configs:
        weight, table = old[c.name].weight, new.tables[c.name]
        if weight.is_meta or table.weight.is_meta or table.config.keys is Keys.DYNAMIC:
            # (rows from hetero's initializer of TorchRec's U(min, max): a meta module; parameter servers,
            # which build their shards from the seeds; a dynamic table's at admission)
            continue
        table.weight.data.copy_(weight.detach())  # (one host copy of each table: its rows are TorchRec's)
    return new


def shard_modules(module: nn.Module, plan: TablePlan | Mapping[str, TablePlan] = TablePlan(),
                  fused_params: Mapping[str, Any] | None = None, ps_job: PSJob | None = None) -> nn.Module:
    """Replace ``module``'s TorchRec embedding collections by hetero's, in place, and return it.

    Args:
        plan: where the tables live (:mod:`hetero.torchrec.plan`), one for all or per table name.
        fused_params: TorchRec sharder-style ``{"optimizer": EmbOptimType, "learning_rate": ...}``
            for tables without an optimizer of their own.
        ps_job: the parameter-server job (:meth:`hetero.ps.PSJob.init`, before the model is built)
            where the plan puts tables on servers. On a server this call serves until every worker
            called ``ps_job.shutdown()``.

    Each converted collection has ``fused_optimizer`` (:class:`FusedTables`). Collective where the
    plan row-shards (every rank calls it, the model built from the same seed).

    Raises:
        ValueError: an unsupported TorchRec setting (named), a table without a sparse optimizer,
            tables of one model planned onto different distributions, parameter servers without
            ``ps_job`` (or a job without them in the plan), or a model without TorchRec collections.
    """
    found = [(n, m) for n, m in module.named_modules() if type(m) in _COLLECTIONS]  # (exact types: see below)
    for n, m in module.named_modules():
        # another collection type (a subclass, a sharded module) is refused; a wrapper around one of the three
        # (managed collision, feature processors) keeps its own code around the converted inner collection
        if isinstance(m, (EmbeddingBagCollectionInterface, EmbeddingCollectionInterface, *_COLLECTIONS)) \
                and type(m) not in _COLLECTIONS and not any(type(c) in _COLLECTIONS for c in m.modules()):
            raise ValueError(f"{n or type(module).__name__} is a {type(m).__module__}.{type(m).__qualname__}, which "
                             f"hetero.torchrec does not convert yet (it converts EmbeddingBagCollection, "
                             f"FusedEmbeddingBagCollection and EmbeddingCollection)")
    if not found:
        raise ValueError(f"{type(module).__name__} holds no torchrec EmbeddingBagCollection, FusedEmbeddingBagCollection "
                         f"or EmbeddingCollection to put on hetero's tables")
    configs = [c for _, m in found for c in _parts(m)[0]]
    if on_device := [c.name for c in configs if plan_of(plan, c.name).memory is StorageTier.DEVICE_MEMORY]:
        raise ValueError(f"tables {on_device} are planned into device memory: a TorchRec model's tables on the device "
                         f"are not supported by hetero.torchrec yet (TorchRec's own sharding puts them there); "
                         f"plan them into host DRAM or onto the SSD tier")
    converted = []
    for name, m in found:
        new = _convert(m, plan, _rules(m, plan, fused_params, name or type(module).__name__))
        converted.append((name, new))
        if not name:
            module = new
        else:
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, new)
    tables = host_tables(module)
    plans = {q: plan_of(plan, t.name) for q, t in tables.items()}

    for ssd in dict.fromkeys(p.ssd for p in plans.values() if p.memory is StorageTier.SSD):
        move_tables_to_ssd(module, [q for q, p in plans.items() if p.ssd == ssd], ssd)
    distributions = {p.distribution for p in plans.values()}
    if len(distributions) > 1:
        raise ValueError(f"tables planned onto {sorted(d.value for d in distributions)}: one distribution for all of a "
                         f"model's tables is supported yet")
    remote = TablePlacement.PARAMETER_SERVER in distributions
    if remote != (ps_job is not None):
        raise ValueError("tables on parameter servers need the job (shard_modules(..., ps_job=PSJob.init(config)), "
                         "before the model is built), and a job needs tables planned onto its servers "
                         "(TablePlan(distribution=TablePlacement.PARAMETER_SERVER))")
    if remote:
        ps_job.shard_tables(module)
    elif TablePlacement.ROW_SHARDED in distributions:
        shard_rows(module)
    elif world_size() > 1:
        check_replicas(module)  # (replicas must start equal: built from the same seed)
    optimizers = {}
    for name, new in converted:
        optimizers.update(new.build_optimizer(name, remote).named_optimizers())
    if remote:
        ps_job.start(module, optimizers)  # (a server serves here until the workers shut down)
    return module


class DistributedModelParallel(nn.Module):
    """TorchRec's ``DistributedModelParallel`` on hetero's tables: ``module``'s collections
    converted (:func:`shard_modules`) and, with several ranks (``init_data_parallel``), its dense
    part in DDP. ``fused_optimizer`` is every table's optimizer (a ``CombinedOptimizer``);
    ``state_dict`` / ``load_state_dict`` use the model's own keys (TorchRec's).

    Args:
        module: a model holding TorchRec collections.
        device: where the dense part runs (default: where it is).
        plan: where the tables live (:class:`~hetero.torchrec.plan.TablePlan`, or per table name).
        sharders: TorchRec sharders; only their ``fused_params`` are read (the optimizer of
            tables that have none of their own).
        init_data_parallel: wrap the dense part in DDP when the job has several ranks (several
            workers of a parameter-server job: over its workers).
        ps_job: the parameter-server job, where the plan puts tables on servers (:func:`shard_modules`).
    """

    def __init__(self, module: nn.Module, device: torch.device | None = None,
                 plan: TablePlan | Mapping[str, TablePlan] = TablePlan(), sharders: Sequence[Any] | None = None,
                 init_data_parallel: bool = True, ps_job: PSJob | None = None) -> None:
        super().__init__()
        fused = next((s.fused_params for s in sharders or [] if getattr(s, "fused_params", None)), None)
        self._inner = shard_modules(module, plan, fused, ps_job)
        if device is not None:
            self._inner.to(device)  # (hetero's tables stay on the host; their outputs go to the device)
        dp = ps_job.dp if ps_job is not None else DataParallelGroup()  # (a server's is None: it trains nothing)
        wrap = init_data_parallel and dp is not None and dp.active
        self._module = data_parallel(self._inner, group=dp) if wrap else self._inner
        self.fused_optimizer = CombinedOptimizer([(n, m.fused_optimizer) for n, m in self._inner.named_modules()
                                                  if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))])

    def named_sparse_optimizers(self) -> dict[str, Any]:
        """hetero's sparse optimizers of every table by stable name (:meth:`FusedTables.named_optimizers`):
        the ``sparse_optimizers`` of :func:`hetero.parallel.save_distributed_checkpoint` / ``load_...``."""
        return {k: o for _, m in self.fused_optimizer.optimizers for k, o in m.named_optimizers().items()}

    @property
    def module(self) -> nn.Module:
        """The converted model (unwrapped)."""
        return self._inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        return self._module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # noqa: ANN401
        return self._inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # noqa: ANN401
        return self._inner.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        return self._inner.named_parameters(*args, **kwargs)
