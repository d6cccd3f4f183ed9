"""``hetero.explain``: the host/device partition of a model, its tables on the SSD tier and, given
a sharding plan, its operator-parallel layouts, and, given a data-parallel mesh, the collectives of
a step - one report over the packages (placement knows nothing of parallel or storage)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from hetero.parallel.comm_fusion import CommFusion
from hetero.parallel.dp_plan import plan_collectives
from hetero.parallel.mesh import MeshDim
from hetero.parallel.operator_plan import ShardingPlan
from hetero.parallel.pipeline import Pipeline
from hetero.parallel.pipeline_plan import PipelineConfig, plan_pipeline
from hetero.parallel.sharding_graph import explain_sharding
from hetero.parallel.zero import ZeroConfig
from hetero.placement.annotate import PlacementSpec
from hetero.placement.explainer import Explanation
from hetero.placement.explainer import explain as explain_placement
from hetero.embedding import table_groups
from hetero.planner.plan import Plan
from hetero.storage.report import TierGroup, TierReport


def explain(model: nn.Module | Plan, example_inputs: tuple[Any, ...] = (), spec: PlacementSpec | None = None, *,
            sharding: ShardingPlan | None = None, mesh: Mapping[MeshDim, int] | None = None,
            all_to_all: bool = True, fusion: CommFusion = CommFusion(), zero: ZeroConfig = ZeroConfig(),
            pipeline: PipelineConfig | Pipeline | None = None) -> Explanation | Plan:
    """Describe what hetero makes of ``model`` on ``example_inputs``, without changing it; or,
    given a :class:`~hetero.planner.plan.Plan` (``hetero.plan``), the plan: every decision with
    its predicted time and bytes and the runner-up it beat (the plan itself; print it).

    Args:
        spec: host/device placement (see :func:`hetero.placement.explainer.explain`).
        sharding: operator strategies by module name; with it the report adds each operator's
            layout, every redistribution (collective, bytes per rank and forward pass) and the
            parameter bytes per rank, planned for ``mesh`` (no process group needed).
        mesh: mesh dimension -> size, e.g. ``{MeshDim.DP: 2, MeshDim.TP: 2}``.
        all_to_all: the backend has all-to-all (NCCL); gloo has not (gathers instead).
        fusion, zero: with ``mesh[MeshDim.DP] > 1``, the report adds the collectives of one
            training step over the data-parallel ranks, with their sizes
            (:func:`hetero.parallel.dp_plan.plan_collectives`), for these settings.
        pipeline: with a config, the stages over ``mesh[MeshDim.PP]`` ranks (units, parameter
            bytes) and the schedule's predicted bubble
            (:func:`hetero.parallel.pipeline_plan.plan_pipeline`); with a running
            :class:`~hetero.parallel.pipeline.Pipeline`, its split and, beside the prediction, the
            bubble its last step measured (``Pipeline.bubble``).

    Raises:
        ValueError: as :func:`hetero.placement.explainer.explain` and
            :func:`hetero.parallel.sharding_graph.explain_sharding`, or a plan without ``mesh``,
            or a data-parallel plan with an operator-sharded one (not modelled together yet).
    """
    if isinstance(model, Plan):
        return model
    report = explain_placement(model, example_inputs, spec)
    report.storage = _tier(model)
    if sharding is not None:
        if not mesh:
            raise ValueError("hetero.explain(sharding=...) needs the mesh it plans for: pass mesh={MeshDim.TP: 2, ...}")
        report.operator_parallel = explain_sharding(model, example_inputs, sharding, mesh, all_to_all)
    dp = (mesh or {}).get(MeshDim.DP, 1)
    if dp > 1:
        if sharding is not None and (mesh or {}).get(MeshDim.TP, 1) > 1:
            raise ValueError("hetero.explain plans the data-parallel collectives of an unsharded dense part only: "
                             "explain the operator sharding (mesh={MeshDim.TP: n}) and data parallelism separately")
        report.data_parallel = plan_collectives(model, example_inputs, dp, fusion, zero)
    if isinstance(pipeline, Pipeline):
        report.pipeline = dataclasses.replace(pipeline.plan, measured_bubble=pipeline.bubble)
    elif pipeline is not None:
        report.pipeline = plan_pipeline(model, pipeline, (mesh or {}).get(MeshDim.PP, 1))
    return report


def _tier(model: nn.Module) -> TierReport | None:
    """The model's table groups on the SSD tier (``None``: none)."""
    groups = []
    for names, g in table_groups(model).items():
        if g.ssd_config is None:
            continue
        c, rows = g.ssd_config, g.ssd
        laid = {} if rows is None else dict(record_bytes=rows.layout.nbytes, cache_rows=rows.cache.capacity,
                                            file_bytes=rows.file.nbytes, stats=rows.cache.stats)
        groups.append(TierGroup(tuple(names.split(",")), c.directory, g.num_rows, c.cache_bytes, c.policy, **laid))
    return TierReport(tuple(groups)) if groups else None
