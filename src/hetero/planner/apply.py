"""``hetero.apply(model, plan)``: a plan made real on one rank (or the ``pp x dp x tp`` ranks of
its mesh: a pipeline's stages, each data-parallel replica's share of the batch - ZeRO, DDP or
torch's ``replicate`` - and the tp ranks of each replica cutting its operators on ``mesh["tp"]``).

The parallel dimensions go through the composition root,
:func:`hetero.parallel.parallelize.parallelize`, over the plan's validated
:class:`~hetero.parallel.dims.ParallelDims`: the pipeline split first (a pp plan's stages, each
stage's own dimensions applied by a per-stage hook around its host units, its output sent from
the device), then operator sharding (a tp plan's strategies over each replica's ``tp`` ranks,
host units whole), recompute regions (module names unchanged) and ZeRO (around host units: the
device units, the partitioned model as the root after). Around it, this module moves the plan's
device tables (before), then partitions host units out (``hetero.partition``: host units' ops
run on the host, their parameters live there; streamed units' parameters live there too, their
ops on the device; the copies inserted) and builds the optimizers where the plan puts their
state: torch's beside device parameters, ``HostAdamW`` (all offloaded) or
``PartialOffloadAdamW`` (a ratio), torch's on the host for host units (beside ``dp`` averaging
their gradients over the replicas itself, as DDP does the device's); host tables get their
sparse optimizers, device tables torch's of the same rule. The result,
:class:`~hetero.planner.applied.Applied`, runs a training step with the plan's micro-batches
(gradients accumulated, one update; a pipeline's schedule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from hetero.embedding import dense_parameters, host_tables, move_tables_to_device, move_tables_to_ssd
from hetero.optim import SparseOptimizerKind, device_sparse_optimizer
from hetero.optim.container import OptimizersContainer
from hetero.optim.partial_offload import PartialOffloadAdamW, host_part
from hetero.parallel.dims import ParallelDims
from hetero.parallel.parallelize import ParallelPlan, parallelize
from hetero.parallel.env import global_rank
from hetero.parallel.mesh import MeshDim
from hetero.parallel.recompute import RecomputeConfig, apply_recompute
from hetero.parallel.zero import ZeroConfig, apply_zero, zero_optimizer, zero_root
from hetero.placement import Target, resolve_device
from hetero.planner.applied import Applied
from hetero.planner.apply_parts import operator_sharding, plan_mesh, shard_operators, zero_around
from hetero.planner.optimizers import OptimizerConfig, device_optimizer, host_optimizer, optimizer_args
from hetero.planner.plan import Plan
from hetero.planner.space import StateHome, TablePlacement, sparse_optimizer_of
from hetero.planner.graph import plan_units
from hetero.placement.partitioner import partition
from hetero.embedding import device_tables
from hetero.parallel.data_parallel import (
    DataParallelConfig,
    DistributedSparse,
    check_replicas,
    HostReplicaOptimizer,
)
from hetero.parallel.row_sharded import shard_rows
from hetero.parallel.pipeline_plan import PipelineConfig
from hetero.optim.host_state import host_all_reduce_group

def apply(model: nn.Module, plan: Plan, config: OptimizerConfig = OptimizerConfig(),
          sparse_optimizers: Mapping[str, SparseOptimizerKind] = {}, mesh: DeviceMesh | None = None,
          loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> Applied:
    """Make ``plan`` real on ``model`` (changed in place; see the module docstring).

    Args:
        config: the dense optimizer's hyperparameters.
        sparse_optimizers: tables' sparse optimizers by qualified-name prefix (default
            LazyAdam, each with its default config; a device table's is torch's of the same rule).
        mesh: with several ranks, the plan's ``pp x dp x tp`` mesh (default: ``build_mesh``
            over the initialised process group). Every rank of it calls ``apply`` (collective)
            and steps on the same (global) batch.
        loss_fn: with a ``pp > 1`` plan, the loss of ``(output, target)`` the last stage
            computes per micro-batch (:meth:`Applied.step`'s is then not used).

    Raises:
        ValueError: the plan names units the model does not have (another model's plan), its
            mesh is not the world's, it streams weights beside ``tp`` or cuts a host unit's
            module, it has host units beside ``pp x tp``, a
            ``pp`` plan comes without ``loss_fn``, a ``dp`` plan has device tables or host
            tables beside ``tp``, or ZeRO 1 beside ``tp``; a replicated host table that differs
            between the ranks (build the model from the same seed on every rank).
    """

    units = plan_units(model, plan.granularity)
    missing = [n for n in plan.units if n not in units]
    if missing:
        raise ValueError(f"the plan is for a model with units {missing}, which {type(model).__name__} does not have; "
                         f"plan this model (hetero.plan)")
    c = plan.candidate
    if c.pp > 1:
        return _apply_pipeline(model, plan, config, mesh, loss_fn)
    if c.dp > 1:
        return _apply_data_parallel(model, plan, config, mesh, sparse_optimizers)
    spec = plan.placement_spec(model)
    host_dense, streamed = list(spec.modules), plan.streamed_units()
    device = resolve_device(Target.DEVICE)
    if c.tp > 1 and streamed:
        raise ValueError(f"a tp {c.tp} plan with host weights {streamed}: plan the model again (hetero.plan never "
                         f"makes one)")
    # the plan's device tables: one host->device copy of each, before the partition (a device leaf there)
    moved = move_tables_to_device(model.to(device) if c.tp > 1 else model, list(plan.device_tables), device)
    if plan.ssd_tables:  # the plan's tables on the SSD tier: their rows written to its store, their memory let go
        move_tables_to_ssd(model, list(plan.ssd_tables), plan.ssd)
    # the composition root's operator sharding (before recompute, whose regions replay the sharded
    # operators, and before the partition, which keeps a sharded module whole: its layouts are
    # hooks; host units run whole, unsharded) and recompute regions
    dims = ParallelDims.of_mesh(plan_mesh(mesh, plan)) if c.tp > 1 else ParallelDims()
    parallelize(model, dims, ParallelPlan(sharding=operator_sharding(model, plan, apart=host_dense) if c.tp > 1 else None,
                                          sharding_dim=MeshDim.TP, recompute=plan.recompute_config(), dense=None))
    if host_dense or streamed:

        runnable: nn.Module = partition(model, spec)  # moves every parameter to its target
    else:
        runnable = model.to(device)
    # in the model's order (a set's would differ between processes: the optimizer's state order)
    on_host = dict.fromkeys(p for n in host_dense + streamed for p in units[n].parameters())
    dense = set(dense_parameters(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p not in on_host and p in dense]
    tables = host_tables(model)
    sparse, table_optimizers = _table_optimizers(tables, moved, sparse_optimizers)
    host_tensors = set(on_host) | {b for n in host_dense for b in units[n].buffers()} | {t.weight for t in tables.values()}
    optimizers = OptimizersContainer(dense=device_optimizer(named, plan, config, foreach=c.tp == 1) if named else None,
                                     sparse=sparse, device_tables=table_optimizers,
                                     host_dense=[host_optimizer(on_host, plan, config)] if on_host else [])
    return Applied(runnable, optimizers, c.micro_batches, plan, host_tensors)


def _table_optimizers(tables: Mapping[str, nn.Module], moved: Mapping[str, nn.Module],
                      kinds: Mapping[str, SparseOptimizerKind]) -> tuple[dict[str, Any], list[torch.optim.Optimizer]]:
    """Each table's sparse optimizer, by the rule ``kinds`` gives its name: hetero's over the
    host ``tables`` (one per rule, named by it), torch's of the same rule over the ``moved`` device tables."""
    host, device = {}, []
    for kind in SparseOptimizerKind:
        own = {k: t for k, t in tables.items() if sparse_optimizer_of(k, kinds) is kind}
        if own:
            host[kind.value] = kind.optimizer(own, kind.optimizer.Config())
        on_device = [t.weight for k, t in moved.items() if sparse_optimizer_of(k, kinds) is kind]
        if on_device:
            device.append(device_sparse_optimizer(kind, on_device))
    return host, device


def _apply_data_parallel(model: nn.Module, plan: Plan, config: OptimizerConfig, mesh: DeviceMesh | None,
                         sparse_optimizers: Mapping[str, SparseOptimizerKind]) -> Applied:
    """A dp plan of a dense model: each replica's tp ranks cutting its operators (host units
    whole), recompute regions, ZeRO (stages 2, 3: FSDP2 over ``dp``; with host units, its units
    the device units and its root the partitioned model; with tp and ZeRO 0, 1 torch's
    replicate so, in place of DDP), the host tables replicated or row-sharded as the plan says
    (:class:`~hetero.parallel.data_parallel.DistributedSparse` exchanging their sparse
    gradients), the host units
    and streamed weights partitioned out (their parameters on the host, averaged over the replicas by
    :class:`~hetero.parallel.data_parallel.HostReplicaOptimizer`), DDP over the device
    parameters (stages 0, 1; none with all of the state on the host, HostAdamW averaging the
    replicas' gradients itself; with part of it, DDP over the rest), torch's optimizer (stage 1:
    its state sharded), HostAdamW or PartialOffloadAdamW, every rank its share of the batch."""

    c = plan.candidate
    if plan.ssd_tables:  # (before the row sharding and the optimizers: this rank's store, laid out whole, then cut)
        move_tables_to_ssd(model, list(plan.ssd_tables),
                           dataclasses.replace(plan.ssd, directory=plan.ssd.directory / f"rank{global_rank()}"))
    # (the dense host units: a unit of host tables places itself)
    hosted, streamed = list(plan.placement_spec(model).modules), plan.streamed_units()
    tables = host_tables(model)
    if device_tables(model) or (tables and c.tp > 1) or (streamed and not c.takes_host_units()):
        raise ValueError(f"a dp {c.dp} x tp {c.tp} plan with device tables, host tables beside tp, or host weights "
                         f"beside tp: plan the model again (hetero.plan never makes one)")
    if c.tp > 1 and c.zero == 1:
        raise ValueError(f"a dp {c.dp} x tp {c.tp} plan at ZeRO 1 (torch's ZeroRedundancyOptimizer takes no DTensor "
                         f"parameters): plan the model again (hetero.plan never makes one)")
    mesh = plan_mesh(mesh, plan)
    dp = mesh[MeshDim.DP.value]
    model.to(resolve_device(Target.DEVICE))
    units = dict(model.named_modules())
    # in the model's order: every replica's flat all-reduce must lay them out alike (a streamed
    # unit's weights are host parameters as a host unit's are: averaged and updated there)
    on_host = dict.fromkeys(p for n in hosted + streamed for p in units[n].parameters())
    zero = zero_around(plan, units, hosted + streamed)
    apart = bool(hosted or streamed)
    # the composition root, in torchtitan's order: each replica's tp ranks cut its operators (host
    # units run whole on each rank), recompute regions, then ZeRO 2, 3 (parameters become dp shards
    # - of the tp shards with tp; around host units, only the device units, the root after the partition)
    parallelize(model, ParallelDims.of_mesh(mesh, c.zero), ParallelPlan(
        sharding=operator_sharding(model, plan, apart=hosted) if c.tp > 1 else None, sharding_dim=MeshDim.TP,
        recompute=plan.recompute_config(), zero=zero if not apart or zero.units else ZeroConfig(),
        zero_ignored=frozenset(on_host), zero_root=not apart, dense=None))
    units = dict(model.named_modules())  # (recompute may wrap them)
    # torch's replicate (data parallel on FSDP2's machinery) takes the tp shards, DDP does not:
    # like FSDP2, around host units its units are the device units, its root the partitioned model
    replicated = c.tp > 1 and c.zero < 2
    if replicated:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for name in zero.units if apart else ():
            replicate(units[name], mesh=dp, ignored_params=set(on_host) or None)
    runnable: nn.Module = model
    if apart:

        runnable = partition(model, plan.placement_spec(model))  # moves the host units' (and weights') parameters
        zero_root(runnable, zero, mesh, on_host)  # (its forward calls the units; the model's never runs)
    if replicated:
        runnable = replicate(runnable, mesh=dp, ignored_params=set(on_host) or None)
    host_buffers = [b for n in hosted for b in units[n].buffers()]  # (in the units' order: the same on every rank)
    # (after replicate, which makes the parameters new dp DTensors; the tables' are their own)
    dense = set(dense_parameters(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p not in on_host and p in dense]
    offloaded: set[nn.Parameter] = set()
    if c.state is not StateHome.DEVICE:  # HostAdamW: its own gloo group over the replicas averages its part's gradients
        optimizer = device_optimizer(named, plan, config, foreach=True, replicas=dp.get_group()) if named else None
        if isinstance(optimizer, PartialOffloadAdamW):
            host = set(optimizer.host_params)
            offloaded = {p for n, p in named if n in host}  # (tensors hash by identity)
    else:
        kind, defaults = optimizer_args(plan.optimizer, config)
        if c.tp > 1:
            defaults["foreach"] = False  # foreach takes one kind of tensor; tp mixes DTensor shards and plain ones
        optimizer = zero_optimizer([p for _, p in named], kind, zero, mesh, **defaults) if named else None
    if c.tp == 1 and c.state is not StateHome.HOST:  # DDP over what no host optimizer averages (none: all offloaded)
        runnable = parallelize(runnable, ParallelDims.of_mesh(mesh, c.zero), ParallelPlan(  # (its step 7 alone)
            dense=None, data_parallel=DataParallelConfig(dense_sharded=c.zero >= 2),
            replica_host=frozenset(set(on_host) | set(host_buffers) | offloaded))).net
    # the replicas' buffers stay rank 0's (DDP's rule): the host units' always, the device's too
    # where no DDP runs (state on the host; replicate and FSDP2 keep none equal)
    ddp = c.tp == 1 and c.state is not StateHome.HOST and c.zero < 2
    synced = list(dict.fromkeys(host_buffers + (list(model.buffers()) if not ddp else [])))  # (in order, once each)
    host_optimizers = _replicas_host_optimizer(on_host, synced, plan, config, None)
    sparse: dict[str, Any] = {}
    if tables:  # the plan's table placement over the replicas (world = dp here): DistributedSparse
        # exchanges the sparse gradients - all-gathered for replicated tables, each row to its
        # owner for row-sharded ones (their rows cut before the optimizers allocate state)

        if c.tables is TablePlacement.ROW_SHARDED:
            shard_rows(model)
        else:
            check_replicas(model)  # (replicas built alike: the same seed on every rank)
        sparse, _ = _table_optimizers(tables, {}, sparse_optimizers)
    optimizers = OptimizersContainer(dense=optimizer, sparse=sparse, host_dense=host_optimizers,
                                     steppers={k: DistributedSparse(o) for k, o in sparse.items()})
    return Applied(runnable, optimizers, c.micro_batches, plan,
                   set(on_host) | set(host_buffers) | {t.weight for t in tables.values()},
                   data_parallel=(dp.get_local_rank(), c.dp), dp_group=dp.get_group())


def _apply_pipeline(model: nn.Module, plan: Plan, config: OptimizerConfig, mesh: DeviceMesh | None,
                    loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Applied:
    """A pp plan: the model split at the plan's points (``hetero.parallel.pipeline``, 1F1B), this
    rank's stage recomputing its planned units (and over its ``dp`` replicas torch's replicate, or
    FSDP2 at ZeRO 2 and 3; its host units and a partial offload's host part left out of
    replicate), torch's optimizer beside its parameters or HostAdamW / PartialOffloadAdamW
    keeping their state on the host (HostAdamW averaging the replicas' gradients of its part
    itself), the host units' optimizer averaging theirs, each replica its share of the batch."""

    c = plan.candidate
    if loss_fn is None:
        raise ValueError(f"a pp {c.pp} plan runs its loss in the last stage: pass loss_fn=(output, target) -> loss")
    hosted, streamed = plan.host_units(), plan.streamed_units()
    if (hosted or streamed) and not c.takes_host_units():
        raise ValueError(f"a pp {c.pp} x dp {c.dp} x tp {c.tp} plan with host units {hosted} or host weights "
                         f"{streamed}: a stage's host units and weights run without tp; plan the model again "
                         f"(hetero.plan never makes one)")
    if c.state is not StateHome.DEVICE and (c.tp > 1 or c.zero):
        raise ValueError(f"a pp {c.pp} x dp {c.dp} x tp {c.tp} plan at ZeRO {c.zero} with its optimizer state "
                         f"{c.describe()['optimizer state']}: a stage offloads none of its state beside tp or ZeRO; "
                         f"plan the model again (hetero.plan never makes one)")
    mesh = plan_mesh(mesh, plan)
    recomputed = plan.recompute_config().modules
    offloaded: set[nn.Parameter] = set()  # the stages' parameters whose state a partial offload keeps on the host
    group = mesh[MeshDim.DP.value].get_group() if c.dp > 1 else None  # (the loss average's)
    device = resolve_device(Target.DEVICE)

    def recompute_stage(stage: nn.Module) -> nn.Module:  # the split first, then each stage's tp, regions, replicas
        present = dict(stage.named_modules())
        if c.tp > 1:  # the stage's own operators cut over its tp ranks (values whole between stages)
            shard_operators(stage, plan, mesh)
        apply_recompute(stage, RecomputeConfig(tuple(n for n in recomputed if n in present)))
        own, weights = [n for n in hosted if n in present], [n for n in streamed if n in present]
        # (HostReplicaOptimizer averages these)
        kept = {p for n in own + weights for p in present[n].parameters()}
        zero = zero_around(plan, present, own + weights)
        if (own or weights) and group is not None and zero.units:  # FSDP2's units, before the partition
            apply_zero(stage, zero, mesh, ignored=kept, root=False)  # (which keeps them whole)
        if own or weights:  # the stage as host and device subgraphs (its host parameters move there)

            stage = _SendFromDevice(partition(stage, plan.placement_spec(stage, partial=True)), device)
        if group is None or c.state is StateHome.HOST:  # (HostAdamW averages the replicas' gradients)
            return stage
        if c.state is StateHome.PARTIAL:  # its host part's too (PartialOffloadAdamW's choice: checked below)
            trained = [(n, p) for n, p in stage.named_parameters() if p.requires_grad and p not in kept]
            chosen = set(host_part(trained, c.offload_ratio))
            mine = {p for n, p in trained if n in chosen}
            offloaded.update(mine)
            kept = kept | mine
        if c.zero >= 2:  # FSDP2 over the stage's replicas (the schedule syncs its gradients once per batch)
            if own or weights:  # (its units are sharded already; the partitioned stage is the root)
                zero_root(stage, zero, mesh, kept)
                return stage
            return apply_zero(stage, zero, mesh)
        # torch's replicate (data parallel on FSDP2's machinery): the schedule syncs its gradients
        # once per batch, which DDP's reducer does not take (it rebuilds buckets across micro-batches)
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate(stage, mesh=mesh[MeshDim.DP.value], ignored_params=kept or None)

    # the composition root splits the stages; each stage's own dimensions (around its host units) are recompute_stage's
    pipe = parallelize(model.to(device), ParallelDims.of_mesh(mesh, c.zero), ParallelPlan(
        pipeline=PipelineConfig(micro_batches=c.micro_batches, split_points=plan.split_points), loss_fn=loss_fn,
        stage=recompute_stage, dense=None)).pipeline
    stages = {n: m for stage in pipe.modules for n, m in stage.named_modules()}
    # (in the model's order)
    on_host = dict.fromkeys(p for n in hosted + streamed if n in stages for p in stages[n].parameters())
    named = [(n, p) for n, p in pipe.named_parameters() if p.requires_grad and p not in on_host]
    rank = mesh[MeshDim.DP.value].get_local_rank()
    # (no foreach with replicas or tp: their parameters are DTensors)
    optimizer = device_optimizer(named, plan, config, group is None and c.tp == 1, mesh[MeshDim.DP.value].get_group()) \
        if named else None
    if offloaded:  # replicate left out what the optimizer's host part averages: the same parameters
        host = set(optimizer.host_params)
        assert {p for n, p in named if n in host} == offloaded, "partial offload chose other parameters than replicate left out"
    host_buffers = [b for n in hosted if n in stages for b in stages[n].buffers()]  # (in the units' order)
    host_optimizers: list[Any] = [host_optimizer(on_host, plan, config)] if on_host else []
    if c.dp > 1:  # the host units' gradients averaged on a gloo group of the stage's replicas; the
        # stage's buffers, host units' and device's alike, kept its first replica's (DDP's rule;
        # torch's replicate and FSDP2 keep none equal), in module order

        synced = list(dict.fromkeys(b for stage in pipe.modules for b in stage.buffers()))
        replicas = host_all_reduce_group(mesh[MeshDim.DP.value].get_group())[0]
        host_optimizers = _replicas_host_optimizer(on_host, synced, plan, config, replicas)
    host_tensors = set(on_host) | set(host_buffers)
    return Applied(pipe.modules[0], OptimizersContainer(dense=optimizer, host_dense=host_optimizers),
                   c.micro_batches, plan, host_tensors, pipeline=pipe, data_parallel=(rank, c.dp), dp_group=group)


def _replicas_host_optimizer(on_host: Mapping[nn.Parameter, None], buffers: list[torch.Tensor], plan: Plan,
                             config: OptimizerConfig, group: Any) -> list[Any]:  # noqa: ANN401 - a ProcessGroup
    """The host units' optimizer over the replicas (:class:`~hetero.parallel.data_parallel.HostReplicaOptimizer`:
    their gradients averaged, ``buffers`` kept the first replica's) on ``group`` (gloo; ``None``: the
    host group); none without host parameters or buffers."""

    if not on_host and not buffers:
        return []
    return [HostReplicaOptimizer(host_optimizer(on_host, plan, config) if on_host else None, group=group, buffers=buffers)]


class _SendFromDevice(nn.Module):
    """A pipeline stage's partitioned module whose outputs are on the device: the schedule sends
    from there (a host unit last in the stage leaves its output on the host)."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.module, self.device = module, device

    def forward(self, *args: Any) -> Any:  # noqa: ANN401 - the stage's outputs
        # copy (host -> device, differentiable) where the last subgraph ran on the host; none otherwise
        return pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, self.module(*args))
