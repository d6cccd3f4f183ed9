"""Optimizer parallel (ZeRO) for device optimizers: each of the ``dp`` ranks keeps and updates
``1/dp`` of the optimizer state (stage 1), also reduce-scatters the gradients (stage 2), and
also keeps ``1/dp`` of the parameters between uses (stage 3).

Stage 1 is torch's ``ZeroRedundancyOptimizer`` over the data-parallel group (gradients averaged
by DDP as without ZeRO; each rank steps its shard of the parameters and broadcasts them).
Stages 2 and 3 are FSDP2 (``fully_shard``) over the mesh's ``dp`` dimension: parameters become
``Shard(0)`` DTensors, so any ``torch.optim`` optimizer built on them keeps sharded state;
gradients are reduce-scattered in backward; stage 3 frees the gathered parameters after each
unit's forward (``reshard_after_forward=True``), stage 2 keeps them to backward. Operator-parallel
(``tp``) DTensor parameters compose (FSDP2 on a 2-D mesh); host tables are left out
(``ignored_params``): their rows follow the data-parallel group's sparse exchange. Units not
named in :class:`ZeroConfig` are sized by the comm fusion (:func:`fusion_units`). Reference:
Rajbhandari et al. 2020 (ZeRO); the reference design's optimizer parallel; torch's FSDP2.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hetero.embedding import host_tables
from hetero.parallel.comm_fusion import MB, CommFusion, by_size
from hetero.parallel.mesh import MeshDim, mesh_size


class ZeroStage(enum.IntEnum):
    """What the data-parallel ranks shard: nothing, optimizer states, + gradients, + parameters."""

    NONE = 0
    OPTIMIZER_STATES = 1
    GRADIENTS = 2
    PARAMETERS = 3


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """ZeRO over the mesh's ``dp`` dimension.

    Attributes:
        stage: :class:`ZeroStage` (or its number, 0-3).
        units: qualified names of the modules sharded as one unit each (stages 2, 3: their
            parameters are gathered together, one collective per unit; e.g. each Transformer
            block); the root holds the rest. Empty: units by size (:func:`fusion_units`).
    """

    stage: ZeroStage = ZeroStage.NONE
    units: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.stage, ZeroStage):
            if self.stage not in {s.value for s in ZeroStage}:
                raise ValueError(f"ZeRO stage {self.stage!r} does not exist; valid stages are 0, 1, 2, 3")
            object.__setattr__(self, "stage", ZeroStage(self.stage))


def _dp_size(mesh: DeviceMesh, config: ZeroConfig) -> int:
    n = mesh_size(mesh, MeshDim.DP)
    if n == 1 and config.stage is not ZeroStage.NONE:
        warnings.warn(f"ZeRO stage {int(config.stage)} with a data-parallel size of 1 shards nothing: every state "
                      f"stays whole on this rank", stacklevel=3)
    return n


def fusion_unit_names(model: nn.Module, limit_mb: float) -> list[list[str]]:
    """FSDP2 units of about ``limit_mb`` MB of dense parameters each, by qualified module name:
    the model's modules in registration order - a child at most the size whole, a larger one or
    a container (``ModuleDict``, ``ModuleList``: never called itself) split into its children - grouped consecutively until a group reaches the size
    (:func:`~hetero.parallel.comm_fusion.by_size`). Each group is one ``fully_shard`` unit: one
    all-gather of its parameters, one reduce-scatter of their gradients. Host tables and modules
    sharing a parameter with an earlier unit are left to the root's unit."""
    host = {t.weight for t in host_tables(model).values()}  # keyed by the tensor itself
    taken: set[torch.Tensor] = set()
    atoms: list[tuple[str, int]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
                # a container is never called (the forward calls its entries): FSDP2's unshard
                # hook on it would never run, so its entries are the units
                visit(child, f"{prefix}{name}.")
                continue
            params = [p for p in child.parameters() if p not in host]
            size = sum(p.numel() * p.element_size() for p in params)
            if not size or any(p in taken for p in params):
                continue
            if size <= limit_mb * MB or not any(True for _ in child.children()):
                atoms.append((prefix + name, size))
                taken.update(params)
            else:
                visit(child, f"{prefix}{name}.")

    visit(model, "")
    return [[atoms[i][0] for i in group] for group in by_size([size for _, size in atoms], limit_mb)]


def fusion_units(model: nn.Module, limit_mb: float) -> list[list[nn.Module]]:
    """:func:`fusion_unit_names`, as the modules themselves."""
    return [[model.get_submodule(name) for name in unit] for unit in fusion_unit_names(model, limit_mb)]


def zero_units(model: nn.Module, config: ZeroConfig, fusion: CommFusion = CommFusion()) -> list[list[str]]:
    """The qualified names of ``model``'s FSDP2 units, each list one unit: ``config.units`` if
    named (one module each), else :func:`fusion_unit_names` at ``fusion.unit_mb``.

    Raises:
        ValueError: a unit name ``model`` does not have (listing its modules).
    """
    modules = dict(model.named_modules())
    for name in config.units:
        if name not in modules:
            raise ValueError(f"ZeRO unit {name!r} is not a module of {type(model).__name__}; its modules are "
                             f"{sorted(m for m in modules if m)[:40]}")
    return [[name] for name in config.units] or fusion_unit_names(model, fusion.unit_mb)


def apply_zero(model: nn.Module, config: ZeroConfig, mesh: DeviceMesh, fusion: CommFusion = CommFusion(),
               ignored: Iterable[nn.Parameter] = (), root: bool = True) -> nn.Module:
    """Shard ``model`` for stages 2 and 3 (FSDP2, in place; returns it); stages 0 and 1 leave it
    as it is (stage 1 shards the optimizer only: :func:`zero_optimizer`, with DDP on the model).

    Units: :func:`zero_units`; the root holds the rest. Collective: every rank calls it with the
    same model and config.

    Args:
        ignored: parameters FSDP2 leaves whole and alone (beside the host tables', always left
            out: the sparse exchange's): host units' (averaged by their own optimizer).
        root: shard ``model`` itself as the root. ``False``: only the units; the caller shards
            the module whose forward runs the model (a partitioned model's ``HeteroModule``,
            which calls the units but never ``model``'s forward) with :func:`zero_root`.

    Raises:
        ValueError: as :func:`zero_units`.
    """
    if config.stage < ZeroStage.GRADIENTS or _dp_size(mesh, config) == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    left = {t.weight for t in host_tables(model).values()} | set(ignored)
    for unit in zero_units(model, config, fusion):
        modules = [model.get_submodule(name) for name in unit]
        if any(p not in left for m in modules for p in m.parameters()):  # (a unit of left-out parameters: none)
            fully_shard(_forwarding(modules), mesh=mesh[MeshDim.DP.value],
                        reshard_after_forward=config.stage is ZeroStage.PARAMETERS, ignored_params=left or None)
    if root:
        zero_root(model, config, mesh, ignored)
    return model


def _forwarding(modules: list[nn.Module]) -> nn.Module | list[nn.Module]:
    """What FSDP2 shards as one unit for ``modules``: a ``ModuleList`` or ``ModuleDict`` (even one
    with a forward of its own) as its children, one group all the same; torch 2.11 refuses such
    containers, whose forward a parent may never call."""
    flat = [c for m in modules for c in (m.children() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) else (m,))]
    return flat if len(flat) > 1 else flat[0]


