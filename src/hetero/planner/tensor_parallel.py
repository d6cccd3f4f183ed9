"""The ``tp`` dimension of a plan: every ``nn.Linear``'s operator strategy at a tensor-parallel
degree, chosen by sharding propagation around the user's own annotations, and priced as
``hetero.apply`` runs it.

:func:`tensor_sharding` propagates layouts over the partitioner's torch.fx capture
(:func:`hetero.parallel.propagation.propagate` on a ``tp``-only mesh; annotated operators keep
their strategy) and turns each ``nn.Linear``'s layout into the :class:`OpStrategy`
:func:`hetero.parallel.operator_plan.apply_sharding` applies. A sharded module hands the next one
a DTensor where that one is a sharded ``nn.Linear`` (through single-input elementwise ops);
elsewhere - an operator propagation does not model, the loss, a residual sum - its output is
made whole and local (``use_local_output``), since torch's other operators do not take DTensors
beside plain tensors.

:class:`TensorSharding` holds what the cost model needs of that: each unit's share of compute
and parameters per rank, and the collectives DTensor issues - forward as
:func:`~hetero.parallel.propagation.edge_collectives` prices a redistribution, backward the same
edge reversed (the gradient of a whole tensor is whole on every rank: the backward of a gather
is a slice, of a slice a gather), and the all-reduce of every replicated weight's gradient
(a Linear cut along its batch rows). Reference: Megatron-LM (Shoeybi et al. 2019) for the
column/row pairing the propagation rediscovers; GSPMD (Xu et al. 2021) for the propagation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch.fx as fx
from torch import nn

from hetero.parallel.comm import Collective
from hetero.parallel.operator import Strategy
from hetero.parallel.operator_plan import OpStrategy, ShardingPlan
from hetero.placement.capture import module_path
from hetero.parallel.propagation import Place, _bytes, _ops, edge_collectives, input_place, output_place, propagate
from hetero.planner.calibration_types import Curve
from hetero.planner.graph import ModelGraph
from hetero.parallel.sharding_graph import capture_for_sharding
from hetero.parallel.comm import collective_bytes

# the measured curve a collective is priced by (an all-to-all moves what an all-gather does)
_CURVE = {Collective.ALL_GATHER: Collective.ALL_GATHER, Collective.ALL_REDUCE: Collective.ALL_REDUCE,
          Collective.REDUCE_SCATTER: Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL: Collective.ALL_GATHER}


def _local_bytes(kind: Collective, received: float, n: int) -> float:
    """A rank's local input bytes of a collective that receives ``received`` bytes per rank
    (the inverse of :func:`hetero.parallel.comm.collective_bytes`; curves are by local bytes)."""
    if kind is Collective.ALL_GATHER:
        return received / (n - 1)
    if kind is Collective.ALL_REDUCE:
        return received * n / (2 * (n - 1))
    return received * n / (n - 1)


@dataclasses.dataclass(frozen=True)
class TensorSharding:
    """A model's operator strategies at one tensor-parallel degree, and their costs.

    Attributes:
        tp: the degree (ranks that split each operator).
        strategies: ``nn.Linear`` qualified name -> its strategy (input ``(..., in)`` and weight
            ``(in, out)`` slices, as ``ShardingPlan.module`` takes them).
        annotated: the modules whose strategy is the user's, kept.
        layout: sharded parameter name -> placements over ``(pp, dp, tp)`` (``R``, ``S(d)``),
            the strategy file's ``layout``.
        compute_share: unit name -> the fraction of its compute one rank does (its Linears'
            FLOPs divided by ``tp``; its other ops whole).
        param_share: unit name -> the fraction of its parameter elements one rank holds.
        activation_calls: ``(unit, collective, local bytes)`` per step at the captured batch,
            forward and backward: scale with the batch a pass holds.
        weight_calls: ``(unit, collective, local bytes)`` per pass whatever the batch (replicated
            weights' gradient all-reduces).
    """

    tp: int
    strategies: dict[str, OpStrategy]
    annotated: tuple[str, ...]
    layout: dict[str, list[str]]
    compute_share: dict[str, float]
    param_share: dict[str, float]
    activation_calls: tuple[tuple[str, Collective, float], ...]
    weight_calls: tuple[tuple[str, Collective, float], ...]

    def bytes_per_step(self, scale: float = 1.0, passes: int = 1) -> float:
        """Bytes one rank receives per step (``scale``: a pass's share of the captured batch)."""

        act = sum(collective_bytes(k, b * scale, self.tp) for _, k, b in self.activation_calls)
        return passes * (act + sum(collective_bytes(k, b, self.tp) for _, k, b in self.weight_calls))

    def seconds(self, curves: Mapping[str, Curve], scale: float, passes: int, unit: str | None = None) -> float:
        """Seconds of the step's collectives (of ``unit``'s ops alone; ``""``: the ops of no
        unit) on this machine's ``curves`` for ``tp`` ranks."""
        act = sum(curves[_CURVE[k]].seconds(b * scale) for u, k, b in self.activation_calls if unit in (None, u))
        return passes * (act + sum(curves[_CURVE[k]].seconds(b) for u, k, b in self.weight_calls if unit in (None, u)))


def cuts_operators(plan: ShardingPlan | None) -> bool:
    """Whether a user's plan cuts some operator (a slice count above 1): only tp plans keep it."""
    return plan is not None and any(k > 1 for s in plan.modules.values() for part in s.in_strategy for k in part)


def tensor_sharding(gm: fx.GraphModule, strategies: dict[str, Strategy], user: ShardingPlan | None, tp: int,
                    units: Sequence[str], unit_flops: Mapping[str, float], unit_params: Mapping[str, int],
                    boundaries: Sequence[str] = (), host: Sequence[str] = ()) -> TensorSharding:
    """The operator strategies at degree ``tp`` (see the module docstring).

    Args:
        gm, strategies: :func:`hetero.parallel.sharding_graph.capture_for_sharding`'s capture of
            the model on its example batch, with the annotated nodes' strategies.
        user: the user's plan (its modules keep their strategies, outputs included).
        units: the plan's unit names (a module belongs to the longest one its name starts with;
            ``""``: none); ``unit_flops``, ``unit_params``: each unit's FLOPs per step (forward
            and backward) and parameter elements.
        boundaries: pipeline units across which every value is made whole and plain (a
            pipeline's sends take plain tensors; empty: the strategies of a model run whole).
        host: units that run on the host, whole on every rank: their ``nn.Linear`` modules get
            no strategy, and every value into or out of them is made whole and plain (the
            partitioner's host subgraphs take no DTensors).

    Raises:
        ValueError: an annotation that does not fit ``tp`` ranks, an ``nn.Linear`` on inputs
            of other than two dimensions, or one module called with two different layouts (no
            single strategy for its weight).
    """
    sizes = (1, 1, tp)  # (pp, dp, tp): the data-parallel ranks are priced apart (batch share)
    result = propagate(gm, strategies, sizes, all_to_all=False, training=True)
    ops = {op.node: op for op in _ops(gm)}
    linears = {n: op for n, op in ops.items()
               if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.Linear)}
    user_modules = {} if user is None else user.modules
    borders = list(boundaries) + list(host)  # (values cross them whole and plain)

    def whole(places: tuple[Place, ...]) -> tuple[Place, ...]:
        return tuple(("R",) if p[0] == "P" else p for p in places)

    def where(node: fx.Node) -> str:  # the module an op belongs to
        return str(node.target) if node.op == "call_module" else module_path(node)

    def region(node: fx.Node) -> str:  # its pipeline unit, or its host unit
        return _unit_of(where(node), borders)

    # which values may stay DTensors: every use a sharded Linear, or a one-input elementwise op
    # whose own value may (reverse topological order: users first), in the same pipeline unit
    keeps: dict[fx.Node, bool] = {}
    for node in reversed(list(gm.graph.nodes)):
        keeps[node] = bool(node.users) and all(
            (u in linears or (u in ops and len(ops[u].args) == 1 and keeps.get(u, False)))
            and (not borders or region(u) == region(node)) for u in node.users)

    strategy_of: dict[str, OpStrategy] = {}
    place: dict[fx.Node, tuple[Place, ...] | None] = {}  # a DTensor's placements (None: a plain tensor)
    act: list[tuple[str, Collective, float]] = []
    weight: list[tuple[str, Collective, float]] = []
    linear_flops: dict[str, float] = {}
    cut_params: dict[str, int] = {}
    layout: dict[str, list[str]] = {}

    def move(unit: str, src: tuple[Place, ...] | None, dst: tuple[Place, ...], nbytes: float,
             needs_grad: bool = True) -> None:
        if src is not None:  # a DTensor redistributed (forward), its gradient back (backward)
            calls = edge_collectives(src, dst, nbytes, sizes, False) + edge_collectives(dst, whole(src), nbytes, sizes, False)
        elif needs_grad:  # a plain tensor is sliced; its gradient is gathered whole again
            calls = edge_collectives(dst, (("R",),) * len(dst), nbytes, sizes, False)
        else:  # the batch: sliced, no gradient
            return
        act.extend((unit, k, _local_bytes(k, b, tp)) for _, k, b in calls)

    for node in gm.graph.nodes:
        op = ops.get(node)
        if op is None:
            continue
        lay = result.layouts[node.name]
        if _unit_of(where(node), host):  # a host unit's op: whole, on plain tensors (its inputs made so)
            place[node] = None
        elif node in linears:
            name, m = str(node.target), gm.get_submodule(str(node.target))
            cut, x_letters = lay.cuts[0], op.inputs[0]
            if len(x_letters) != 2:  # what apply_sharding shards: a plan it cannot apply is no plan
                raise ValueError(f"module {name!r} takes a {len(x_letters)}-D input; operator sharding applies to "
                                 f"nn.Linear on (batch, in) inputs")
            out = ((("R",),) * 2 + (output_place(op, lay)[0],))
            local = not keeps[node]  # made whole and plain for what takes no DTensor
            summed = not local and out[-1][0] == "P" and any(u not in linears for u in node.users)
            s = user_modules.get(name) or OpStrategy((tuple(tp if c == cut else 1 for c in x_letters),
                                                      (tp if cut == "k" else 1, tp if cut == "n" else 1)))
            if (local or summed) and s.out_strategy is None:
                # partial sums into an elementwise op are summed by the module itself: an explicit
                # redistribution (a collective counter sees it; not one inside DTensor's op)
                s = dataclasses.replace(s, out_strategy=(1,) * len(op.output), use_local_output=local)
            if strategy_of.setdefault(name, s) != s:
                raise ValueError(f"module {name!r} is called twice with different layouts at tp {tp}")
            unit = _unit_of(name, units)
            move(unit, place.get(op.args[0]), ((("R",),) * 2 + (input_place(x_letters, lay)[0],)), _bytes(op.args[0]),
                 op.args[0].op != "placeholder")
            if local or summed:  # whole (forward); the gradient of a whole tensor sliced back (free)
                move(unit, out, whole(out) if summed else (("R",),) * 3, _bytes(node))
            place[node] = None if local else whole(out) if summed else out
            shape = node.args[0].meta["tensor_meta"].shape
            linear_flops[unit] = linear_flops.get(unit, 0.0) + 6.0 * math.prod(shape[:-1]) * m.in_features * m.out_features
            if cut in ("k", "n"):
                cut_params[unit] = cut_params.get(unit, 0) + sum(p.numel() for p in m.parameters())
                layout[f"{name}.weight"] = ["R", "R", f"S({1 if cut == 'k' else 0})"]
                if m.bias is not None:
                    layout[f"{name}.bias"] = ["R", "R", "S(0)" if cut == "n" else "R"]
            else:  # rows cut: the weight is whole on every rank, its gradient summed
                nbytes = float(sum(p.numel() * p.element_size() for p in m.parameters()))
                weight.append((unit, Collective.ALL_REDUCE, nbytes))
        else:  # an elementwise op runs on its input as it comes; partial sums are summed first
            src = place.get(op.args[0]) if len(op.args) == 1 else None
            if src is not None and any(p[0] == "P" for p in src):
                move(_unit_of(where(node), units), src, whole(src), _bytes(op.args[0]))
                src = whole(src)
            place[node] = src if keeps[node] else None  # (a value kept as a DTensor has users that keep it)
    compute = {u: 1 - f + f / tp for u, total in unit_flops.items() if total
               for f in (min(1.0, linear_flops.get(u, 0.0) / total),)}
    params = {u: 1 - c / n + c / (n * tp) for u, n in unit_params.items() if n for c in (min(cut_params.get(u, 0), n),)}
    return TensorSharding(tp, strategy_of, tuple(n for n in user_modules if n in strategy_of), layout, compute, params,
                          tuple(act), tuple(weight))


def _unit_of(module: str, units: Sequence[str]) -> str:
    owners = [u for u in units if u and (module == u or module.startswith(u + "."))]
    return max(owners, key=len) if owners else ""


def tensor_options(model: nn.Module, example_inputs: tuple, sharding: ShardingPlan | None, world_size: int,
                   graph: ModelGraph, traceable: bool, boundaries: Sequence[str] = (),
                   host: Sequence[str] = ()) -> dict[int, TensorSharding]:
    """The model's :class:`TensorSharding` at every tensor-parallel degree ``tp > 1`` dividing
    ``world_size`` that the user's annotations fit (none for a model the partitioner cannot trace
    or without ``nn.Linear`` modules); with ``boundaries`` (pipeline units), those beside a
    pipeline of at least two stages; with ``host`` (units pinned to the host), those that run
    them whole.

    Raises:
        ValueError: an annotation naming a module the forward does not call (listing those it
            calls), or one that is not ``nn.Linear``; annotations on a model that does not trace;
            annotations that cut operators but fit no degree of ``world_size`` ranks, or cut one
            of a host unit.
    """

    if not traceable:
        if sharding is not None and sharding.modules:
            raise ValueError(f"operator annotations need a model torch.fx traces; {type(model).__name__} does not: "
                             f"drop the sharding plan, or make its forward traceable")
        return {}
    if sharding is None and world_size == 1:
        return {}
    gm, strategies = capture_for_sharding(model, example_inputs, _whole_on_host(sharding, host))
    units = [u.name for u in graph.units]
    flops = {u.name: float(sum(op.flops for op in u.forward + u.backward)) for u in graph.units}
    params = {u.name: u.params for u in graph.units}
    out, why = {}, ""
    stages = 2 if boundaries else 1
    for tp in range(2, world_size // stages + 1):
        if world_size % (stages * tp) or graph.batch % (world_size // (stages * tp)):
            continue
        try:
            t = tensor_sharding(gm, strategies, sharding, tp, units, flops, params, boundaries, host)
        except ValueError as e:
            why = f" ({e})"
            continue  # not at this degree
        if t.strategies:
            out[tp] = t
    if cuts_operators(sharding) and not out and not boundaries:
        raise ValueError(f"the operator annotations {sorted(strategies)} fit no tensor-parallel degree of {world_size} "
                         f"rank(s){why}: give slice counts that multiply to a divisor of the world size")
    return out


def _whole_on_host(sharding: ShardingPlan | None, host: Sequence[str]) -> ShardingPlan:
    """The user's annotations, checked to cut no operator of a ``host`` unit.

    Raises:
        ValueError: an annotation that cuts an operator of a host unit.
    """
    for name, s in (sharding.modules.items() if sharding is not None else ()):
        if _unit_of(name, host) and any(k > 1 for part in s.in_strategy for k in part):
            raise ValueError(f"module {name!r} is cut by its annotation {s.in_strategy}, but its unit "
                             f"{_unit_of(name, host)!r} is pinned to the host, which runs whole: drop the annotation "
                             f"or unpin the unit")
    return sharding or ShardingPlan()
