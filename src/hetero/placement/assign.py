"""Which target each op of a traced forward runs on: the placement spec checked against the model,
then applied op by op (:mod:`hetero.placement.annotate` gives the precedence). Used by
:func:`hetero.placement.partitioner.partition`.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from hetero.placement.annotate import PlacementSpec, module_target
from hetero.placement.capture import module_path, modules_on_path, op_type
from hetero.placement.target import Target


def host_resident(m: nn.Module) -> bool:
    """Whether ``m``'s class keeps its parameters in host memory (``HostEmbedding``'s table)."""
    return getattr(type(m), "hetero_target", None) is Target.HOST



def check_names(model: nn.Module, spec: PlacementSpec, graph: fx.Graph) -> None:
    """Every module, parameter and op type ``spec`` names exists in ``model`` (and ``graph``).

    Raises:
        ValueError: naming the missing name and what the model has instead, or a pin that
            contradicts a host-resident module.
    """
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name in spec.modules:
        if name not in modules:
            raise ValueError(f"placement names module {name!r}, which {type(model).__name__} does not have; "
                             f"its modules are {sorted(m for m in modules if m)}")
    for name, t in spec.params.items():
        if name not in params:
            raise ValueError(f"placement pins parameter {name!r}, which {type(model).__name__} does not have; "
                             f"its parameters are {sorted(params)}")
        owner = modules[name.rsplit(".", 1)[0]] if "." in name else model
        if getattr(type(owner), "hetero_target", None) is Target.HOST and t is not Target.HOST:
            raise ValueError(f"conflicting pin: parameter {name!r} belongs to a host-resident "
                             f"{type(owner).__name__}; it cannot be placed on {t.value}")
    for rule in spec.ops:
        if rule.module and rule.module not in modules:
            raise ValueError(f"placement names module {rule.module!r}, which {type(model).__name__} does not have; "
                             f"its modules are {sorted(m for m in modules if m)}")
        found = {op_type(n, model) for n in graph.nodes if n.op.startswith("call")
                 and rule.module in modules_on_path(module_path(n))}
        if rule.op not in found:
            raise ValueError(f"placement names op type {rule.op!r} in module {rule.module or '(whole model)'!r}, "
                             f"which runs no such op; its op types are {sorted(found)}")


def assign_targets(model: nn.Module, spec: PlacementSpec, graph: fx.Graph) -> dict[fx.Node, Target]:
    """The target of every call and ``get_attr`` node of ``graph``: a region's, else the op rule of
    the innermost module, else the innermost placed module's, else the default; parameters pinned,
    else with their first consumer (precedence: :mod:`hetero.placement.annotate`)."""
    placed = {name: t for name, m in model.named_modules() if (t := module_target(m)) is not None}
    placed.update(spec.modules)  # the spec's entries win over marks and class defaults
    targets: dict[fx.Node, Target] = {}
    for node in graph.nodes:
        if not node.op.startswith("call"):
            continue
        path = module_path(node)
        kind = op_type(node, model)
        rules = [r for r in spec.ops if r.op == kind and r.module in modules_on_path(path)]
        if node.meta.get("hetero_region") is not None:
            targets[node] = node.meta["hetero_region"]
        elif rules:
            targets[node] = max(rules, key=lambda r: len(r.module)).target
        else:
            owners = [m for m in modules_on_path(path) if m in placed]
            targets[node] = placed[owners[-1]] if owners else spec.default
    for node in graph.nodes:  # parameters and buffers: pinned, else with their first consumer
        if node.op == "get_attr":
            pinned = spec.params.get(str(node.target))
            consumers = [u for u in node.users if u in targets]
            targets[node] = pinned or (targets[consumers[0]] if consumers else spec.default)
    return targets


def check_pins_honoured(model: nn.Module, spec: PlacementSpec, graph: fx.Graph, targets: dict[fx.Node, Target]) -> None:
    """A pinned parameter of a module that still runs as one op (it has a placement of its own)
    cannot live apart from that op: refuse a pin that differs, rather than ignore it."""
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        prefix = str(node.target)
        for name, _ in model.get_submodule(prefix).named_parameters(prefix=prefix):
            pin = spec.params.get(name)
            if pin is not None and pin is not targets[node] and not host_resident(model.get_submodule(name.rpartition(".")[0])):
                raise ValueError(f"placement pins parameter {name!r} to {pin.value}, but module {prefix!r} "
                                 f"({type(model.get_submodule(prefix)).__name__}) runs as one op on {targets[node].value} "
                                 f"(it has a placement of its own); place the module instead "
                                 f"(PlacementSpec().module({prefix!r}, {pin.value!r})) or drop the pin")
