"""Pipeline plans: how a model splits into stages over the mesh's ``pp`` ranks, and the
schedules' predicted bubble - without process groups (:func:`hetero.explain` prints them; the
runtime is :mod:`hetero.parallel.pipeline`).

**Units and split points.** A model's pipeline units are its top-level children in registration
order, with the children of an ``nn.ModuleDict`` listed one by one (``"blocks.0"``, ...): the
layers of a stack. Stage ``k`` holds the units from split point ``k`` (a unit's qualified name,
where stage ``k`` begins) to the next; without split points the units are cut into stages of
about equal parameter bytes. A stack in an ``nn.ModuleList`` is refused (a stage deletes the
layers it does not hold, which would renumber a list's).

**Predicted bubble.** :func:`predicted_bubble` is the schedule's idle fraction with stages of
equal cost: ``(p - 1) / (v m + p - 1)`` for ``p`` ranks, ``v`` stages per rank and ``m >= p``
micro-batches (GPipe and 1F1B: ``v = 1``; Narayanan et al. 2021); with ``m < p`` an interleaved
pipeline never fills and each rank idles ``v (p - m) + m - 1`` chunk times instead of ``p - 1``.

Reference: Huang et al. 2019 (GPipe); Narayanan et al. 2021 (1F1B, interleaved); Qi et al. 2024
(zero bubble); torchtitan's split by qualified name.
"""

from __future__ import annotations

import dataclasses
import enum

from torch import nn


class Schedule(enum.Enum):
    """A pipeline schedule (torch's class of the same algorithm runs it)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"

    @property
    def interleaved(self) -> bool:
        """Whether a rank holds several stages (``PipelineConfig.stages_per_rank``)."""
        return self in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZERO_BUBBLE)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How a model is pipelined over the mesh's ``pp`` ranks.

    Attributes:
        schedule: the :class:`Schedule` (or its value, e.g. ``"1f1b"``).
        micro_batches: micro-batches per batch (>= 1; must divide the batch size).
        stages_per_rank: stages each rank holds: 1 for GPipe and 1F1B, >= 2 for the interleaved
            schedules.
        split_points: qualified names of the units where stages 1, 2, ... begin (one fewer than
            the stages); empty: stages of about equal parameter bytes.
    """

    schedule: Schedule = Schedule.ONE_F_ONE_B
    micro_batches: int = 1
    stages_per_rank: int = 1
    split_points: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, Schedule):
            valid = [s.value for s in Schedule]
            if self.schedule not in valid:
                raise ValueError(f"pipeline schedule {self.schedule!r} does not exist; valid schedules are {valid}")
            object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches}: a batch needs at least 1 micro-batch")
        if self.schedule.interleaved != (self.stages_per_rank >= 2) or self.stages_per_rank < 1:
            need = ">= 2" if self.schedule.interleaved else "1"
            raise ValueError(f"stages_per_rank={self.stages_per_rank} with schedule {self.schedule.value}: that schedule "
                             f"takes stages_per_rank {need}")
        object.__setattr__(self, "split_points", tuple(self.split_points))


