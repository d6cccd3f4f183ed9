"""Pipeline parallelism: the model split into stages over the mesh's ``pp`` dimension, micro-batches
flowing through them point to point, on ``torch.distributed.pipelining``; the split itself is
planned by :mod:`hetero.parallel.pipeline_plan`.

**Stages.** A stage module is the model with every other unit removed: a top-level child becomes
``None``, a ``ModuleDict`` entry is deleted; parameters and buffers registered on the model itself
(not in a unit) go with the first stage. Parameter names do not change, so a stage's
``state_dict`` is a part of the whole model's (checkpoints move between pipeline degrees). The
model's ``forward`` must skip what is absent - ``x if self.embed is None else self.embed(x)``,
``for layer in self.layers.values()`` - as torchtitan's models do.

**Schedules** (:class:`~hetero.parallel.pipeline_plan.Schedule`): GPipe and 1F1B with one stage
per rank (1F1B with fewer micro-batches than ranks is GPipe's order, and runs as such);
interleaved 1F1B and interleaved zero bubble with ``stages_per_rank`` stages per rank, rank ``r``
holding stages ``r, r + pp, ...`` (looped). Each micro-batch's loss is ``loss_fn(output,
target)``, a mean over the micro-batch; backward runs on it divided by the number of
micro-batches ``m``, so with equal micro-batches every gradient - ``p.grad``, and the sparse
gradients host tables send to the host, which no hook of the schedule could rescale - sums to
the whole batch's, as without a pipeline (torch's schedules with ``scale_grads=False``).

**Optimizers.** Any ``torch.optim`` optimizer over :meth:`Pipeline.parameters`; a global
gradient norm must add the stages' sums over the ``pp`` group. :class:`~hetero.optim.HostAdamW`
takes ``HostOffloadConfig(accumulate=micro_batches)`` (the micro-batches' gradients summed on the
device, streamed once), ``process_group=`` the ``dp`` group (its default, every rank, would
pair stages holding different parameters) and, to clip by the global norm, ``norm_group=`` the
``pp`` group. A stage holding host tables steps their sparse optimizers as usual.

**Bubble accounting.** Each stage times its forward and backward work (``StageTimer``); a
rank's idle time is the pipeline's step time (the slowest rank's wall time: the step ends when
the last rank is done) less its busy time - waiting for a neighbour, the bubble
(:attr:`Pipeline.bubble`, measured every step; ``hetero.explain(..., pipeline=the_pipeline)``
prints it beside :func:`~hetero.parallel.pipeline_plan.predicted_bubble`).

Reference: Huang et al. 2019 (GPipe); Narayanan et al. 2021 (1F1B, interleaved); Qi et al. 2024
(zero bubble); torch's ``torch.distributed.pipelining``; the reference design's pipeline
parallel (stages on device groups, micro-batches).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from hetero.parallel.mesh import MeshDim, mesh_size, torch_device
from hetero.parallel.tree_comm import broadcast_tree, recv_tree, send_tree
from hetero.parallel.pipeline_plan import PipelineConfig, PipelinePlan, Schedule, pipeline_units, plan_pipeline


def stage_module(model: nn.Module, units: list[str], keep: list[str], first: bool) -> nn.Module:
    """``model`` holding only the units ``keep`` (the others removed, names unchanged) and, if
    ``first``, the parameters and buffers registered on ``model`` itself.

    The stage is a new root (and new ``ModuleDict`` containers) around ``model``'s own units:
    nothing is copied - a stage holding host tables does not duplicate them - and what trains or
    is sharded in the stage is so in ``model``, which afterwards holds this rank's stages' state
    and the untrained rest.
    """
    own = [*model.parameters(recurse=False), *model.buffers(recurse=False)]
    shared = [model.get_submodule(u) for u in keep] + (own if first else [])
    removed = [model.get_submodule(u) for u in units if u not in keep] + ([] if first else own)
    # deepcopy's memo maps an object to its copy: what the stage keeps "copies" to itself, what it
    # drops to None (an absent submodule, parameter or buffer); only the root and the containers
    # are new objects
    memo = {id(x): x for x in shared} | {id(x): None for x in removed}
    stage = copy.deepcopy(model, memo)
    for unit in units:
        if unit in keep:
            continue
        parent, _, key = unit.rpartition(".")
        if parent:
            del stage.get_submodule(parent)[key]
        else:
            setattr(stage, key, None)
    return stage


@dataclasses.dataclass
class StepTime:
    """One rank's last pipeline step, in seconds: ``busy`` in its stages' forward and backward
    work, ``wall`` in all (busy + waiting for neighbours + sending). ``bubble`` is this rank's
    idle fraction of its own wall time; the pipeline's is :attr:`Pipeline.bubble`."""

    busy: float = 0.0
    wall: float = 0.0

    @property
    def bubble(self) -> float:
        """The idle fraction of the step."""
        return 1.0 - self.busy / self.wall if self.wall else 0.0


