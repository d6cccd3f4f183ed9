"""Where a table lives, as one typed value: :class:`TablePlan` - the seam between what a table is
and where it is placed.

A table's config (:class:`~hetero.embedding.TableConfig`, or a TorchRec ``EmbeddingBagConfig``)
says what it is: name, rows, width, dtype, initializer, features, pooling. A :class:`TablePlan`
says where it lives, on independent axes with the field's names: ``memory`` (device memory, host
DRAM, the SSD tier), ``keys`` (fixed rows, hashed into range, or dynamic with admission and
eviction), ``distribution`` (replicated over the data-parallel ranks, row-wise sharded across them,
or on parameter servers) and the sparse optimizer with its settings (:class:`SparseRule`). A
model's plan is one ``TablePlan`` for every table or a mapping from table name to ``TablePlan``
(``"*"``: the rest). :meth:`TablePlan.of` reads a built table's; :meth:`hetero.planner.plan.Plan.table_plans`
is the planner's choice; ``TableConfig(storage=, ssd=, keys=, dynamic=, hashed=)`` and the job
file's table keys are ways of writing the same axes (TorchRec keeps placement in its sharding plan
in the same way: ``ParameterSharding``, the compute kernel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from typing import Any

from hetero.dynamic import DynamicConfig, Keys
from hetero.embedding import DeviceEmbedding, HostEmbedding, RowPlacement, TableConfig
from hetero.optim import SparseOptimizerKind
from hetero.placement import StorageTier
from hetero.planner.space import TablePlacement
from hetero.storage import SsdConfig

MEMORIES = (StorageTier.DEVICE_MEMORY, StorageTier.HOST_DRAM, StorageTier.SSD)
DISTRIBUTIONS = (TablePlacement.REPLICATED, TablePlacement.ROW_SHARDED, TablePlacement.PARAMETER_SERVER)
_DISTRIBUTION_OF = {RowPlacement.LOCAL: TablePlacement.REPLICATED, RowPlacement.ROW_SHARDED: TablePlacement.ROW_SHARDED,
                    RowPlacement.PARAMETER_SERVER: TablePlacement.PARAMETER_SERVER,
                    RowPlacement.SERVER_SHARD: TablePlacement.PARAMETER_SERVER}


@dataclasses.dataclass(frozen=True)
class SparseRule:
    """A table's sparse optimizer: hetero's kernel and its settings (``kind.optimizer.Config``).

    Raises:
        TypeError: settings of another optimizer.
    """

    kind: SparseOptimizerKind
    config: Any

    def __post_init__(self) -> None:
        if not isinstance(self.config, self.kind.optimizer.Config):
            raise TypeError(f"a {self.kind.value} rule takes a {self.kind.optimizer.Config.__name__}, got "
                            f"{type(self.config).__name__}")


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """Where one table lives and what trains it.

    Attributes:
        memory: ``StorageTier.HOST_DRAM`` (default), ``StorageTier.SSD`` (then ``ssd`` is the
            tier's directory, cache budget and policy; tables of one width there share a store) or
            ``StorageTier.DEVICE_MEMORY`` (torch's embedding on the device, trained by torch's
            sparse optimizer of the same rule; fixed fp32 tables only).
        keys: ``Keys.FIXED`` (ids are rows; ``hashed``: ``id mod num_embeddings``) or ``Keys.DYNAMIC``
            (ids are raw int64 keys, each admitted key given a row; ``num_embeddings`` is the
            capacity; ``dynamic``: admission and eviction). A dynamic table's rows start at
            admission, so the TorchRec module's initial weights are not used.
        distribution: ``TablePlacement.REPLICATED`` (every rank holds the table; sparse gradients
            summed over the ranks), ``TablePlacement.ROW_SHARDED`` (each rank holds a block of
            rows; ids and rows all-to-all) or ``TablePlacement.PARAMETER_SERVER`` (the job's servers
            hold the rows, built from the tables' seeds with TorchRec's initializer; workers pull and
            push them: :mod:`hetero.ps`). At world size 1 the first two are one process's table.
        optimizer: hetero's rule for the table (:class:`~hetero.torchrec.optimizer.SparseRule`,
            e.g. LazyAdam or FTRL); ``None``: the TorchRec model's own.

    Raises:
        ValueError: a memory or distribution that is not supported here, or settings of one
            axis given with another (``ssd`` without the SSD tier, ``dynamic`` without dynamic keys).
    """

    memory: StorageTier = StorageTier.HOST_DRAM
    ssd: SsdConfig | None = None
    keys: Keys = Keys.FIXED
    hashed: bool = False
    dynamic: DynamicConfig | None = None
    distribution: TablePlacement = TablePlacement.REPLICATED
    optimizer: SparseRule | None = None

    def __post_init__(self) -> None:
        if self.memory not in MEMORIES:
            raise ValueError(f"TablePlan.memory is one of {[m.value for m in MEMORIES]}, got {self.memory}")
        if (self.memory is StorageTier.SSD) != (self.ssd is not None):
            raise ValueError("TablePlan: the SSD tier takes an SsdConfig (ssd=), and only it does")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"TablePlan.distribution is one of {[d.value for d in DISTRIBUTIONS]}, got {self.distribution}")

    @staticmethod
    def of(table: HostEmbedding | DeviceEmbedding) -> "TablePlan":
        """Where a built table lives now: its config's tier and keys, its group's distribution."""
        c = table.config
        on_host = isinstance(table, HostEmbedding)  # (else a DeviceEmbedding: torch's rows on the device)
        memory = c.storage if on_host else StorageTier.DEVICE_MEMORY
        distribution = _DISTRIBUTION_OF[table.group.exchange.placement] if on_host else TablePlacement.REPLICATED
        return TablePlan(memory=memory, ssd=c.ssd if memory is StorageTier.SSD else None, keys=c.keys, hashed=c.hashed,
                         dynamic=c.dynamic, distribution=distribution)

    def table(self, config: TableConfig) -> TableConfig:
        """``config`` with this plan's keys (the memory tier is applied to the built tables:
        :func:`hetero.embedding.move_tables_to_ssd` writes their current rows,
        :func:`hetero.embedding.move_tables_to_device` copies them)."""
        if self.keys is Keys.DYNAMIC:
            return dataclasses.replace(config, keys=Keys.DYNAMIC, dynamic=self.dynamic, hashed=False, init_range=None,
                                       init_std=_std(config))
        return dataclasses.replace(config, hashed=self.hashed, dynamic=self.dynamic)


def _std(config: TableConfig) -> float:
    """The standard deviation of ``config``'s uniform initializer (a dynamic row starts normal with it)."""
    lo, hi = config.init_range if config.init_range is not None else (0.0, 0.0)
    return (hi - lo) / 12 ** 0.5 if config.init_range is not None else config.init_std


def plan_of(plan: TablePlan | Mapping[str, TablePlan], table: str) -> TablePlan:
    """The plan of ``table`` (a mapping's entry, its ``"*"``, or the default ``TablePlan()``)."""
    if isinstance(plan, TablePlan):
        return plan
    return plan.get(table, plan.get("*", TablePlan()))
