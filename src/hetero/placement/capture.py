"""The partitioner's capture of a model's forward graph: ``torch.fx`` symbolic tracing that keeps
modules with a placement of their own (host tables), instance forwards (recompute regions) and
forward hooks (FSDP2 units, operator strategies) as single ops and records ``on()`` regions
(see :mod:`hetero.placement.partitioner` for why symbolic tracing), with the helpers that read
a node's op type and module path.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from hetero.placement.annotate import current_region, module_target


class PlacementTracer(fx.Tracer):
    """Keeps modules with a placement, a forward or forward hooks of their own as single ops;
    records ``on()`` regions.

    A module with a pinned parameter (``PlacementSpec.param``) is traced through even when torch
    keeps it whole (``nn.Linear`` becomes ``linear`` on ``get_attr`` nodes), so the pin can put
    that parameter apart from the op that consumes it."""

    def __init__(self, trace_through: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.trace_through = trace_through

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if module_target(m) is not None or "forward" in vars(m) or m._forward_pre_hooks or m._forward_hooks:
            # a forward set on the instance (hetero.parallel.recompute's checkpoint region) is
            # not the class's graph, and a module's forward hooks (an FSDP2 unit's gathers, an
            # operator strategy's layouts) run only where it is called: tracing into either
            # would drop what wraps it
            return True
        return qualname not in self.trace_through and super().is_leaf_module(m, qualname)

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        node.meta["hetero_region"] = current_region()
        return node


def capture(model: nn.Module) -> fx.GraphModule:
    """``model``'s forward graph as the partitioner captures it: modules with a placement of their
    own (host tables) are single ``call_module`` nodes; ``nn.Linear`` and other leaf modules too.

    Raises:
        torch.fx.proxy.TraceError: (and what symbolic tracing raises) a forward with
            data-dependent control flow.
    """
    return fx.GraphModule(model, PlacementTracer().trace(model))


def op_type(node: fx.Node, root: nn.Module) -> str:
    """The op type of a node as op rules name it (``matmul``, ``add``, ``relu``, ``linear``...)."""
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)).strip("_")
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_module":
        return type(root.get_submodule(str(node.target))).__name__.lower()
    return node.op


def module_path(node: fx.Node) -> str:
    """The qualified name of the innermost module a node's op ran in (``""``: the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def modules_on_path(path: str) -> list[str]:
    """The module ``path`` and every module enclosing it, the root (``""``) first."""
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def capture_failure(model: nn.Module) -> str | None:
    """Why :func:`partition` cannot capture ``model``'s graph (it then falls back to module-level
    placement with hooks), or ``None`` when it can."""
    try:
        PlacementTracer().trace(model)
    except Exception as e:  # noqa: BLE001 - any failure of symbolic tracing means: no graph
        return f"{type(e).__name__}: {e}"
    return None