def _buffers(module: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """Each buffer of ``module`` with a copy of its value (for :func:`_restore`)."""
    return [(b, b.detach().clone()) for b in module.buffers()]


def _restore(saved: list[tuple[Tensor, Tensor]]) -> None:
    """The buffers back to their saved values, in place (optimizers and modules hold them)."""
    with torch.no_grad():
        for b, value in saved:
            b.copy_(value)


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """The CPU and CUDA RNG states as they were on entry, again on exit."""
    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@functools.cache
def _timed_stage_class():  # built lazily (importing torch.distributed.pipelining is slow), once
    from torch.distributed.pipelining import PipelineStage

    class StageTimer(PipelineStage):
        """A ``PipelineStage`` that adds the seconds of its forward and backward work to ``timer.busy``.

        Sync point on CUDA: each timed call waits for the device (the busy time is device time).
        """

        timer: StepTime
        _inference_buffers: list = []  # (buffer, its value before shape inference): restored after it

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

        def _forward_metadata_inference(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            # torch infers the stages' shapes at the first step by running each stage's forward
            # (and backward) once more - on the first micro-batch (stage 0) or on uninitialised
            # tensors of the received shapes (later stages). That pass must leave no trace:
            # BatchNorm's running statistics took garbage (NaN) from it, and dropout drew from
            # the RNG. The buffers are restored after the backward inference (which needs them
            # as the forward left them), in place (optimizers hold them); the RNG at once.
            self._inference_buffers = _buffers(self.submod)
            with _rng_kept():
                return super()._forward_metadata_inference(*args, **kwargs)

        def _shape_inference(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            # older torch (2.11: no _forward_metadata_inference) infers the shapes here, by a
            # forward alone: the same pass, the same restore (buffers and RNG) at once after it
            saved = _buffers(self.submod)
            try:
                with _rng_kept():
                    return super()._shape_inference(*args, **kwargs)
            finally:
                _restore(saved)

        def _post_metadata_inference_cleanup(self) -> None:
            super()._post_metadata_inference_cleanup()
            _restore(self._inference_buffers)
            self._inference_buffers = []

    return StageTimer


@dataclasses.dataclass
class Pipeline:
    """This rank's part of a pipelined model (see :func:`pipeline`).

    Attributes:
        modules: this rank's stage modules (parameters named as in the whole model), as the
            other parallel dimensions left them (DTensor shards, FSDP2 units), unwrapped.
        stage_indices: their stage numbers.
        num_stages: stages in all.
        schedule: torch's schedule object that runs a step.
        micro_batches: per batch.
        group: the ``pp`` process group.
        last_rank: the ``pp`` group rank holding the last stage.
        device: where the stages run.
        plan: the split (:func:`plan_pipeline`).
        time: this rank's last step.
        bubble: the idle fraction of the last step over the ``pp`` ranks, ``1 - mean busy / max
            wall`` (the same on every rank); ``None`` before the first step.
    """

    modules: list[nn.Module]
    stage_indices: list[int]
    num_stages: int
    schedule: object
    micro_batches: int
    group: dist.ProcessGroup
    last_rank: int
    device: torch.device
    plan: PipelinePlan
    time: StepTime = dataclasses.field(default_factory=StepTime)
    bubble: float | None = None

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

    def step(self, inputs: Tensor | tuple[Tensor, ...], target: Tensor, **kwargs: object) -> float:
        """One forward and backward of the batch through the pipeline (gradients accumulate in
        the stage modules; the optimizer steps after). Every pp rank passes the same batch:
        ``inputs`` the first stage's positional argument (a tuple: its arguments), ``kwargs`` its
        keyword arguments (tensors, or mappings of tensors such as a batch's features: torch
        takes only tensors positionally), ``target`` ``(B, ...)``; all are cut into micro-batches
        along dim 0. Returns the batch loss (the mean of the micro-batch losses) on every rank,
        and measures :attr:`bubble`.

        Sync point: one all-gather of three numbers per rank over the ``pp`` group (the loss
        from the last stage, every rank's busy and wall time).

        Raises:
            ValueError: a batch the micro-batches do not divide.
        """
        if target.shape[0] % self.micro_batches:
            raise ValueError(f"{self.micro_batches} micro-batches do not divide the batch of {target.shape[0]}: choose a "
                             f"batch size that is a multiple of the micro-batches")
        losses: list[Tensor] = []
        # contiguous: a stage checks each micro-batch's strides against the first one's (torch 2.11
        # refuses a slice such as tokens[:, :-1] whose chunks keep the parent's row stride)
        args = tuple(a.contiguous() if isinstance(a, Tensor) else a
                     for a in (inputs if isinstance(inputs, tuple) else (inputs,))) if self.has_first else ()
        kwargs = {**(kwargs if self.has_first else {}), **(dict(target=target, losses=losses) if self.has_last else {})}
        self.time.busy = 0.0
        t0 = time.perf_counter()
        self.schedule.step(*args, **kwargs)
        self.time.wall = time.perf_counter() - t0
        # each loss was divided by the micro-batches (see the module docstring): their sum is the mean
        loss = float(torch.stack(losses).detach().sum()) if self.has_last else 0.0  # sync point on CUDA
        # on the stages' device: NCCL gathers device tensors (host -> device, and back: a sync point)
        mine = torch.tensor([loss, self.time.busy, self.time.wall], dtype=torch.float64, device=self.device)
        every = torch.empty(dist.get_world_size(self.group) * 3, dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        every = every.view(-1, 3).cpu()  # rank-major
        wall = float(every[:, 2].max())
        self.bubble = 1.0 - float(every[:, 1].mean()) / wall if wall else 0.0
        return float(every[self.last_rank, 0])

    @torch.no_grad()
    def forward(self, *args: object) -> Tensor:
        """The whole model's output on ``args`` (one micro-batch, no backward: evaluation), on
        every ``pp`` rank. Every rank passes the same ``args``; the stages run in order.

        Sync points: each stage's output goes to the next stage's rank, the last stage's to
        every rank (tensors as tensors over the ``pp`` group: :mod:`hetero.parallel.tree_comm`; returned
        on the host).
        """
        pp, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        value: object = args
        for s in range(self.num_stages):
            owner = s % pp
            if s in self.stage_indices:
                out = self.modules[self.stage_indices.index(s)](*value)
                value = out if isinstance(out, tuple) else (out,)
            nxt = (s + 1) % pp if s + 1 < self.num_stages else None
            if nxt is None or nxt == owner:
                continue
            if me == owner:
                send_tree(tuple(value), nxt, self.group)
            elif me == nxt:
                value = tuple(v.to(self.device) for v in recv_tree(owner, self.group))  # host -> device
        return broadcast_tree(value[0] if me == self.last_rank else None, self.last_rank, self.group)


def pipeline(model: nn.Module, config: PipelineConfig, mesh: DeviceMesh, loss_fn: Callable[[Tensor, Tensor], Tensor],
             parallelize_stage: Callable[[nn.Module], nn.Module] | None = None) -> Pipeline:
    """Split ``model`` into ``pp x stages_per_rank`` stages and build this rank's part and the schedule.

    The split comes first of the parallel dimensions: ``parallelize_stage(stage_module)`` then
    applies the others to each of this rank's stages, in their order (operator sharding,
    recompute, ZeRO over ``dp``) and returns the module the stage runs - the module itself, or
    its ``DistributedDataParallel`` wrapper over the ``dp`` group (the schedule syncs DDP and
    FSDP2 gradients once per batch, after the last micro-batch). The stages share ``model``'s
    units (:func:`stage_module`): use the stages, not ``model``, afterwards. Collective over the
    ``pp`` group at the first :meth:`Pipeline.step` (the stages exchange shapes).

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
    modules = [stage_module(model, units, plan.stages[i][0], first=i == 0) for i in indices]
    runs = [parallelize_stage(m) if parallelize_stage is not None else m for m in modules]
    device = torch_device(mesh)
    timer, stage_class = StepTime(), _timed_stage_class()
    stages = [stage_class(m, i, num_stages, device, group=group) for m, i in zip(runs, indices)]
    for stage in stages:
        stage.timer = timer
    # 1F1B with fewer micro-batches than stages has no steady phase: each stage runs its forwards,
    # then its backwards - GPipe's order, which torch runs (its 1F1B class refuses m < pp)
    one_f_one_b = schedules.Schedule1F1B if config.micro_batches >= pp else schedules.ScheduleGPipe
    kind = {Schedule.GPIPE: schedules.ScheduleGPipe, Schedule.ONE_F_ONE_B: one_f_one_b,
            Schedule.INTERLEAVED_1F1B: schedules.ScheduleInterleaved1F1B,
            Schedule.INTERLEAVED_ZERO_BUBBLE: schedules.ScheduleInterleavedZeroBubble}[config.schedule]
    m = config.micro_batches

    def micro_batch_loss(output: Tensor, target: Tensor) -> Tensor:
        return loss_fn(output, target) / m  # the sum over micro-batches is the batch mean (module docstring)

    schedule = kind(stages if config.schedule.interleaved else stages[0], m, loss_fn=micro_batch_loss,
                    scale_grads=False)
    last_rank = (num_stages - 1) % pp
    return Pipeline(modules, indices, num_stages, schedule, m, group, last_rank, device, plan, timer)
