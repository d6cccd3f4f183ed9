"""The dense optimizers a plan puts beside its parameters: torch's (AdamW, SGD) where the state
stays with them, :class:`~hetero.optim.HostAdamW` (all of the state on the host) or
:class:`~hetero.optim.partial_offload.PartialOffloadAdamW` (a ratio of it), built from one
:class:`OptimizerConfig` of hyperparameters. Used by :func:`hetero.planner.apply.apply`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hetero.optim import HostAdamW, HostOffloadConfig
from hetero.optim.partial_offload import PartialOffloadAdamW, PartialOffloadConfig
from hetero.optim.fused import fused_on_cuda
from hetero.planner.plan import Plan
from hetero.planner.space import ADAM_FAMILY, OptimizerKind, StateHome


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The dense optimizer's hyperparameters (its kind is the plan's).

    Attributes:
        lr: learning rate; ``weight_decay``: AdamW's decoupled decay (SGD: L2).
        betas, eps: AdamW's; ``momentum``: momentum SGD's.
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.9  # OptimizerKind.SGD_MOMENTUM's (plain SGD has none)


def optimizer_args(kind: OptimizerKind, c: OptimizerConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """torch's optimizer class of ``kind`` and its hyperparameters from ``c``."""
    if kind is OptimizerKind.ADAMW:
        return torch.optim.AdamW, {"lr": c.lr, "betas": c.betas, "eps": c.eps, "weight_decay": c.weight_decay}
    if kind is OptimizerKind.ADAM:
        return torch.optim.Adam, {"lr": c.lr, "betas": c.betas, "eps": c.eps, "weight_decay": c.weight_decay}
    momentum = c.momentum if kind is OptimizerKind.SGD_MOMENTUM else 0.0
    return torch.optim.SGD, {"lr": c.lr, "momentum": momentum, "weight_decay": c.weight_decay}


def torch_optimizer(params: list[nn.Parameter], kind: OptimizerKind, c: OptimizerConfig,
                    foreach: bool | None = None) -> torch.optim.Optimizer:
    """torch's optimizer of ``kind`` over ``params`` (``foreach``: torch's; ``None``: on CUDA the
    fused kernels (:func:`~hetero.optim.fused.fused_on_cuda`), else torch's default)."""
    cls, defaults = optimizer_args(kind, c)
    fused = fused_on_cuda(params) if foreach is None else {}
    return cls(params, **(fused or {"foreach": foreach}), **defaults)


def host_optimizer(params: Iterable[nn.Parameter], plan: Plan, c: OptimizerConfig) -> torch.optim.Optimizer:
    """torch's optimizer of the plan's kind over the host units' parameters (those that train),
    beside them on the host. ``params`` in the model's order: the optimizer's state and a
    replicas' all-reduce are laid out by it, alike on every rank (a set's order is not)."""
    return torch_optimizer([p for p in params if p.requires_grad], plan.optimizer, c)


def device_optimizer(named: list[tuple[str, nn.Parameter]], plan: Plan, c: OptimizerConfig,
                     foreach: bool = True, replicas: Any = None) -> Any:  # noqa: ANN401
    """The device parameters' optimizer as the plan keeps its state; ``replicas``: the process
    group an offloaded state averages gradients over (``None``: every rank; a pipeline's: its
    stage's ``dp`` ranks, not the other stages)."""
    state = plan.candidate.state
    if state is not StateHome.DEVICE and plan.optimizer is OptimizerKind.ADAM and c.weight_decay:
        raise ValueError(f"Adam's weight decay ({c.weight_decay}) is an L2 term in its gradient, which HostAdamW (AdamW's "
                         f"decoupled decay) does not run: keep the state on the device, or use AdamW")
    if state is StateHome.DEVICE or plan.optimizer not in ADAM_FAMILY:
        # (no foreach under tp: it takes one kind of tensor, and tp mixes DTensor shards and plain ones)
        return torch_optimizer([p for _, p in named], plan.optimizer, c, None if foreach else False)
    # the device keeps its weights in their own dtype: the update is AdamW's, exactly
    host = HostOffloadConfig(device_dtype=named[0][1].dtype, accumulate=plan.candidate.micro_batches)
    if state is StateHome.HOST:
        return HostAdamW(named, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, config=host,
                         process_group=replicas)
    return PartialOffloadAdamW(named, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay,
                               config=PartialOffloadConfig(plan.candidate.offload_ratio, host), process_group=replicas)