def zero_root(module: nn.Module, config: ZeroConfig, mesh: DeviceMesh, ignored: Iterable[nn.Parameter] = ()) -> None:
    """FSDP2's root over ``module`` (stages 2, 3: the parameters no unit holds; its forward runs
    the units' gathers and the step's final reduce), leaving ``ignored`` and host tables alone.
    Collective."""
    if config.stage < ZeroStage.GRADIENTS or mesh_size(mesh, MeshDim.DP) == 1:
        return
    from torch.distributed.fsdp import fully_shard

    left = {t.weight for t in host_tables(module).values()} | set(ignored)
    fully_shard(module, mesh=mesh[MeshDim.DP.value], reshard_after_forward=config.stage is ZeroStage.PARAMETERS,
                ignored_params=left or None)


def zero_optimizer(params: Iterable[torch.Tensor], optimizer_class: type[torch.optim.Optimizer], config: ZeroConfig,
                   mesh: DeviceMesh, **defaults: Any) -> torch.optim.Optimizer:
    """``optimizer_class(params, **defaults)``, its state sharded over ``dp`` at stage 1
    (``ZeroRedundancyOptimizer``); at stages 2 and 3 the parameters are FSDP2 shards already, so
    the plain optimizer keeps sharded state. Collective at stage 1."""
    if config.stage is ZeroStage.OPTIMIZER_STATES and _dp_size(mesh, config) > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(list(params), optimizer_class, process_group=mesh[MeshDim.DP.value].get_group(),
                                       **defaults)
    return optimizer_class(params, **defaults)


def local_elements(optimizer: torch.optim.Optimizer) -> int:
    """Parameter elements this rank's optimizer updates: its partition at stage 1, its shards at
    stages 2 and 3, everything without ZeRO (measured from the optimizer's own parameter lists)."""
    from torch.distributed.tensor import DTensor

    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        optimizer = optimizer.optim  # the local optimizer over this rank's partition
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for g in optimizer.param_groups for p in g["params"])
