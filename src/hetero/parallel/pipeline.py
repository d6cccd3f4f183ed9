"""Pipeline parallelism: the model split into stages over the mesh's ``pp`` dimension, micro-batches
flowing through them point to point, on ``torch.distributed.pipelining``.

**Units and split points.** A model's pipeline units are its top-level children in registration
order, with the children of an ``nn.ModuleDict`` listed one by one (``"blocks.0"``, ...): the
layers of a stack. Stage ``k`` holds the units from split point ``k`` (a unit's qualified name,
where stage ``k`` begins) to the next; without split points the units are cut into stages of
about equal parameter bytes. A stage module is the model with every other unit removed: a
top-level child becomes ``None``, a ``ModuleDict`` entry is deleted. Parameter names do not
change, so a stage's ``state_dict`` is a part of the whole model's (checkpoints move between
pipeline degrees). The model's ``forward`` must skip what is absent - ``x if self.embed is None
else self.embed(x)``, ``for layer in self.layers.values()`` - as torchtitan's models do; a stack in
an ``nn.ModuleList`` is refused (deleting from it would renumber the layers).

**Schedules** (:class:`Schedule`): GPipe and 1F1B with one stage per rank; interleaved 1F1B and
interleaved zero bubble with ``stages_per_rank`` stages per rank, rank ``r`` holding stages ``r,
r + pp, ...`` (looped). Each micro-batch's loss is ``loss_fn(output, target)``, a mean over the
micro-batch; the schedules divide the gradients by the number of micro-batches, so with equal
micro-batches the gradients are the whole batch's, as without a pipeline.

**Optimizers.** Any ``torch.optim`` optimizer over :meth:`Pipeline.parameters`; a global
gradient norm must add the stages' sums over the ``pp`` group. :class:`~hetero.optim.HostAdamW`
takes ``HostOffloadConfig(accumulate=micro_batches)`` (the micro-batches' gradients summed on the
device, streamed once) and ``process_group=`` the ``dp`` group (its default, every rank, would
pair stages holding different parameters).

**Bubble accounting.** Each stage times its forward and backward work (``StageTimer``); a
rank's idle time is the pipeline's step time (the slowest rank's wall time: the step ends when
the last rank is done) less its busy time - waiting for a neighbour, the bubble
(:meth:`Pipeline.measured_bubble`).
:func:`predicted_bubble` is the schedule's idle fraction with stages of equal cost: ``(p - 1) /
(v m + p - 1)`` for ``p`` ranks, ``v`` stages per rank and ``m >= p`` micro-batches (GPipe and
1F1B: ``v = 1``; Narayanan et al. 2021); with ``m < p`` an interleaved pipeline never fills and
each rank idles ``v (p - m) + m - 1`` chunk times instead of ``p - 1``.

Reference: Huang et al. 2019 (GPipe); Narayanan et al. 2021 (1F1B, interleaved); Qi et al. 2024
(zero bubble); torch's ``torch.distributed.pipelining``; torchtitan's split by qualified name; the
reference design's pipeline parallel (stages on device groups, micro-batches).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from hetero.parallel.mesh import MeshDim, mesh_size, torch_device


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
    total, cuts, acc = sum(sizes), [], 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        k = len(cuts) + 1  # the next cut: after about k / stages of the bytes, leaving a unit per later stage
        if k < stages and (acc >= total * k / stages or len(units) - (i + 1) == stages - k):
            cuts.append(units[i + 1])
    return tuple(cuts)


def stage_module(model: nn.Module, units: list[str], keep: list[str]) -> nn.Module:
    """A copy of ``model`` holding only the units ``keep`` (the others removed, names unchanged)."""
    stage = copy.deepcopy(model)
    for unit in units:
        if unit in keep:
            continue
        parent, _, key = unit.rpartition(".")
        if parent:
            del stage.get_submodule(parent)[key]
        else:
            setattr(stage, key, None)
    return stage


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
    """

    schedule: Schedule
    micro_batches: int
    pp: int
    stages_per_rank: int
    stages: list[tuple[list[str], int]]
    predicted_bubble: float | None

    def __str__(self) -> str:
        bubble = "not modelled" if self.predicted_bubble is None else f"{self.predicted_bubble:.3f}"
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


@dataclasses.dataclass
class StepTime:
    """One rank's last pipeline step, in seconds: ``busy`` in its stages' forward and backward
    work, ``wall`` in all (busy + waiting for neighbours + sending). ``bubble`` is this rank's
    idle fraction of its own wall time; the pipeline's is :meth:`Pipeline.measured_bubble`."""

    busy: float = 0.0
    wall: float = 0.0

    @property
    def bubble(self) -> float:
        """The idle fraction of the step."""
        return 1.0 - self.busy / self.wall if self.wall else 0.0


