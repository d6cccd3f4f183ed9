"""One training step, shared by :class:`hetero.train.Trainer` and :class:`hetero.planner.Applied`
(:func:`train_step`): every optimizer's ``zero_grad``, forward, loss and backward on each
micro-batch (DDP reducing once, in the last backward: torch's gradient-accumulation idiom), the
step's loss measured over the ranks and checked, then every optimizer's update
(:class:`~hetero.optim.container.OptimizersContainer`). The loss is the caller's: any function of
the model's output and the micro-batch's target (a model may train on several).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hetero.optim.container import OptimizersContainer


def train_step(model: nn.Module, parts: Iterable[tuple[tuple[Any, ...], Any]],
               loss_fn: Callable[[Any, Any], torch.Tensor], optimizers: OptimizersContainer, *,
               measure: Callable[[torch.Tensor], float] = lambda loss: float(loss.detach()),
               check: Callable[[float], None] | None = None,
               forward_backward: Callable[[], float] | None = None,
               between: Callable[[], None] | None = None,
               host_work: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
               inputs_to: Callable[[tuple[Any, ...]], tuple[Any, ...]] = lambda inputs: inputs) -> float:
    """One step; returns the sum of ``measure`` over the micro-batches' losses.

    Args:
        model: the runnable model (DDP-wrapped or not).
        parts: each micro-batch's ``(inputs, target)``; ``model(*inputs)`` is its output.
        loss_fn: ``loss_fn(output, target)``, the scalar each micro-batch backpropagates (scaled
            by the caller: a mean over the global batch, divided by the micro-batches).
        measure: a micro-batch's loss as the caller reports it (default its value here; a sync
            point: the host reads it; a data-parallel caller's mean over the ranks).
        check: called with the step's loss before any update; raises to apply nothing.
        forward_backward: runs instead of the micro-batches' loop (a pipeline's schedule) and
            returns the step's loss.
        between: with parameter servers, called between the pushes and the dense update.
        host_work: the context the host units' and tables' updates run in.
        inputs_to: a micro-batch's inputs where the model takes them, as its turn comes (one
            micro-batch on the device at a time).
    """
    optimizers.zero_grad()
    if forward_backward is not None:
        value = forward_backward()
    else:
        parts = list(parts)
        value = 0.0
        for i, (inputs, target) in enumerate(parts):
            quiet = model.no_sync() if isinstance(model, nn.parallel.DistributedDataParallel) and i < len(parts) - 1 \
                else contextlib.nullcontext()
            with quiet:
                loss = loss_fn(model(*inputs_to(inputs)), target)
                loss.backward()
            value += measure(loss)
    if check is not None:
        check(value)
    optimizers.step(between=between, host_work=host_work)
    return value
