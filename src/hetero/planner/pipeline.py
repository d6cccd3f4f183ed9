"""The pp dimension: a model's unit sequence cut into pipeline stages by dynamic programming, each
stage on its own rank, each of its units on the device, recomputing, or on the host (its ops and
parameters in the rank's host memory, without data or tensor parallelism: the partitioner runs
the stage as host and device subgraphs).

**Where a stage may begin.** At a pipeline unit of the runtime
(:func:`hetero.parallel.pipeline_plan.pipeline_units`: the model's children, a ``ModuleDict``'s
entries one by one): :func:`cut_positions` maps them onto the planner's units.

**A stage's cost** (:func:`stage_cost`), for ``m`` micro-batches over ``p`` stages under 1F1B
(Narayanan et al. 2021): its units' seconds over the step (the cost model's, at a micro-batch's
share) plus sending its input's activations forward and their gradients back each micro-batch;
its device peak: its units' parameters, gradients and optimizer state, plus the activations
of the micro-batches in flight - stage ``s`` holds ``min(m, p - s)`` of them before its first
backward - plus the largest backward workspace. The ops of no unit (the loss) run on the last
stage; the batch is on every stage's budget (conservative: only the first holds it).

**The step** is the slowest stage's: its work per micro-batch times ``m + p - 1`` (the fill and
drain of the pipeline: the bubble, ``(p - 1) / (m + p - 1)`` of it), then its optimizer updates
(once, after the last backward: on the device, or on the host for offloaded state) and the
all-reduce of its gradients over its ``dp`` replicas (each replica runs ``1 / dp`` of the batch).

**The search** (:func:`search_stages`): ``best(s, i)`` - the least bottleneck of cutting units
``i..n-1`` into stages ``s..p-1`` - over every end of stage ``s`` (a cut position), each stage's
units given their fastest options within the budget by the per-unit Pareto dynamic program of
:mod:`hetero.planner.search` (its peak the stage's): exact over the cut positions and the
options (tested against :func:`brute_force_stages`), ``O(p n^2)`` stage searches.

Reference: the reference design's ``dynamic_programming`` strategy search and pipeline stages;
Alpa (Zheng et al. 2022) for stage cutting as a DP over the layer sequence; PipeDream (Narayanan
et al. 2019) for balancing the slowest stage.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hetero.placement import Target
from hetero.planner.cost_types import CostModel
from hetero.planner.search import Assignment, Label, frontiers
from hetero.planner.space import Candidate, UnitChoice
from hetero.parallel.pipeline import stage_module
from hetero.parallel.pipeline_plan import pipeline_units


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One stage: its units' options, its seconds over the step (its units' work and transfers),
    its device peak and host bytes."""

    choices: tuple[UnitChoice, ...]
    seconds: float
    device_bytes: int
    host_bytes: int


@dataclasses.dataclass(frozen=True)
class Stages:
    """A pipeline split and what it predicts.

    Attributes:
        cuts: the unit indices where stages ``1..p-1`` begin.
        choices: every unit's option, in order.
        seconds: the predicted step (the slowest stage's); ``stage_seconds``: each stage's.
        device_bytes: the largest stage's device peak; ``host_bytes``: the largest stage's.
    """

    cuts: tuple[int, ...]
    choices: tuple[UnitChoice, ...]
    seconds: float
    stage_seconds: tuple[float, ...]
    device_bytes: int
    host_bytes: int

    def assignment(self) -> Assignment:
        """The split as the per-unit searches' result (its cuts kept)."""
        return Assignment(self.choices, self.seconds, self.device_bytes, self.host_bytes, self.cuts)


def cut_positions(units: Sequence[str], pipeline_units: Sequence[str]) -> list[int]:
    """The planner's unit indices where a stage may begin: the first unit of each pipeline unit
    but the first (a planner unit belongs to the pipeline unit its name is, or starts with)."""
    def owner(name: str) -> str | None:
        return next((p for p in pipeline_units if name == p or name.startswith(p + ".")), None)

    owners = [owner(u) for u in units]
    return [i for i in range(1, len(units)) if owners[i] is not None and owners[i] != owners[i - 1]]


