"""One function applies the parallel dimensions to a model, in one documented order.

``parallelize(model, plan, mesh)`` runs, each step reading only its part of :class:`ParallelPlan`:

1. **operator sharding** (:func:`~hetero.parallel.operator_plan.apply_sharding`): the annotated
   modules' weights become DTensor shards over ``dp x tp``;
2. **recompute** (:func:`~hetero.parallel.recompute.apply_recompute`): checkpoint regions wrap the
   already-sharded modules, so the recomputation replays the sharded operators;
3. **ZeRO** (:func:`~hetero.parallel.zero.apply_zero`): FSDP2 over ``dp`` for stages 2 and 3,
   last, because it shards the parameters as the steps above left them (2-D with ``tp``).

Data-parallel wrapping (DDP for stages 0 and 1, the host tables' sparse exchange) and the
optimizer (:func:`~hetero.parallel.zero.zero_optimizer`) come after, from the caller. Host/device
placement (``hetero.partition``) comes before, on the unsharded model. Reference: torchtitan's
``parallelize`` (the same order: TP, activation checkpointing, FSDP); the reference design's
multi-dimensional hybrid parallelism.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from hetero.parallel.comm_fusion import CommFusion
from hetero.parallel.operator_plan import ShardingPlan, apply_sharding
from hetero.parallel.recompute import RecomputeConfig, apply_recompute
from hetero.parallel.zero import ZeroConfig, apply_zero


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """What :func:`parallelize` applies.

    Attributes:
        sharding: operator strategies by module name (``None``: no operator sharding).
        recompute: the modules that recompute their activations, and what they keep.
        zero: the ZeRO stage over the mesh's ``dp`` dimension and its units.
        fusion: bucket sizes of the collectives (here: ZeRO's units when none are named; the
            caller's DDP and HostAdamW take the same config).
    """

    sharding: ShardingPlan | None = None
    recompute: RecomputeConfig = RecomputeConfig()
    zero: ZeroConfig = ZeroConfig()
    fusion: CommFusion = CommFusion()


def parallelize(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh) -> dict[str, list[Placement]]:
    """Apply ``plan`` to ``model`` in place, in the module docstring's order; returns the
    operator layout (qualified parameter name -> placements; empty without sharding).

    Collective: every rank calls it with the same model and plan.

    Raises:
        ValueError: as each step does (a name the model does not have, a bad strategy), before
            the later steps run.
    """
    layout = apply_sharding(model, plan.sharding, mesh) if plan.sharding is not None else {}
    apply_recompute(model, plan.recompute)
    apply_zero(model, plan.zero, mesh, plan.fusion)
    return layout