def pipeline_units(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s pipeline units, in order (see the module docstring)."""
    units = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleDict):
            units += [f"{name}.{key}" for key in child]
        else:
            units.append(name)
    return units


def split_points(model: nn.Module, stages: int, given: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The units where stages ``1..stages-1`` begin: ``given`` checked, or a balanced cut.

    Raises:
        ValueError: a name that is not a unit, points out of order, or the wrong count (naming
            the units); more stages than units; a stack in an ``nn.ModuleList``.
    """
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            raise ValueError(f"{type(model).__name__}.{name} is an nn.ModuleList: make it an nn.ModuleDict (keys '0', "
                             f"'1', ...) iterated with .values(), so a pipeline stage keeps its layers' names")
    units = pipeline_units(model)
    if stages > len(units):
        raise ValueError(f"{stages} pipeline stages for {len(units)} units ({units}): use at most {len(units)} stages")
    if given:
        if len(given) != stages - 1:
            raise ValueError(f"{len(given)} split points for {stages} stages: give {stages - 1}, the units where "
                             f"stages 1..{stages - 1} begin")
        for name in given:
            if name not in units:
                raise ValueError(f"pipeline split point {name!r} is not a unit of {type(model).__name__}; its units are "
                                 f"{units}")
        index = [units.index(n) for n in given]
        if index != sorted(set(index)) or index[0] == 0:
            raise ValueError(f"pipeline split points {list(given)} must be distinct units after the first, in model "
                             f"order: {units}")
        return tuple(given)
    sizes = [sum(p.numel() * p.element_size() for p in model.get_submodule(u).parameters()) for u in units]
    return tuple(units[i] for i in balanced_cuts(sizes, stages))


def balanced_cuts(sizes: list[int], stages: int) -> list[int]:
    """Where stages ``1..stages-1`` begin among items of ``sizes`` (indices, increasing): stage
    ``k`` starts once about ``k / stages`` of the total is before it, leaving at least one item
    to every later stage (``stages <= len(sizes)``)."""
    total, cuts, acc = sum(sizes), [], 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        k = len(cuts) + 1
        if k < stages and (acc >= total * k / stages or len(sizes) - (i + 1) == stages - k):
            cuts.append(i + 1)
    return cuts


def predicted_bubble(schedule: Schedule, pp: int, micro_batches: int, stages_per_rank: int = 1) -> float | None:
    """The idle fraction of a step with stages of equal cost (see the module docstring);
    ``None`` for zero bubble, whose split of weight gradients the formula does not model."""
    if schedule is Schedule.INTERLEAVED_ZERO_BUBBLE:
        return None
    v, m = stages_per_rank, micro_batches
    idle = pp - 1 if m >= pp else v * (pp - m) + m - 1  # in chunk times (a stage's forward + backward)
    return idle / (v * m + idle)


@dataclasses.dataclass
class PipelinePlan:
    """A pipeline split planned without process groups (``hetero.explain``'s pipeline section).

    Attributes:
        schedule, micro_batches, pp, stages_per_rank: as configured.
        stages: per stage, its units and their parameter bytes.
        predicted_bubble: :func:`predicted_bubble` (``None`` where not modelled).
        measured_bubble: a running pipeline's last step (:attr:`Pipeline.bubble`); ``None`` in
            a plan.
    """

    schedule: Schedule
    micro_batches: int
    pp: int
    stages_per_rank: int
    stages: list[tuple[list[str], int]]
    predicted_bubble: float | None
    measured_bubble: float | None = None

    def __str__(self) -> str:
        bubble = "not modelled" if self.predicted_bubble is None else f"{self.predicted_bubble:.3f}"
        if self.measured_bubble is not None:
            bubble += f", measured {self.measured_bubble:.3f} (last step)"
        lines = [f"pipeline: {len(self.stages)} stages on {self.pp} ranks, {self.schedule.value}, "
                 f"{self.micro_batches} micro-batches, predicted bubble {bubble}"]
        for i, (units, nbytes) in enumerate(self.stages):
            lines.append(f"  stage {i} (rank {i % self.pp}): {', '.join(units)}; parameters {nbytes} B")
        return "\n".join(lines)


def plan_pipeline(model: nn.Module, config: PipelineConfig, pp: int) -> PipelinePlan:
    """How :func:`pipeline` would split ``model`` over ``pp`` ranks. Raises as :func:`split_points`."""
    stages = pp * config.stages_per_rank
    units = pipeline_units(model)
    cuts = split_points(model, stages, config.split_points)
    bounds = [0, *(units.index(c) for c in cuts), len(units)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        nbytes = sum(p.numel() * p.element_size() for u in units[lo:hi] for p in model.get_submodule(u).parameters())
        parts.append((units[lo:hi], nbytes))
    return PipelinePlan(config.schedule, config.micro_batches, pp, config.stages_per_rank, parts,
                        predicted_bubble(config.schedule, pp, config.micro_batches, config.stages_per_rank))
