"""The parallel pieces of a plan that :mod:`hetero.planner.apply` applies to a model or to each
pipeline stage: its mesh, its operator strategies over the ``tp`` ranks and its ZeRO units
around host units."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hetero.parallel.dims import ParallelDims
from hetero.parallel.env import world_size
from hetero.parallel.mesh import MeshDim
from hetero.parallel.operator_plan import ShardingPlan, apply_sharding
from hetero.parallel.zero import ZeroConfig
from hetero.placement.capture import modules_on_path
from hetero.planner.plan import Plan


def zero_around(plan: Plan, present: Mapping[str, nn.Module], apart: list[str]) -> ZeroConfig:
    """The plan's ZeRO stage; where units of ``present`` (a model's or a stage's modules) are
    ``apart`` on the host (their parameters there), FSDP2's units are the device units, each
    its own: the partitioner keeps a module with hooks whole, so each unit's gathers run, and
    the partitioned model becomes the root after (:func:`~hetero.parallel.zero.zero_root`; the
    model's own forward never runs); none there: no units (the root holds every device
    parameter), never the units by size, which may hold host units."""
    if not any(n in present for n in apart):
        return ZeroConfig(plan.candidate.zero)
    return ZeroConfig(plan.candidate.zero, units=tuple(n for n in plan.units if n in present and n not in apart
                                                       and any(True for _ in present[n].parameters())))


def plan_mesh(mesh: DeviceMesh | None, plan: Plan) -> DeviceMesh:
    """The plan's mesh: ``mesh``, or the :class:`~hetero.parallel.dims.ParallelDims` of its
    ``pp`` and ``tp`` over the process group built - checked to have the plan's ``pp x dp x tp``."""
    c = plan.candidate
    dims = ParallelDims.of_mesh(mesh, c.zero) if mesh is not None else \
        ParallelDims.of_job(pp=c.pp, tp=c.tp, zero=c.zero) if world_size() % (c.pp * c.tp) == 0 else None
    if dims is None or (dims.pp, dims.dp, dims.tp) != (c.pp, c.dp, c.tp):
        shape = dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh is not None else \
            {"ranks": world_size()}
        raise ValueError(f"the plan is for pp {c.pp} x dp {c.dp} x tp {c.tp} ranks, the mesh has {shape}: run it under "
                         f"torchrun --nproc-per-node {c.pp * c.dp * c.tp}")
    return dims.mesh if dims.mesh is not None else dims.build(mesh=True).mesh


def shard_operators(model: nn.Module, plan: Plan, mesh: DeviceMesh, apart: Sequence[str] = ()) -> None:
    """The plan's operator strategies of the modules ``model`` holds (a pipeline stage: its own)
    applied over ``mesh``'s ``tp`` ranks (one replica's); see :func:`operator_sharding`."""
    apply_sharding(model, operator_sharding(model, plan, apart), mesh[MeshDim.TP.value])


def operator_sharding(model: nn.Module, plan: Plan, apart: Sequence[str] = ()) -> ShardingPlan:
    """The plan's operator strategies of the modules ``model`` holds (a pipeline stage: its own),
    for one replica's ``tp`` ranks; none may cut a module of the units ``apart`` on the host (a
    hand-written plan's: ``ValueError``)."""
    sharding = plan.sharding_plan()
    if sharding is None:
        raise ValueError(f"a tp {plan.candidate.tp} plan without operator strategies: plan the model again "
                         f"(hetero.plan never makes one)")
    cut = [n for n in sharding.modules if set(modules_on_path(n)) & set(apart)]
    if cut:
        raise ValueError(f"the plan cuts {cut}, modules of units it places on the host, which run whole: drop their "
                         f"strategies, or plan the model again")
    present, own = dict(model.named_modules()), ShardingPlan()
    for name, s in sharding.modules.items():
        if name in present:
            own.module(name, s.in_strategy, s.out_strategy, s.use_local_output)
    return own
