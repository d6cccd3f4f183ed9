"""``hetero.plan``: capture the model, price it on this machine's calibration, search every
model-wide setting and, under each, every unit's option; keep the fastest plan within the
budgets, with the runner-up each decision beat.

Order of work: capture on fake tensors (:mod:`hetero.planner.capture`) -> the calibration from
the cache, the model's op shapes timed once (:mod:`hetero.planner.calibration`) -> for each
candidate of the outer enumeration (:func:`hetero.planner.space.candidates`) the per-unit search
(:mod:`hetero.planner.search`) -> runner-ups: the best plan with each decision changed.

Branch and bound over the candidates: each has a lower bound, its least seconds with no budget
(:class:`~hetero.planner.search.SecondsOnly`: one label per frontier, a fraction of a search);
they are searched in the order of their bounds until the next bound is past the fastest plan
found (and its ties), then, for each decision, until no bound beats the fastest plan of another
value (its runner-up): the plan and every runner-up are those of searching every candidate
(tested), and a pipeline's ``O(p n^2)`` stage searches run only for pipelines that can win.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hetero.optim import SparseOptimizerKind
from hetero.parallel.operator_plan import ShardingPlan
from hetero.placement import PlacementSpec, Target
from hetero.placement.capture import capture_failure
from hetero.planner.applied import split_batch
from hetero.planner.calibration import cache_path, calibrate, collectives, disk, time_shapes
from hetero.planner.capture import capture, streamable_units
from hetero.planner.cost import MeasuredCost
from hetero.planner.cost_types import CostModel
from hetero.planner.config import ILP_UNITS, NoPlanError, PlannerConfig, SearchMethod
from hetero.parallel.pipeline_plan import pipeline_units
from hetero.planner.pipeline import (Stages, cut_positions, pipeline_failure, priced_stages, search_stages, split_points,
                                     stage_decisions)
from hetero.planner.plan import Decision, Plan, Prediction, SearchReport
from hetero.planner.decisions import global_decisions, no_plan_message, prediction, unit_decisions
from hetero.planner.search import (
    Assignment,
    Biased,
    Search,
    SecondsOnly,
    brute_force,
    dynamic_programming,
    evaluate,
    ilp,
)
from hetero.parallel.comm import Collective
from hetero.planner.space import (
    Candidate,
    CostPart,
    Enumerator,
    OptimizerKind,
    SpaceFacts,
    StateHome,
    UnitChoice,
    grid,
)
from hetero.planner.tensor_parallel import cuts_operators, tensor_options


class Planner:
    """A model captured and priced on this machine: :meth:`plan` searches under budgets,
    :meth:`price` predicts a given plan (a hand-written one) with the same cost model.

    Args: as :func:`plan` (the budgets apart), and the two stages a caller may swap (TorchRec's
        planner is the model): ``enumerator`` (:class:`~hetero.planner.space.Enumerator`, the
        model-wide settings to search; default :func:`~hetero.planner.space.grid`) and
        ``search`` (:class:`~hetero.planner.search.Search`, each setting's per-unit search;
        default the one ``config.method`` names). The cost model is the third
        (:class:`~hetero.planner.cost_types.CostModel`).

    Raises:
        ValueError: as :func:`plan`.
    """

    def __init__(self, model: nn.Module, example_inputs: tuple[Any, ...], *, world_size: int = 1,
                 loss_fn: Callable[[Any], Any] | None = None, optimizer: OptimizerKind = OptimizerKind.ADAMW,
                 sparse_optimizers: Mapping[str, SparseOptimizerKind] = {}, placement: PlacementSpec | None = None,
                 sharding: ShardingPlan | None = None, sample_batches: tuple[tuple[Any, ...], ...] = (),
                 config: PlannerConfig = PlannerConfig(), enumerator: Enumerator = grid,
                 search: Search | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: give the number of ranks the job runs on (>= 1)")
        self.model_name, self.world_size, self.optimizer, self.config = type(model).__name__, world_size, optimizer, config
        self.graph = capture(model, example_inputs, loss_fn, sample_batches, config.granularity)
        self.pinned = _pins(placement, [u.name for u in self.graph.units if u.name])
        # a model the partitioner cannot trace would place host units through hooks, whose copies
        # the cost model does not price: its dense units stay on the device (annotations apart)
        self.untraceable = capture_failure(model)
        # the tp dimension: operator strategies at each degree, around the user's annotations (the
        # units pinned to the host run whole: values into and out of them whole and plain)
        pinned_host = sorted(n for n, t in self.pinned.items() if t is Target.HOST and not self.graph.unit(n).tables)
        self.tensor = tensor_options(model, example_inputs, sharding, world_size, self.graph, self.untraceable is None,
                                     host=pinned_host)
        required = cuts_operators(sharding)
        start = time.perf_counter()
        self.calibration = calibrate(config.cache_dir)
        targets = ("device", "host") if self.untraceable is None or self.pinned else ("device",)
        time_shapes(self.calibration, self.graph, targets, config.cache_dir)
        self.calibration_seconds = time.perf_counter() - start
        leaves = [t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
        splittable = all(t.dim() and t.shape[0] == self.graph.batch for t in leaves)  # bags cannot be cut by rows
        has_tables = any(u.tables for u in self.graph.units)
        # the pp dimension: where stages may begin, for a model whose forward runs as stages (no host tables)
        self.pipeline_units = pipeline_units(model) if world_size > 1 and not has_tables else []
        self.pipeline_failure = pipeline_failure(model, example_inputs) if self.pipeline_units else None
        self.cuts = cut_positions([u.name for u in self.graph.units if u.name], self.pipeline_units) \
            if self.pipeline_units and self.pipeline_failure is None else []
        # a pipeline beside tp: the strategies again, every value whole between pipeline units (a
        # stage's sends take plain tensors)
        self.staged_tensor = tensor_options(model, example_inputs, sharding, world_size, self.graph, True,
                                            boundaries=self.pipeline_units) if self.cuts and self.tensor else {}
        self.search = search
        settings = enumerator(SpaceFacts(world_size, optimizer, self.graph.batch, has_tables,
                                         config.micro_batches if splittable else (1,), config.offload_ratios,
                                         max_pp=min(world_size, len(self.cuts) + 1) if self.cuts else 1,
                                         max_tp=max(self.tensor, default=1)))
        # annotations that cut operators are kept: only the degrees they fit
        # (a dense unit pinned to the host: only the settings that take pinned host units)
        self.settings = [c for c in settings if ((c.tp == 1 and not required) or c.tp in self.tensor)
                         and not (pinned_host and not c.takes_pinned_host_units())
                         and (c.pp == 1 or c.tp == 1 or c.tp in self.staged_tensor)]
        if not self.settings and pinned_host:
            raise ValueError(f"units {pinned_host} are pinned to the host, which runs beside tensor parallelism only "
                             f"outside a pipeline: plan without operator strategies that cut operators, with a batch "
                             f"the ranks divide, or for ranks that need no pipeline; or unpin them")
        # each dp degree's per-rank batch captured too, its ops timed at their own shapes: a
        # share's time scaled from the global batch's shapes is 40% off (measured: GPT at dp 2)
        shares = {d: capture(model, split_batch(example_inputs, d)[0], None, (), config.granularity)
                  for d in sorted({c.dp for c in self.settings if c.dp > 1})} if splittable else {}
        for g in shares.values():
            time_shapes(self.calibration, g, targets, config.cache_dir)
        self.cost = MeasuredCost(self.graph, self.calibration, optimizer, sparse_optimizers, self.pinned, shares=shares,
                                 host_units=self.untraceable is None, tensor=self.tensor,
                                 device_tables=config.device_tables, staged_tensor=self.staged_tensor,
                                 streamable=streamable_units(model, [u.name for u in self.graph.units if u.name and not u.tables])
                                 if self.untraceable is None else frozenset(), ssd=config.ssd,
                                 disk=disk(self.calibration, config.ssd.directory, config.cache_dir) if config.ssd else None)
        self.biased = Biased(self.cost, config.tolerance)  # the searches' tie-break (its mean unit remembered)
        sizes = {c.dp for c in self.settings} | {c.tp for c in self.settings} | {2 for c in self.settings if c.pp > 1}
        for n in sorted(sizes):  # collectives' rates (once; a pipeline's sends as 2 ranks' all-gather)
            collectives(self.calibration, n, config.cache_dir)

    def plan(self, device_memory: int | None = None, host_memory: int | None = None) -> Plan:
        """The fastest plan within the budgets (bytes per rank; ``None``: unlimited).

        Raises:
            ValueError: a budget below zero. NoPlanError: no plan fits.
        """
        for name, budget in (("device_memory", device_memory), ("host_memory", host_memory)):
            if budget is not None and budget < 0:
                raise ValueError(f"{name}={budget}: give a budget in bytes (>= 0), or None for unlimited")
        start = time.perf_counter()
        device_budget = float("inf") if device_memory is None else float(device_memory) * (1 - self.config.memory_margin)
        host_budget = float("inf") if host_memory is None else float(host_memory)
        method = self.config.method
        if method is SearchMethod.AUTO:
            method = SearchMethod.ILP if len(self.cost.names()) <= ILP_UNITS else SearchMethod.DYNAMIC_PROGRAMMING
        search = self.search or _SEARCH[method]
        searched: dict[Candidate, Assignment | None] = {}
        pipelined: dict[Candidate, Stages] = {}

        def run(c: Candidate) -> None:  # the biased search's assignment, priced without the bias
            if c.pp > 1:  # stages by dynamic programming over the unit sequence
                stages = self._stages(c, device_budget, host_budget)
                if stages is not None:
                    pipelined[c] = stages
                searched[c] = stages.assignment() if stages is not None else None
                return
            found = search(self.biased, c, device_budget, host_budget)
            searched[c] = evaluate(self.cost, c, found.choices) if found is not None else None

        # branch and bound: the settings by their unbudgeted least seconds; one whose bound is past the
        # fastest plan found (and its ties) cannot win - nor be a decision's runner-up, searched below
        bound = {c: self._bound(c) for c in self.settings}
        order = sorted(self.settings, key=bound.__getitem__)
        tolerance, fastest = 1 + self.config.tolerance, float("inf")
        for c in order:
            if bound[c] > fastest * tolerance:
                break
            run(c)
            fastest = min(fastest, searched[c].seconds if searched[c] is not None else fastest)
        feasible = [(c, a) for c, a in searched.items() if a is not None]
        if not feasible:  # (every setting searched: the smallest budget of the unpipelined ones, or of the pipelines)
            flat = [c for c in self.settings if c.pp == 1]

            def searched_at(cost: MeasuredCost, c: Candidate, device: float, host: float) -> Assignment | None:
                if c.pp == 1:
                    return search(cost, c, device, host)
                stages = self._stages(c, device, host)
                return stages.assignment() if stages else None

            raise NoPlanError(no_plan_message(self.cost, flat or self.settings, searched_at, device_budget, host_budget,
                                       self.config.memory_margin))
        broken = [c for c, a in feasible if not math.isfinite(a.seconds)]
        if broken:  # (a NaN would drop every plan from the ties below; seen once on an H200, cause not found)
            raise RuntimeError(f"the cost model priced {broken[0]} at {searched[broken[0]].seconds} seconds: "
                               f"delete {cache_path(self.config.cache_dir)} to calibrate this machine again")
        fastest = min(a.seconds for _, a in feasible)
        ties = [(c, a) for c, a in feasible if a.seconds <= fastest * tolerance]
        best_c, best = min(ties, key=lambda ca: (_changes(self.cost, ca[0], ca[1]), ca[1].seconds))
        for what, value in best_c.describe().items():  # each decision's runner-up: the fastest of another value
            for c in (c for c in order if c.describe()[what] != value):
                other = [a.seconds for x, a in searched.items() if a is not None and x.describe()[what] != value]
                if other and bound[c] > min(other):
                    break
                if c not in searched:
                    run(c)
        results = [(c, searched[c]) for c in self.settings if c in searched]  # (in the enumeration's order)
        if best_c.pp > 1:
            units = [Decision(*row) for row in stage_decisions(self.cost.names(), best_c, pipelined[best_c])]
        else:
            units = unit_decisions(self.cost, best_c, best, device_budget, host_budget)
        decisions = global_decisions(best_c, best, results) + units
        report = SearchReport(method.value, len(self.settings), sum(a is not None for _, a in results), self.graph.seconds,
                              self.calibration_seconds, time.perf_counter() - start, len(results))
        return self._plan(best_c, best, device_memory, host_memory, decisions, report, pipelined.get(best_c))

    def _bound(self, c: Candidate) -> float:
        """The least predicted seconds of any assignment of ``c``, budgets aside (a lower bound)."""
        found = search_stages(SecondsOnly(self.cost), c, self.cuts, float("inf"), float("inf"), self._transfer(c),
                              self._reduce(c)) if c.pp > 1 else \
            dynamic_programming(SecondsOnly(self.cost), c, float("inf"), float("inf"))
        return found.seconds if found is not None else float("inf")

    def _stages(self, c: Candidate, device: float, host: float) -> Stages | None:
        """The best split within the budgets, its ties broken as :meth:`plan`'s (host units, recompute and
        switches cost a tolerance more), priced without that bias."""
        transfer, reduce = self._transfer(c), self._reduce(c)
        found = search_stages(self.biased, c, self.cuts, device, host, transfer, reduce)
        return priced_stages(self.cost, c, found.cuts, found.choices, transfer, reduce) if found is not None else None

    def _transfer(self, c: Candidate) -> Callable[[int], float]:
        """Seconds to send boundary ``i``'s activations of one micro-batch to the next stage and
        their gradients back (two ranks' all-gather of the bytes, each way)."""
        curve = self.calibration.collective_curves(2)[Collective.ALL_GATHER]
        return lambda i: 2 * curve.seconds(self.cost.units[i - 1].output_bytes / (c.dp * c.micro_batches))

    def _reduce(self, c: Candidate) -> Callable[[int, int], float]:
        """Seconds of the gradient all-reduce of units ``lo..hi-1`` over the ``dp`` replicas of
        their stage (once per step, after the stage's last backward)."""
        return lambda lo, hi: self.cost.gradient_seconds(c, sum(u.param_bytes for u in self.cost.units[lo:hi]))

    def price(self, candidate: Candidate, units: Mapping[str, UnitChoice] = {}) -> Plan:
        """``candidate`` with ``units``' decisions (the rest on the device) as a plan, priced by
        the same cost model (no search; it may not fit any budget).

        Raises:
            ValueError: a unit the model does not have, an option it cannot take, or a ``tp``
                the model has no operator strategies for.
        """
        degrees = self.staged_tensor if candidate.pp > 1 else self.tensor
        if candidate.tp > 1 and candidate.tp not in degrees:
            raise ValueError(f"tp {candidate.tp}: the model has no operator strategies at that degree; its degrees "
                             f"are {sorted(degrees)} (plan for world_size ranks with nn.Linear modules)")
        if candidate.pp > 1:
            if not self.cuts or candidate.pp > len(self.cuts) + 1 or units:
                raise ValueError(f"pp {candidate.pp}: the model's stages are searched (give no units), and it needs "
                                 f"{candidate.pp} pipeline units whose forward runs as stages "
                                 f"({self.pipeline_failure or f'{len(self.cuts) + 1} pipeline unit(s)'})")
            stages = self._stages(candidate, float("inf"), float("inf"))
            a = stages.assignment()
            report = SearchReport("given", 1, 1, self.graph.seconds, self.calibration_seconds, 0.0, 1)
            return self._plan(candidate, a, None, None, [], report, stages)
        names = self.cost.names()
        for name in units:
            if name not in names:
                raise ValueError(f"no unit {name!r}; the model's units are {names}")
        choices = []
        for i, name in enumerate(names):
            options = self.cost.options(i, candidate)
            choice = units.get(name, options[0])
            if choice not in options:
                raise ValueError(f"unit {name!r} cannot take {choice}; its options are {[str(o) for o in options]}")
            choices.append(choice)
        a = evaluate(self.cost, candidate, choices)
        report = SearchReport("given", 1, 1, self.graph.seconds, self.calibration_seconds, 0.0, 1)
        return self._plan(candidate, a, None, None, [], report)

    def _plan(self, c: Candidate, a: Assignment, device_memory: int | None, host_memory: int | None,
              decisions: list[Decision], report: SearchReport, stages: Stages | None = None) -> Plan:
        t = self.cost.sharding(c) if c.tp > 1 else None
        predicted = prediction(self.cost, c, a) if stages is None else Prediction(
            a.seconds, a.device_bytes, a.host_bytes,
            {CostPart.SLOWEST_STAGE: a.seconds})
        moved = tuple(table.name for i, ch in enumerate(a.choices) for table in self.cost.table_order(i)[:ch.device_tables])
        on_ssd = [table for i, ch in enumerate(a.choices) for table in self.cost.ssd_order(i)[:ch.ssd_tables]]
        hit = self.cost.tables.ssd_cost(on_ssd, c)[2] if on_ssd else None
        return Plan(self.model_name, self.graph.batch, self.world_size, device_memory, host_memory, self.optimizer, c,
                    dict(zip(self.cost.names(), a.choices)), dict(self.pinned), predicted, decisions,
                    report, self.calibration.machine, self.calibration.host_is_device,
                    dict(t.strategies) if t else {}, dict(t.layout) if t else {}, t.annotated if t else (), moved,
                    split_points(self.cost.names(), self.pipeline_units, a.cuts), self.config.granularity,
                    tuple(t.name for t in on_ssd), hit, self.config.ssd if on_ssd else None)


def plan(model: nn.Module, example_inputs: tuple[Any, ...], *, device_memory: int | None = None,
         host_memory: int | None = None, world_size: int = 1, loss_fn: Callable[[Any], Any] | None = None,
         optimizer: OptimizerKind = OptimizerKind.ADAMW, sparse_optimizers: Mapping[str, SparseOptimizerKind] = {},
         placement: PlacementSpec | None = None, sharding: ShardingPlan | None = None,
         sample_batches: tuple[tuple[Any, ...], ...] = (), config: PlannerConfig = PlannerConfig()) -> Plan:
    """The fastest plan for training ``model`` within the budgets (see the module docstring).

    Args:
        example_inputs: one training batch as ``forward`` takes it (the plan is for its size).
        device_memory, host_memory: budgets in bytes per rank (``None``: unlimited).
        world_size: ranks the job will run on (the mesh ``pp x dp x tp`` is chosen for it).
        loss_fn: the loss of the model's output (default: the sum of its outputs).
        optimizer: the dense optimizer (:class:`OptimizerKind`); its math is kept.
        sparse_optimizers: host tables' sparse optimizers by qualified-name prefix (default LazyAdam).
        placement: the user's annotations: ``placement.module(unit, target)`` pins a unit; kept.
        sharding: the user's operator annotations (``ShardingPlan().module(linear, strategy)``):
            kept; sharding propagation chooses every other ``nn.Linear``'s strategy at each
            tensor-parallel degree they fit (``world_size > 1``; the model must trace).
        sample_batches: more batches whose table ids join the id statistics.
        config: the search (:class:`PlannerConfig`).

    Raises:
        ValueError: an annotation naming no unit of the model (listing the units), an operator
            annotation naming no ``nn.Linear`` the forward calls (listing those it calls) or
            fitting no degree of ``world_size``, a budget below zero, or ``world_size < 1``.
        NoPlanError: no plan fits (the smallest budget that works and what dominates it).
    """
    planner = Planner(model, example_inputs, world_size=world_size, loss_fn=loss_fn, optimizer=optimizer,
                      sparse_optimizers=sparse_optimizers, placement=placement, sharding=sharding,
                      sample_batches=sample_batches, config=config)
    return planner.plan(device_memory, host_memory)


def _changes(cost: MeasuredCost, c: Candidate, a: Assignment) -> int:
    """How far a plan is from the plain one (the state on the device, one pass, no recompute or
    streamed weights, tables on the host) and how often its dense units switch between host and device (each
    switch hands work over)."""
    dense = [ch for ch, u in zip(a.choices, cost.units) if not u.tables]
    targets = [Target.DEVICE, *(ch.target for ch in dense), Target.DEVICE]
    switches = sum(x is not y for x, y in zip(targets, targets[1:]))
    return (c.micro_batches > 1) + (c.state is not StateHome.DEVICE) + (c.zero > 0) + (c.tp > 1) + (c.pp > 1) + switches + \
        sum(ch.recompute or ch.weights is Target.HOST for ch in a.choices) + sum(ch.device_tables > 0 for ch in a.choices)


def _search_brute(cost: CostModel, c: Candidate, device: float, host: float) -> Assignment | None:
    if len(cost.names()) > 14:
        raise ValueError(f"brute force over {len(cost.names())} units would try 3^{len(cost.names())} assignments: "
                         f"use SearchMethod.ILP or DYNAMIC_PROGRAMMING")
    return brute_force(cost, c, device, host)


_SEARCH = {SearchMethod.DYNAMIC_PROGRAMMING: dynamic_programming, SearchMethod.ILP: ilp,
           SearchMethod.BRUTE_FORCE: _search_brute}


def _pins(placement: PlacementSpec | None, units: list[str]) -> dict[str, Target]:
    """The units a user's annotations pin. Raises ValueError for a name that is no unit."""
    if placement is None:
        return {}
    if placement.params or placement.ops:
        raise ValueError("the planner keeps module annotations (placement.module(unit, target)); parameter and op "
                         "pins are decided by the plan: place whole units")
    for name in placement.modules:
        if name not in units:
            raise ValueError(f"annotation names {name!r}, which is not a unit of the model; its units are {units}")
    return dict(placement.modules)
