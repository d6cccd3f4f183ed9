"""What :func:`hetero.planner.apply.apply` returns: :class:`Applied`, a model as a plan runs it,
whose :meth:`~Applied.step` is one training step - the batch cut into each data-parallel rank's
share and the plan's micro-batches (:func:`split_batch`), forward and backward on each (or a
pipeline's schedule), every optimizer's update.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hetero.optim.container import OptimizersContainer
from hetero.parallel.step import train_step
from hetero.placement import copy_to
from hetero.planner.plan import Plan

if TYPE_CHECKING:
    from hetero.parallel.pipeline import Pipeline


@dataclasses.dataclass
class Applied:
    """A model as a plan runs it.

    Attributes:
        model: the runnable model (partitioned when some unit is on the host).
        optimizers: every optimizer (:class:`~hetero.optim.container.OptimizersContainer`): the
            dense one of the device units' parameters (torch's, HostAdamW or PartialOffloadAdamW,
            as the plan says; ``None``: every unit is on the host), the device tables' (torch's
            sparse optimizers), the host units' dense one and the host tables' sparse ones.
        pipeline: with a ``pp > 1`` plan, this rank's stage and the schedule (``model`` is
            the stage: the model without the other stages' units, names unchanged).
        data_parallel: with a ``dp > 1`` plan, this rank's place in the data-parallel group and
            its size (:meth:`step` runs the rank's share of the batch).
        micro_batches: passes per step (:meth:`step` splits the batch into them).
        plan: the plan.
        host_tensors: the parameters and buffers that live on the host (host units', tables').
        host_work: the context :meth:`step` runs the host optimizers' updates in (a meter
            attributes the work; default: none).
    """

    model: nn.Module
    optimizers: OptimizersContainer
    micro_batches: int
    plan: Plan
    host_tensors: set[torch.Tensor]
    host_work: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    pipeline: Pipeline | None = None
    data_parallel: tuple[int, int] = (0, 1)
    dp_group: Any = None  # a ProcessGroup: the data-parallel ranks (None: every rank)

    def step(self, inputs: tuple[Any, ...], target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> float:  # noqa: ANN401
        """One training step: the batch ``inputs`` (and ``target``) cut into the plan's
        micro-batches along the first dimension of every tensor, forward and backward on each
        (the loss divided by the micro-batches: the gradients sum to the whole batch's mean),
        then every optimizer's update. Returns the batch's mean loss (a host sync point).

        Raises:
            ValueError: a tensor of another first dimension than the batch's (bags cannot be
                cut by rows) with more than one micro-batch, or a batch the micro-batches or the
                data-parallel ranks do not divide (unequal parts would weigh samples unequally).
        """
        m = self.micro_batches
        rank, dp = self.data_parallel
        if dp > 1:  # every rank passes the global batch: this rank's share of it
            inputs, target = split_batch(inputs, dp)[rank], split_batch(target, dp)[rank]
        device = _one_device(self.model)  # a model wholly on the device takes its batch there

        def loss_of(out: Any, part_target: Any) -> torch.Tensor:  # noqa: ANN401
            # (divided by the micro-batches: the gradients sum to the whole batch's mean)
            return loss_fn(out, _moved(part_target, out.device if isinstance(out, torch.Tensor) else device)) / m

        # the schedule runs a pipeline's micro-batches (its loss: apply's loss_fn; sync point: over the pp group)
        pipelined = (lambda: self.pipeline.step(inputs, target)) if self.pipeline is not None else None
        parts = [] if pipelined else list(zip(split_batch(inputs, m), split_batch(target, m)))
        total = train_step(self.model, parts, loss_of, self.optimizers, forward_backward=pipelined,
                           host_work=self.host_work, inputs_to=lambda part: _moved(part, device))
        return self._mean(total, dp)

    def _mean(self, loss: float, dp: int) -> float:
        """The batch's mean loss from this rank's share (sync point: over the dp ranks)."""
        if dp == 1:
            return loss
        import torch.distributed as dist

        mean = torch.tensor([loss / dp], dtype=torch.float64)
        dist.all_reduce(mean, group=self.dp_group)
        return float(mean)


def split_batch(tree: Any, parts: int) -> list[Any]:  # noqa: ANN401 - a pytree of batch tensors
    """``tree`` cut into ``parts`` along the first dimension of every tensor."""
    if parts == 1:
        return [tree]
    leaves, spec = pytree.tree_flatten(tree)
    batch = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor)), None)
    pieces = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            if t.shape[0] != batch:
                raise ValueError(f"a tensor of {t.shape[0]} rows in a batch of {batch}: micro-batches cut every tensor "
                                 f"by rows (bags cannot be cut so); plan with micro_batches=(1,)")
            if batch % parts:  # unequal parts would weigh their samples unequally in the mean gradient
                raise ValueError(f"a batch of {batch} rows does not split into {parts} equal parts (the plan's "
                                 f"micro-batches or its data-parallel ranks): use a batch size that is a multiple of {parts}")
            pieces.append(torch.tensor_split(t, parts))
        else:
            pieces.append([t] * parts)
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(parts)]


def _one_device(model: nn.Module) -> torch.device | None:
    """The device every parameter and buffer of ``model`` is on; ``None`` where they are on
    several (a partitioned model moves each subgraph's inputs itself)."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    return devices.pop() if len(devices) == 1 else None


def _moved(tree: Any, device: torch.device | None) -> Any:  # noqa: ANN401 - a batch's tensors, any nesting
    """``tree``'s tensors copied to ``device`` (host -> device, async on CUDA; none where they are there)."""
    if device is None:
        return tree
    return pytree.tree_map_only(torch.Tensor, lambda t: copy_to(t, device), tree)
