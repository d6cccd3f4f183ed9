"""Operator sharding on the captured graph: a :class:`ShardingPlan`'s strategies on the
partitioner's torch.fx capture, propagation to the operators it leaves unannotated, a run of the
model under the propagated layouts, and the report ``hetero.explain`` prints.

:func:`capture_for_sharding` traces the model, records shapes and dtypes on example inputs, and
maps the plan's module names to graph nodes. :class:`LayoutInterpreter` executes the graph with
every modelled operator's inputs redistributed (DTensor ``redistribute``) to the layout the
propagation chose and its weights cut the same way, so the collectives that run are the ones the
plan predicts; counting them (:class:`hetero.parallel.comm.CollectiveCounter`) checks the
prediction. :func:`explain_sharding` needs no processes: it plans for mesh sizes alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.fx.passes.shape_prop import ShapeProp

from hetero.parallel.mesh import MeshDim
from hetero.parallel.operator import OpSignature, Strategy, device_matrix, to_dtensor
from hetero.parallel.operator_plan import ShardingPlan
from hetero.parallel.propagation import OpLayout, Place, Propagation, _expand, _ops, input_place, propagate
from hetero.placement.capture import capture


def capture_for_sharding(model: nn.Module, example_inputs: tuple[Any, ...], plan: ShardingPlan
                         ) -> tuple[fx.GraphModule, dict[str, Strategy]]:
    """The traced forward with shapes (one forward pass without gradients) and the plan's
    strategies keyed by graph node name.

    Raises:
        ValueError: a plan name the forward does not call as a module (listing those it calls),
            a module that is not ``nn.Linear``, or a strategy that does not fit its shapes.
    """
    gm = capture(model)
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)
    called = {str(n.target): n for n in gm.graph.nodes if n.op == "call_module"}
    strategies = {}
    for name, strategy in plan.modules.items():
        if name not in called:
            raise ValueError(f"sharding plan names module {name!r}, which the forward of {type(model).__name__} does not "
                             f"call; the modules it calls are {sorted(called)}")
        m = gm.get_submodule(name)
        if not isinstance(m, nn.Linear):
            raise ValueError(f"sharding plan names module {name!r}, a {type(m).__name__}; operator strategies apply "
                             f"to nn.Linear modules")
        x = tuple(called[name].args[0].meta["tensor_meta"].shape)
        batch = "abcdefgh"[: len(x) - 2] + "m"
        device_matrix(f"{name} (Linear)", OpSignature((batch + "k", "kn"), batch + "n"), strategy.in_strategy,
                      [x, (m.in_features, m.out_features)])
        strategies[called[name].name] = strategy.in_strategy
    return gm, strategies


def mesh_sizes(sizes: Mapping[MeshDim, int]) -> tuple[int, ...]:
    """Sizes in mesh order from ``{MeshDim.DP: 2, MeshDim.TP: 2}`` (pipeline stages are separate
    graphs: the operator layouts of one stage use ``dp x tp``)."""
    return tuple(1 if d is MeshDim.PP else sizes.get(d, 1) for d in MeshDim)


def _placements(places: tuple[Place, ...]) -> list[Placement]:
    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in places]


def _weight_places(layout: OpLayout, letters: str, sizes: tuple[int, ...]) -> tuple[Place, ...]:
    return _expand(input_place(letters, layout), sizes, [d for d, n in enumerate(sizes) if n > 1])


class LayoutInterpreter(fx.Interpreter):
    """Run a captured graph under a :class:`Propagation`'s layouts on ``mesh``.

    Each modelled operator gets its inputs as DTensors with the placements its layout asks
    (a redistribution where the producer's differ, a local slice for plain tensors) and, for
    ``nn.Linear``, its weight and bias cut as the layout cuts them. Outputs are DTensors;
    ``.full_tensor()`` gives the global value. Collective: every rank of ``mesh`` runs it.
    """

    def __init__(self, gm: fx.GraphModule, result: Propagation, mesh: DeviceMesh) -> None:
        super().__init__(gm)
        self.result, self.mesh = result, mesh
        self.sizes = tuple(mesh.shape)
        self.mesh_dims = [d for d, n in enumerate(self.sizes) if n > 1]
        self.modelled = {op.node: op for op in _ops(gm)}

    def run_node(self, n: fx.Node) -> Any:
        op = self.modelled.get(n)
        if op is None:
            return super().run_node(n)
        layout = self.result.layouts[n.name]
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args = list(args)
        for letters, producer in zip(op.inputs, op.args):
            i = n.args.index(producer)
            need = _expand(input_place(letters, layout), self.sizes, self.mesh_dims)
            args[i] = to_dtensor(args[i], self.mesh, _placements(need))
        if n.op == "call_module" and isinstance(m := self.module.get_submodule(str(n.target)), nn.Linear):
            # torch stores the weight (out, in): letters n, k of the operator mk,kn->mn
            w = to_dtensor(m.weight, self.mesh, _placements(_weight_places(layout, "nk", self.sizes)))
            b = None if m.bias is None else to_dtensor(m.bias, self.mesh, _placements(_weight_places(layout, "n", self.sizes)))
            return F.linear(args[0], w, b)
        return getattr(self, n.op)(n.target, tuple(args), kwargs)


@dataclasses.dataclass
class ShardingReport:
    """What operator sharding makes of a model, per rank and step (the forward pass).

    Attributes:
        mesh: mesh dimension name -> size.
        propagation: every operator's layout and every redistribution with its bytes.
        param_bytes: bytes of all parameters, unsharded.
        param_bytes_per_rank: bytes each rank stores once the layouts cut the weights.
    """

    mesh: dict[str, int]
    propagation: Propagation
    param_bytes: int
    param_bytes_per_rank: int

    def __str__(self) -> str:
        mesh = " x ".join(f"{k} {v}" for k, v in self.mesh.items())
        return "\n".join([f"operator sharding on mesh {mesh}:", *("  " + ln for ln in str(self.propagation).splitlines()),
                          f"  parameters: {self.param_bytes_per_rank} B per rank of {self.param_bytes} B"])


def explain_sharding(model: nn.Module, example_inputs: tuple[Any, ...], plan: ShardingPlan,
                     sizes: Mapping[MeshDim, int], all_to_all: bool = True) -> ShardingReport:
    """Plan ``plan`` on a mesh of ``sizes`` without running any process group.

    Args:
        all_to_all: the backend has all-to-all (NCCL: ``True``; gloo: ``False``).

    Raises:
        ValueError: as :func:`capture_for_sharding`, or a strategy that does not fit the mesh.
    """
    gm, strategies = capture_for_sharding(model, example_inputs, plan)
    full = mesh_sizes(sizes)
    result = propagate(gm, strategies, full, all_to_all)
    divisor: dict[str, int] = {}
    for op in _ops(gm):
        if op.node.op == "call_module" and isinstance(gm.get_submodule(str(op.node.target)), nn.Linear):
            for suffix, letters in (("weight", "nk"), ("bias", "n")):
                places = _weight_places(result.layouts[op.node.name], letters, full)
                divisor[f"{op.node.target}.{suffix}"] = math.prod(n for p, n in zip(places, full) if p[0] == "S")
    total = per_rank = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        per_rank += nbytes // divisor.get(name, 1)
    return ShardingReport({d.value: n for d, n in zip(MeshDim, full)}, result, total, per_rank)
