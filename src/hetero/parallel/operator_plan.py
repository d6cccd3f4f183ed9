"""Operator sharding from outside the model: strategies by qualified name, applied to modules,
and the resolved layout written to and read from a strategy file.

A :class:`ShardingPlan` names modules (as ``PlacementSpec`` does for host/device) with the
strategy of their operator - for an ``nn.Linear``, ``((x slices), (weight slices))`` over
``(in, out)`` as the reference design's MatMul takes them. :func:`apply_sharding` turns each named
module's parameters into DTensor parameters with the layout their strategy implies (each rank
stores its shards: ``1/k`` of a weight cut in ``k``) and shards its input on every call, so
``torch.optim`` optimizers and autograd work on the shards. The resolved layout (mesh shape and
dimension names; qualified parameter name -> placements) is a JSON strategy file
(:func:`save_strategy`, :func:`load_strategy`): loading one into another model is an error naming
the first name that differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from hetero.parallel.operator import OpSignature, Strategy, assign_mesh, device_matrix, placements, to_dtensor


@dataclasses.dataclass(frozen=True)
class OpStrategy:
    """The strategy of one module's operator.

    Attributes:
        in_strategy: slices per dimension of each operator input: for ``nn.Linear`` the input
            ``(..., in)`` and the weight as the reference's MatMul takes it, ``(in, out)``.
        out_strategy: slices per dimension of the output (``None``: as computed).
        use_local_output: hand the next module this rank's local tensor instead of the DTensor
            (as torch's ``ParallelStyle``): with an ``out_strategy`` of all ones, the whole,
            replicated output, so unsharded modules after it take plain tensors.
    """

    in_strategy: Strategy
    out_strategy: tuple[int, ...] | None = None
    use_local_output: bool = False


class ShardingPlan:
    """Operator strategies by module qualified name. Methods chain: ``plan.module(...).module(...)``.

    Raises:
        ValueError: a second, different strategy for the same module.
    """

    def __init__(self) -> None:
        self.modules: dict[str, OpStrategy] = {}

    def module(self, name: str, in_strategy: Strategy, out_strategy: tuple[int, ...] | None = None,
               use_local_output: bool = False) -> "ShardingPlan":
        new = OpStrategy(tuple(tuple(s) for s in in_strategy), None if out_strategy is None else tuple(out_strategy),
                         use_local_output)
        if self.modules.setdefault(name, new) != new:
            raise ValueError(f"conflicting sharding strategies for module {name!r}: {self.modules[name]} and {new}")
        return self


# nn.Linear computes x @ W^T; the strategy names W as the MatMul's (in, out) input, "kn".
_LINEAR = OpSignature.parse("mk,kn->mn")


def apply_sharding(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh) -> dict[str, list[Placement]]:
    """Shard the modules ``plan`` names in place; returns the resolved layout of every sharded
    parameter (qualified name -> placements).

    Supported modules: ``nn.Linear`` on 2-D inputs ``(batch, in)``. Collective: every rank calls
    it with the same model and plan.

    Raises:
        ValueError: a name ``model`` does not have (listing its modules), a module of another
            type, or a bad strategy (see :func:`~hetero.parallel.operator.device_matrix`).
    """
    modules = dict(model.named_modules())
    layout: dict[str, list[Placement]] = {}
    for name, strategy in plan.modules.items():
        if name not in modules:
            raise ValueError(f"sharding plan names module {name!r}, which {type(model).__name__} does not have; its "
                             f"modules are {sorted(m for m in modules if m)}")
        m = modules[name]
        if not isinstance(m, nn.Linear):
            raise ValueError(f"sharding plan names module {name!r}, a {type(m).__name__}; operator strategies apply to "
                             f"nn.Linear modules")
        layout.update(_shard_linear(name, m, strategy, mesh))
    return layout


def _shard_linear(name: str, m: nn.Linear, strategy: OpStrategy, mesh: DeviceMesh) -> dict[str, list[Placement]]:
    op = f"{name} (Linear)"
    if len(strategy.in_strategy) != 2 or any(len(s) != 2 for s in strategy.in_strategy):
        raise ValueError(f"sharding strategy of {op}: give ((batch, in) slices of the input, (in, out) slices of the "
                         f"weight), got {strategy.in_strategy}")
    rows = strategy.in_strategy[0][0]  # the batch is not known yet: the input is checked by DTensor when it comes
    matrix = device_matrix(op, _LINEAR, strategy.in_strategy, [(rows, m.in_features), (m.in_features, m.out_features)])
    assignment = assign_mesh(op, matrix, mesh)
    w_place = placements("nk", assignment, mesh)  # torch keeps the weight as (out, in): letters n, k
    layout = {f"{name}.weight": w_place}
    m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, w_place))
    if m.bias is not None:
        layout[f"{name}.bias"] = placements("n", assignment, mesh)
        m.bias = nn.Parameter(distribute_tensor(m.bias.detach(), mesh, layout[f"{name}.bias"]))
    x_place = placements("mk", assignment, mesh)
    out_place = None
    if strategy.out_strategy is not None:
        out_matrix = dict(zip("mn", strategy.out_strategy))
        out_place = placements("mn", assign_mesh(f"{op} output", out_matrix, mesh, exact=False), mesh)

    def shard_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (to_dtensor(args[0], mesh, x_place), *args[1:])

    def lay_out_output(module: nn.Module, args: tuple[Any, ...], y: DTensor) -> torch.Tensor:
        y = y if out_place is None else y.redistribute(mesh, out_place)
        return y.to_local() if strategy.use_local_output else y

    m.register_forward_pre_hook(shard_input)
    m.register_forward_hook(lay_out_output)
    return layout


def placement_names(place: list[Placement]) -> list[str]:
    """Placements as text: ``R``, ``S(d)``, ``P`` (the strategy file's vocabulary)."""
    out = []
    for p in place:
        out.append(f"S({p.dim})" if isinstance(p, Shard) else "P" if isinstance(p, Partial) else "R")
    return out


def _parse_placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("S(") and text.endswith(")") and text[2:-1].isdigit():
        return Shard(int(text[2:-1]))
    raise ValueError(f"unknown placement {text!r} in strategy file; valid: 'R', 'P', 'S(<dim>)'")


def save_strategy(path: str | Path, mesh: DeviceMesh, layout: dict[str, list[Placement]]) -> Path:
    """Write the resolved layout as JSON: mesh shape and dimension names, name -> placements.

    Rank 0 writes (a temporary file renamed into place); every rank returns once it is there.
    Collective: every rank calls it."""
    path = Path(path)
    doc = {"mesh": {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names)},
           "layout": {k: placement_names(v) for k, v in sorted(layout.items())}}
    if dist.get_rank() == 0:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    dist.barrier()  # the other ranks may read it next
    return path


def load_strategy(path: str | Path, mesh: DeviceMesh, layout: dict[str, list[Placement]] | None = None
                  ) -> dict[str, list[Placement]]:
    """Read a strategy file; with ``layout`` (what a model resolves to), check they are the same.

    Raises:
        ValueError: another mesh, or the first qualified name whose placements differ or that
            only one side has.
    """
    doc = json.loads(Path(path).read_text())
    if doc["mesh"]["shape"] != list(mesh.shape) or doc["mesh"]["dim_names"] != list(mesh.mesh_dim_names):
        raise ValueError(f"strategy file {path} is for mesh {doc['mesh']}, this job's is "
                         f"{ {'shape': list(mesh.shape), 'dim_names': list(mesh.mesh_dim_names)} }")
    saved = {k: [_parse_placement(p) for p in v] for k, v in doc["layout"].items()}
    diff = None if layout is None else first_difference(saved, layout)
    if diff is not None:
        name, a, b = diff
        raise ValueError(f"strategy file {path} differs from the model at {name!r}: {a} in the file, {b} in the model")
    return saved


def first_difference(a: dict[str, list[Placement]], b: dict[str, list[Placement]]) -> tuple[str, str, str] | None:
    """The first name (sorted) whose placements differ between two layouts, with both as text."""
    for name in sorted(set(a) | set(b)):
        x, y = (placement_names(v[name]) if name in v else "absent" for v in (a, b))
        if x != y:
            return name, str(x), str(y)
    return None


def infer_predict_layout(model: nn.Module, *inputs: Any) -> dict[str, list[Placement]]:
    """The layout a predict run of ``model`` (already sharded for it, or not) uses: qualified
    parameter name -> placements (``[]`` for a plain, unsharded tensor). With ``inputs``, one
    forward pass without gradients first checks that the layout runs on them."""
    if inputs:
        with torch.no_grad():
            model(*inputs)
    return {name: list(p.placements) if isinstance(p, DTensor) else [] for name, p in model.named_parameters()}