def stage_cost(cost: CostModel, c: Candidate, lo: int, hi: int, stage: int, choices: Sequence[UnitChoice],
               transfer: Callable[[int], float], reduce: Callable[[int, int], float] = lambda lo, hi: 0.0) -> StageCost:
    """Stage ``stage`` holding units ``lo..hi-1`` under ``choices`` (one per unit; see the module
    docstring); ``transfer(i)``: seconds to send boundary ``i``'s activations forward and their
    gradients back, once; ``reduce(lo, hi)``: the stage's gradient all-reduce over its ``dp``
    replicas."""
    fixed, pace = cost.fixed(c), _pace(c)
    seconds, static, kept, during, host = 0.0, 0, 0, 0, 0
    previous = UnitChoice(Target.DEVICE) if lo else None  # received from the stage before: kept here
    for i, choice in zip(range(lo, hi), choices, strict=True):
        u, b = cost.unit(i, choice, c), cost.boundary(i, previous, choice, c)
        seconds += (u.seconds - u.update_seconds + b.seconds) * pace + u.update_seconds
        during = max(during, kept + b.device_during, kept + b.device_bytes + u.device_during)
        kept += b.device_bytes + u.device_kept
        static += u.device_static
        host += u.host_bytes
        previous = choice
    seconds, kept, during = _stage_end(cost, c, hi, previous, seconds, kept, during)
    if lo:
        seconds += c.micro_batches * transfer(lo) * pace
    in_flight = min(c.micro_batches, c.pp - stage)
    peak = fixed.device_bytes + static + (in_flight - 1) * kept + max(kept, during)
    # its work as the pipeline paces it and its updates, then its replicas' all-reduce
    return StageCost(tuple(choices), seconds + reduce(lo, hi), peak,
                     host + (fixed.host_bytes if hi == len(cost.names()) else 0))


def _pace(c: Candidate) -> float:
    """What the pipeline stretches a stage's per-pass work by: its fill and drain, ``m + p - 1``
    micro-batch slots for ``m`` micro-batches (the optimizer updates run once, after them)."""
    return (c.micro_batches + c.pp - 1) / c.micro_batches


def _stage_end(cost: CostModel, c: Candidate, hi: int, last: UnitChoice, seconds: float, kept: int,
               during: int) -> tuple[float, int, int]:
    """A stage's seconds, kept bytes and running peak once its last unit (under ``last``) is
    done: the last stage runs the ops of no unit and the loss on the device; another sends its
    output from the device (a host unit's output copied there first)."""
    if hi == len(cost.names()):
        fixed, b = cost.fixed(c), cost.boundary(hi, last, None, c)
        kept += b.device_bytes
        return seconds + (b.seconds + fixed.seconds) * _pace(c), kept, max(during, kept + fixed.device_during)
    if last.target is Target.HOST:
        seconds += cost.boundary(hi, last, UnitChoice(Target.DEVICE), c).seconds * _pace(c)
    return seconds, kept, during


def _best_stage(cost: CostModel, c: Candidate, lo: int, hi: int, stage: int, device: float, host: float,
                transfer: Callable[[int], float], reduce: Callable[[int, int], float],
                max_labels: int = 256, resolution: int = 2000) -> StageCost | None:
    """The stage's fastest options within the budgets (``None``: none fits): the per-unit Pareto
    dynamic program of :func:`hetero.planner.search.dynamic_programming`, its device peak the
    stage's (the kept bytes of every micro-batch in flight)."""
    fixed, in_flight = cost.fixed(c), min(c.micro_batches, c.pp - stage)

    def peak(static: int, kept: int, during: int) -> int:
        return fixed.device_bytes + static + (in_flight - 1) * kept + max(kept, during)

    quantum = max(1.0, device / resolution) if device != float("inf") else 1.0
    start = Label(0.0, 0, 0, 0, fixed.host_bytes if hi == len(cost.names()) else 0, ())
    frontier = frontiers(cost, c, lo, hi, {UnitChoice(Target.DEVICE) if lo else None: [start]},
                         lambda x: peak(x.static, x.kept, x.peak) <= device and x.host <= host, max_labels, quantum,
                         _pace(c))
    best: tuple[float, tuple[UnitChoice, ...]] | None = None
    for last, labels in frontier.items():
        for label in labels:
            seconds, kept, during = _stage_end(cost, c, hi, last, label.seconds, label.kept, label.peak)
            if peak(label.static, kept, during) <= device and (best is None or seconds < best[0]):
                best = (seconds, label.choices)
    return stage_cost(cost, c, lo, hi, stage, best[1], transfer, reduce) if best is not None else None


def priced_stages(cost: CostModel, c: Candidate, cuts: Sequence[int], choices: Sequence[UnitChoice],
                  transfer: Callable[[int], float], reduce: Callable[[int, int], float] = lambda lo, hi: 0.0) -> Stages:
    """The split at ``cuts`` with every unit's option ``choices`` priced by ``cost`` (a search's
    result under a cost model biased for its tie-break, priced without the bias)."""
    bounds = [0, *cuts, len(cost.names())]
    return _stages(cuts, [stage_cost(cost, c, lo, hi, s, choices[lo:hi], transfer, reduce)
                          for s, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])


def _stages(cuts: Sequence[int], parts: Sequence[StageCost]) -> Stages:
    return Stages(tuple(cuts), tuple(ch for s in parts for ch in s.choices), max(s.seconds for s in parts),
                  tuple(s.seconds for s in parts), max(s.device_bytes for s in parts), max(s.host_bytes for s in parts))