@functools.cache
def _timed_stage_class():  # built lazily (importing torch.distributed.pipelining is slow), once
    from torch.distributed.pipelining import PipelineStage

    class StageTimer(PipelineStage):
        """A ``PipelineStage`` that adds the seconds of its forward and backward work to ``timer.busy``.

        Sync point on CUDA: each timed call waits for the device (the busy time is device time).
        """

        timer: StepTime

        def _timed(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timer.busy += time.perf_counter() - t0
            return out

        def forward_one_chunk(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            return self._timed(super().backward_one_chunk, *args, **kwargs)

        def backward_weight_one_chunk(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

    return StageTimer


@dataclasses.dataclass
class Pipeline:
    """This rank's part of a pipelined model (see :func:`pipeline`).

    Attributes:
        modules: this rank's stage modules (parameters named as in the whole model), as the
            other parallel dimensions left them (DTensor shards, FSDP2 units), unwrapped.
        stage_indices: their stage numbers.
        num_stages: stages in all.
    """

    modules: list[nn.Module]
    stage_indices: list[int]
    num_stages: int
    schedule: object
    micro_batches: int
    group: dist.ProcessGroup
    last_rank: int  # the pp group rank that holds the last stage
    time: StepTime = dataclasses.field(default_factory=StepTime)  # this rank's last step

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [item for m in self.modules for item in m.named_parameters()]

    def measured_bubble(self) -> float:
        """The idle fraction of the last step over the ``pp`` ranks: ``1 - mean busy / max wall``.
        Collective over the ``pp`` group (two all-reduces of one number)."""
        busy = torch.tensor([self.time.busy], dtype=torch.float64)
        wall = torch.tensor([self.time.wall], dtype=torch.float64)
        dist.all_reduce(busy, group=self.group)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=self.group)
        n = dist.get_world_size(self.group)
        return 1.0 - float(busy) / n / float(wall) if float(wall) else 0.0

    def step(self, inputs: Tensor, target: Tensor) -> float:
        """One forward and backward of the batch through the pipeline (gradients accumulate in
        the stage modules; the optimizer steps after). Every pp rank passes the same batch;
        returns the batch loss (the mean of the micro-batch losses) on every rank.

        Sync point: the loss goes from the last stage's rank to the others (a broadcast).

        Raises:
            ValueError: a batch the micro-batches do not divide.
        """
        if inputs.shape[0] % self.micro_batches:
            raise ValueError(f"{self.micro_batches} micro-batches do not divide the batch of {inputs.shape[0]}: choose a "
                             f"batch size that is a multiple of the micro-batches")
        losses: list[Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = dict(target=target, losses=losses) if self.has_last else {}
        self.time.busy = 0.0
        t0 = time.perf_counter()
        self.schedule.step(*args, **kwargs)
        self.time.wall = time.perf_counter() - t0
        loss = torch.stack(losses).mean().detach().float() if self.has_last else torch.zeros(())
        loss = loss.cpu().reshape(1)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return float(loss)


def pipeline(model: nn.Module, config: PipelineConfig, mesh: DeviceMesh, loss_fn: Callable[[Tensor, Tensor], Tensor],
             parallelize_stage: Callable[[nn.Module], nn.Module] | None = None) -> Pipeline:
    """Split ``model`` into ``pp x stages_per_rank`` stages and build this rank's part and the schedule.

    The split comes first of the parallel dimensions: ``parallelize_stage(stage_module)`` then
    applies the others to each of this rank's stages, in their order (operator sharding,
    recompute, ZeRO over ``dp``) and returns the module the stage runs - the module itself, or
    its ``DistributedDataParallel`` wrapper over the ``dp`` group (the schedule syncs DDP and
    FSDP2 gradients once per batch, after the last micro-batch). ``model`` itself is not changed
    (each stage is a copy holding its units). Collective over the ``pp`` group at the first
    :meth:`Pipeline.step` (the stages exchange shapes).

    Raises:
        ValueError: as :func:`split_points`.
    """
    from torch.distributed.pipelining import schedules

    pp = mesh_size(mesh, MeshDim.PP)
    group = mesh[MeshDim.PP.value].get_group()
    rank = mesh[MeshDim.PP.value].get_local_rank()
    plan = plan_pipeline(model, config, pp)
    num_stages = len(plan.stages)
    units = pipeline_units(model)
    indices = [rank + k * pp for k in range(config.stages_per_rank)]  # looped placement
    modules = [stage_module(model, units, plan.stages[i][0]) for i in indices]
    runs = [parallelize_stage(m) if parallelize_stage is not None else m for m in modules]
    device = torch_device(mesh)
    timer, stage_class = StepTime(), _timed_stage_class()
    stages = [stage_class(m, i, num_stages, device, group=group) for m, i in zip(runs, indices)]
    for stage in stages:
        stage.timer = timer
    kind = {Schedule.GPIPE: schedules.ScheduleGPipe, Schedule.ONE_F_ONE_B: schedules.Schedule1F1B,
            Schedule.INTERLEAVED_1F1B: schedules.ScheduleInterleaved1F1B,
            Schedule.INTERLEAVED_ZERO_BUBBLE: schedules.ScheduleInterleavedZeroBubble}[config.schedule]
    schedule = kind(stages if config.schedule.interleaved else stages[0], config.micro_batches, loss_fn=loss_fn)
    last_rank = (num_stages - 1) % pp
    return Pipeline(modules, indices, num_stages, schedule, config.micro_batches, group, last_rank, timer)
