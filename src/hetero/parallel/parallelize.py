"""The composition root: one function applies a job's parallel dimensions to its model, in one
documented order, and builds the optimizers over what it made.

``parallelize(model, dims, plan)`` (:class:`~hetero.parallel.dims.ParallelDims` built; a
:class:`ParallelPlan`) runs, each step reading only its part of the plan:

1. **pipeline split** (``dims.pp > 1``, :func:`~hetero.parallel.pipeline.pipeline`): this rank
   keeps its stage; steps 2-4 apply to the stage (or the plan's per-stage hook does, inside the
   split: ``hetero.apply``'s, around a stage's host units);
2. **operator sharding** (``dims.tp > 1``, :func:`~hetero.parallel.operator_plan.apply_sharding`):
   the planned modules' weights become DTensor shards over ``tp``;
3. **recompute** (:func:`~hetero.parallel.recompute.apply_recompute`): checkpoint regions wrap the
   already-sharded modules, so the recomputation replays the sharded operators;
4. **ZeRO** (:func:`~hetero.parallel.zero.apply_zero`): FSDP2 over ``dp`` for stages 2 and 3,
   after the steps above because it shards the parameters as they left them (2-D with ``tp``);
5. **host tables** over the ranks: row-sharded over ``dp`` (:func:`~hetero.parallel.row_sharded.shard_rows`)
   or on parameter servers (:meth:`hetero.ps.PSJob.shard_tables`), else whole on every rank -
   before the optimizers, whose state is allocated per row held;
6. **optimizers**: each part's sparse optimizer over its tables (by name), and the dense one over the
   device parameters (ZeRO 1 shards its state over ``dp``: :func:`~hetero.parallel.zero.zero_optimizer`);
7. **data-parallel wrapping** (``plan.data_parallel``, :func:`~hetero.parallel.data_parallel.data_parallel`):
   DDP over ``dims.dp_group`` for ZeRO 0 and 1, host tables and the parameters an optimizer
   averages itself left out (the trainer asks for this step alone, last: the host tables'
   sparse-gradient exchange is its optimizers' wrapper).

Host/device placement (``hetero.partition``) comes before, on the unsharded model. Reference:
torchtitan's ``parallelize`` (the same order: pipeline split, TP, activation checkpointing, FSDP
or DDP); the reference design's multi-dimensional hybrid parallelism. ``hetero.apply`` (a planner's :class:`~hetero.planner.plan.Plan`) goes through it
too, then partitions host units out and wraps the replicas around them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import Placement

from hetero.embedding import dense_parameters, host_tables
from hetero.optim.host_state import AveragesReplicas
from hetero.parallel.comm_fusion import CommFusion
from hetero.parallel.data_parallel import DataParallelConfig, data_parallel
from hetero.parallel.dims import ParallelDims
from hetero.parallel.mesh import MeshDim
from hetero.parallel.operator_plan import ShardingPlan, apply_sharding
from hetero.parallel.pipeline import Pipeline, pipeline
from hetero.parallel.pipeline_plan import PipelineConfig
from hetero.parallel.recompute import RecomputeConfig, apply_recompute
from hetero.parallel.row_sharded import shard_rows
from hetero.parallel.zero import ZeroConfig, apply_zero, zero_optimizer


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """What :func:`parallelize` applies.

    Attributes:
        sharding: operator strategies by module name (``None``: no operator sharding).
        sharding_dim: the mesh dimension the strategies' slices run over (``MeshDim.TP``: a
            planner's strategies, written for one replica's ``tp`` ranks); ``None``: the whole
            mesh (``hetero train``'s, over its ``(1, 1, tp)`` mesh).
        recompute: the modules that recompute their activations, and what they keep.
        zero: the ZeRO stage over the mesh's ``dp`` dimension and its units.
        zero_ignored: parameters ZeRO leaves alone (host units' and host weights', which the
            partitioner moves to the host); ``zero_root``: whether FSDP2 wraps the model itself
            (no: the partitioned model becomes the root after, ``hetero.parallel.zero.zero_root``).
        fusion: bucket sizes of the collectives (here: ZeRO's units when none are named; the
            trainer's DDP and HostAdamW take the same config).
        pipeline: the split into stages and the schedule (with ``dims.pp > 1``).
        loss_fn: the last stage's loss of ``(output, target)`` (with ``dims.pp > 1``).
        stage: with ``dims.pp > 1``, what applies each of this rank's stages' own dimensions
            instead of steps 2-4 (``hetero.apply``'s: operator sharding, recompute and replicas
            around the stage's host units, which it partitions out); returns the module the
            stage runs (see :func:`~hetero.parallel.pipeline.pipeline`).
        sparse: host tables' sparse optimizers: a part's name (``"deep"``: the tables whose
            qualified names start with ``deep.``) -> a factory of the optimizer over those tables
            (a part with no tables on this rank gets none).
        dense: the dense optimizer: a torch optimizer class (default Adam; ZeRO 1 shards its
            state over ``dp``), a factory over ``[(name, parameter)]`` (a plan's HostAdamW), or
            ``None``: none (the caller builds its own).
        dense_kwargs: the dense optimizer's hyper-parameters (``lr``, ...).
        data_parallel: with it, step 7 (``None``: the model is not wrapped).
        replica_host: parameters (and buffers) something else keeps equal over the replicas
            (HostAdamW's, ``AveragesReplicas``; a partitioned model's host units): DDP leaves
            them out, as it does those of a dense optimizer built here that averages its own.
    """

    sharding: ShardingPlan | None = None
    sharding_dim: MeshDim | None = None
    recompute: RecomputeConfig = RecomputeConfig()
    zero: ZeroConfig = ZeroConfig()
    zero_ignored: frozenset[torch.Tensor] = frozenset()  # (tensors hash by identity)
    zero_root: bool = True
    fusion: CommFusion = CommFusion()
    pipeline: PipelineConfig | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    stage: Callable[[nn.Module], nn.Module] | None = None
    sparse: Mapping[str, Callable[[dict[str, nn.Module]], Any]] = dataclasses.field(default_factory=dict)
    dense: type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer] | None = torch.optim.Adam
    dense_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    data_parallel: DataParallelConfig | None = None
    replica_host: frozenset[torch.Tensor] = frozenset()


class TableServers(Protocol):
    """What step 5 needs of a parameter-server job (:class:`hetero.ps.PSJob`): to put a model's
    table groups on its servers, before the optimizers are built."""

    def shard_tables(self, model: nn.Module) -> int: ...


@dataclasses.dataclass
class Parallelized:
    """What :func:`parallelize` made.

    Attributes:
        model: the module this rank runs (a pipeline's: its stage).
        dense_optimizer: over this rank's device parameters (``None`` without any).
        sparse_optimizers: each part's sparse optimizer over this rank's host tables.
        pipeline: the pipeline (``None`` without ``pp``).
        layout: the operator layout (qualified parameter name -> placements; empty without tp).
        net: what runs the step: ``model`` wrapped for data parallel (step 7), else ``model``.
    """

    model: nn.Module
    dense_optimizer: torch.optim.Optimizer | None
    sparse_optimizers: dict[str, Any]
    pipeline: Pipeline | None = None
    layout: dict[str, list[Placement]] = dataclasses.field(default_factory=dict)
    net: nn.Module | None = None

    def __post_init__(self) -> None:
        if self.net is None:
            self.net = self.model


def parallelize(model: nn.Module, dims: ParallelDims, plan: ParallelPlan = ParallelPlan(),
                ps_job: TableServers | None = None) -> Parallelized:
    """Apply ``plan`` over the built ``dims`` (:meth:`ParallelDims.build`) to ``model`` (changed
    in place), in the module docstring's order; ``ps_job`` (a :class:`hetero.ps.PSJob`) puts
    the tables on its servers (a server's optimizers hold its shard's state).

    Collective: every rank calls it with the same model, dims and plan.

    Raises:
        ValueError: dims not built where a mesh is needed; a pipeline without its config or
            loss; a row-sharded or parameter-server job with a model of no host tables; a host
            table no part of ``plan.sparse`` names (it would never be updated); as each step
            does (a name the model does not have, a bad strategy), before the later steps run.
    """
    if dims.meshed and dims.mesh is None:
        raise ValueError("parallelize needs the dims' mesh: pass dims.build()")
    pipe = None
    if dims.pp > 1:
        if plan.pipeline is None or plan.loss_fn is None:
            raise ValueError(f"pp {dims.pp}: give the plan's pipeline (split points, schedule) and loss_fn")
        pipe = pipeline(model, plan.pipeline, dims.mesh, plan.loss_fn, plan.stage)
        model = pipe.modules[0]  # this rank's (first) stage
    layout = {}
    if plan.stage is None or pipe is None:  # (a stage hook applied each stage's own dimensions inside the split)
        if dims.tp > 1 and plan.sharding is not None:
            mesh = dims.mesh if plan.sharding_dim is None else dims.mesh[plan.sharding_dim.value]
            layout = apply_sharding(model, plan.sharding, mesh)
        apply_recompute(model, plan.recompute)
    if dims.mesh is not None and pipe is None:
        apply_zero(model, plan.zero, dims.mesh, plan.fusion, ignored=plan.zero_ignored, root=plan.zero_root)
    if (dims.row_sharded or ps_job is not None) and not host_tables(model):
        raise ValueError("the job shards host tables (row sharding or parameter servers), which this model has none "
                         "of: drop it")
    if ps_job is not None:
        ps_job.shard_tables(model)  # before the optimizers: their state is allocated per shard, on the servers
    elif dims.row_sharded:
        shard_rows(model)
    tables = host_tables(model)
    sparse = {part: make(own) for part, make in plan.sparse.items()
              if (own := {k: t for k, t in tables.items() if k.startswith(f"{part}.")})}
    orphans = [k for k in tables if plan.sparse and not any(k.startswith(f"{part}.") for part in plan.sparse)]
    if orphans:  # (they would train with no optimizer: never updated, silently)
        raise ValueError(f"host tables {orphans[:3]} belong to no part of the plan's sparse optimizers "
                         f"{sorted(plan.sparse)}: name their part, or leave plan.sparse empty and build them yourself")
    params = list(dense_parameters(model))
    dense = None
    if params and plan.dense is not None:
        kwargs = dict(plan.dense_kwargs)
        if layout:
            kwargs["foreach"] = False  # foreach takes one kind of tensor: tp mixes DTensor shards and plain ones
        if dims.mesh is not None and pipe is None and isinstance(plan.dense, type):
            dense = zero_optimizer(params, plan.dense, plan.zero, dims.mesh, **kwargs)
        elif isinstance(plan.dense, type):
            dense = plan.dense(params, **kwargs)
        else:  # a factory over named parameters (a plan's HostAdamW, PartialOffloadAdamW)
            mine = set(params)
            dense = plan.dense([(n, p) for n, p in model.named_parameters() if p in mine], **kwargs)
    net = model
    if plan.data_parallel is not None and pipe is None:  # (a pipeline's schedule syncs its stages' gradients)
        own = set(dense.replica_averaged_parameters()) if isinstance(dense, AveragesReplicas) else set()
        net = data_parallel(model, plan.data_parallel, host=own | set(plan.replica_host), group=dims.dp_group)
    return Parallelized(model, dense, sparse, pipe, layout, net)