def search_stages(cost: CostModel, c: Candidate, cuts: Sequence[int], device: float, host: float,
                  transfer: Callable[[int], float], reduce: Callable[[int, int], float] = lambda lo, hi: 0.0
                  ) -> Stages | None:
    """The split into ``c.pp`` stages at ``cuts`` (allowed positions) with the least predicted
    step within the budgets (per stage; ``None``: none fits). See the module docstring."""
    n, p = len(cost.names()), c.pp
    starts = [0, *sorted(cuts)]
    memo: dict[tuple[int, int], tuple[float, list[StageCost], list[int]] | None] = {}

    def best(s: int, lo: int) -> tuple[float, list[StageCost], list[int]] | None:
        if (s, lo) in memo:
            return memo[(s, lo)]
        out = None
        if s == p - 1:
            stage = _best_stage(cost, c, lo, n, s, device, host, transfer, reduce)
            out = (stage.seconds, [stage], []) if stage is not None else None
        else:
            for hi in (x for x in starts if x > lo):
                stage = _best_stage(cost, c, lo, hi, s, device, host, transfer, reduce)
                rest = best(s + 1, hi) if stage is not None else None
                if rest is not None and (out is None or max(stage.seconds, rest[0]) < out[0]):
                    out = (max(stage.seconds, rest[0]), [stage, *rest[1]], [hi, *rest[2]])
        memo[(s, lo)] = out
        return out

    found = best(0, 0) if n >= p else None
    return _stages(found[2], found[1]) if found is not None else None


def brute_force_stages(cost: CostModel, c: Candidate, cuts: Sequence[int], device: float, host: float,
                       transfer: Callable[[int], float], reduce: Callable[[int, int], float] = lambda lo, hi: 0.0
                       ) -> Stages | None:
    """:func:`search_stages` by trying every split and, in each stage, every assignment of its
    units' options (the reference in tests)."""
    n, best = len(cost.names()), None

    @functools.cache
    def fastest(lo: int, hi: int, s: int) -> StageCost | None:
        found = None
        for choices in itertools.product(*(cost.options(i, c) for i in range(lo, hi))):
            x = stage_cost(cost, c, lo, hi, s, choices, transfer, reduce)
            if x.device_bytes <= device and x.host_bytes <= host and (found is None or x.seconds < found.seconds):
                found = x
        return found

    for split in itertools.combinations(sorted(cuts), c.pp - 1):
        bounds = [0, *split, n]
        parts = [fastest(a, b, s) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        if all(x is not None for x in parts):
            found = _stages(split, parts)
            if best is None or found.seconds < best.seconds:
                best = found
    return best


def pipeline_failure(model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
    """Why ``model`` cannot run as pipeline stages (``None``: it can): every pipeline unit made a
    stage of its own (:func:`hetero.parallel.pipeline.stage_module`), run in order on fake
    tensors, must give the whole model's output shape - a forward that does not skip absent
    units, or takes more than the previous stage's output, fails here rather than in a run."""
    from torch._subclasses.fake_tensor import FakeTensorMode


    units = pipeline_units(model)
    if len(units) < 2:
        return f"{type(model).__name__} has {len(units)} pipeline unit(s)"
    if any(isinstance(m, nn.ModuleList) for m in model.children()):
        return f"{type(model).__name__} keeps layers in an nn.ModuleList (a stage would renumber them)"
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            inputs = pytree.tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, example_inputs)
            whole = model(*inputs)
            value = inputs
            for k, unit in enumerate(units):
                out = stage_module(model, units, [unit], first=k == 0)(*value)
                value = out if isinstance(out, tuple) else (out,)
            if not isinstance(whole, torch.Tensor) or len(value) != 1 or value[0].shape != whole.shape:
                return f"{type(model).__name__}'s stages do not compose into its output"
    except Exception as e:  # noqa: BLE001 - any failure of the forward is the answer
        return f"{type(model).__name__}'s forward fails as stages ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def split_points(units: Sequence[str], pipeline_units: Sequence[str], cuts: Sequence[int]) -> tuple[str, ...]:
    """The pipeline units where stages ``1..`` begin (the runtime's split points) for ``cuts``."""
    return tuple(next(p for p in pipeline_units if units[i] == p or units[i].startswith(p + ".")) for i in cuts)


def stage_decisions(names: Sequence[str], c: Candidate, stages: Stages) -> list[tuple[str, str, float, int]]:
    """Each stage's units and work, as ``(what, chosen, seconds, device bytes)`` rows of the
    plan's decisions (a stage's runner-ups are the other splits the search priced)."""
    bounds = [0, *stages.cuts, len(names)]
    out = []
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        recomputed = [names[i] for i in range(lo, hi) if stages.choices[i].recompute]
        hosted = [names[i] for i in range(lo, hi) if stages.choices[i].target is Target.HOST]
        what = f"{names[lo]} .. {names[hi - 1]}" + (f", recomputing {', '.join(recomputed)}" if recomputed else "") + \
            (f", on the host {', '.join(hosted)}" if hosted else "")
        out.append((f"stage {s}", what, stages.stage_seconds[s], stages.device_bytes))
    bubble = (c.pp - 1) / (c.micro_batches + c.pp - 1)
    out.append(("pipeline bubble", f"{bubble:.2f} of the step (1F1B, {c.micro_batches} micro-batches over {c.pp} stages)",
                stages.seconds * bubble, stages.device_bytes))
    return out
