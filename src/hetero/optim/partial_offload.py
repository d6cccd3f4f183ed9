"""Partial offload: a ratio of the parameters keep and update their AdamW state on the host
(:class:`HostAdamW`, streaming their gradients there during backward), the rest on the device
(``torch.optim.AdamW``), both updates running at the same time.

The host part takes the largest parameters first until ``ratio`` of all elements is reached
(large matrices amortise the transfers best); ratio 0 is device AdamW alone, ratio 1 is
HostAdamW alone, and every ratio computes the same update. With ``max_grad_norm`` the gradients
of both parts are clipped by one global norm (as ``torch.nn.utils.clip_grad_norm_`` over all
parameters): the host part waits for the device part's sum of squares, so its update no longer
overlaps backward, and the device update follows the host's. The ratio is a config value here and
a planner decision later. Reference: DeepSpeed's ZeRO-Offload++ "Twin-Flow" (a ratio of the
optimizer states offloaded, CPU and GPU updates overlapped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hetero.optim.host_adam import HostAdamW
from hetero.optim.host_state import HostOffloadConfig
from hetero.optim.fused import fused_on_cuda


@dataclasses.dataclass(frozen=True)
class PartialOffloadConfig:
    """How much of the optimizer lives on the host.

    Attributes:
        ratio: fraction of the parameter elements whose optimizer state lives and updates on
            the host, in [0, 1].
        host: the host part's :class:`HostOffloadConfig` (its ``device_dtype`` is the dtype of
            the host part's device weights; the device part keeps its parameters' dtype, so
            mixing bf16 and fp32 weights needs ``torch.autocast``). Its ``max_grad_norm`` is
            this config's.
        max_grad_norm: clip the global L2 norm of all gradients, both parts, to this (``None``:
            no clipping).
    """

    ratio: float = 0.5
    host: HostOffloadConfig = HostOffloadConfig()
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"offload ratio {self.ratio} is outside [0, 1]: give the fraction of the parameters whose "
                             f"optimizer state lives on the host (0: all on the device, 1: all on the host)")


def host_part(named: Iterable[tuple[str, Tensor]], ratio: float) -> list[str]:
    """The names of the parameters whose state :class:`PartialOffloadAdamW` keeps on the host at
    ``ratio``: the largest first (ties in the given order) while the elements taken stay nearest
    to ``ratio`` of all; in the given order. A data-parallel wrapper leaves these out (their
    gradients are the host part's to average)."""
    named = list(named)
    total = sum(p.numel() for _, p in named)
    chosen, taken = set(), 0
    for name, p in sorted(named, key=lambda item: -item[1].numel()):  # largest first, ties in model order
        if taken + p.numel() <= ratio * total + 0.5 * p.numel():  # nearest to the ratio
            chosen.add(name)
            taken += p.numel()
    return [n for n, _ in named if n in chosen]


class _HostPart(HostAdamW):
    """The host part: its global gradient norm also counts the device part's gradients."""

    device_sum_of_squares = 0.0  # in the host part's units (summed, loss-scaled), set before each step

    def _global_sum_of_squares(self, total: float, finite: bool) -> tuple[float, bool]:
        return total + self.device_sum_of_squares, finite


class PartialOffloadAdamW:
    """AdamW (Loshchilov & Hutter 2019) split between the host and the device by
    :class:`PartialOffloadConfig` (see the module docstring).

    Args:
        params: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``, the same for both parts.
        config: :class:`PartialOffloadConfig`.
        process_group: the data-parallel ranks the host part averages its gradients over (see
            :class:`HostAdamW`); the device part's gradients are the caller's to average (DDP,
            with the host part's parameters ignored).

    Attributes:
        host: the :class:`HostAdamW` of the host part (``None`` at ratio 0).
        device: the ``torch.optim.AdamW`` of the device part (``None`` at ratio 1).
        host_params: names of the parameters whose state is on the host.

    Thread contract: as :class:`HostAdamW`; ``step()`` runs the device update on the calling
    thread while the host worker finishes the host update, and returns when both are done.

    Raises:
        ValueError: a ratio outside [0, 1]; a loss scaler with a device part (the device
            AdamW would step on scaled gradients: use bf16, or ratio 1).
    """

    def replica_averaged_parameters(self) -> list[Tensor]:
        """The host part's parameters: its HostAdamW averages their gradients
        (:class:`~hetero.optim.host_state.AveragesReplicas`); the device part's are DDP's."""
        return self.host.replica_averaged_parameters()

    def __init__(self, params: Iterable[tuple[str, Tensor]], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, config: PartialOffloadConfig = PartialOffloadConfig(),
                 process_group: dist.ProcessGroup | None = None) -> None:
        named = list(params)
        if config.host.loss_scaler is not None and config.ratio < 1:
            raise ValueError(f"offload ratio {config.ratio} with a loss scaler: the device part would step on scaled "
                             f"gradients; train in bf16 (no loss scaling) or offload everything (ratio 1)")
        self.config = config
        self.host_params = host_part(named, config.ratio)
        chosen = set(self.host_params)
        host = [(n, p) for n, p in named if n in chosen]
        device = [p for name, p in named if name not in chosen]
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        host_config = dataclasses.replace(config.host, max_grad_norm=config.max_grad_norm)
        self.host = _HostPart([(n, p) for n, p in named if n in chosen], **hyper, config=host_config,
                              process_group=process_group) if host else None
        self.device = torch.optim.AdamW(device, **hyper, **fused_on_cuda(device)) if device else None

    @property
    def ratio(self) -> float:
        """The fraction of the parameter elements actually on the host (the nearest to the config's)."""
        on_host = sum(s.param.numel() for s in self.host._slots.values()) if self.host is not None else 0
        on_device = sum(p.numel() for g in self.device.param_groups for p in g["params"]) if self.device is not None else 0
        return on_host / max(on_host + on_device, 1)

    @property
    def loss_scale(self) -> float:
        return self.host.loss_scale if self.host is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in (self.device, self.host):
            if opt is not None:
                opt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        clip = self.config.max_grad_norm
        if clip is None:
            # The host worker has been updating buckets since their gradients arrived; the device
            # update runs meanwhile, then the host's step() joins its worker.
            if self.device is not None:
                self.device.step()
            if self.host is not None:
                self.host.step()
            return
        grads = [p.grad for g in self.device.param_groups for p in g["params"] if p.grad is not None] \
            if self.device is not None else []
        # sync point: the host needs the device part's sum of squares as a number
        device_sq = float(sum(g.float().pow(2).sum() for g in grads)) if grads else 0.0
        if self.host is None:
            norm = device_sq**0.5
        else:
            # the host part sums its gradients over its ranks (x world); the device part's are means
            self.host.device_sum_of_squares = device_sq * self.host._world ** 2
            self.host.step()  # clips its part by the global norm
            norm = self.host.last_grad_norm
        factor = min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
        if self.device is not None:
            for g in grads:
                g.mul_(factor)
            self.device.step()

    def state_dict(self) -> dict[str, Any]:
        return {"host": self.host.state_dict() if self.host is not None else None,
                "device": self.device.state_dict() if self.device is not None else None,
                "host_params": self.host_params}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved with the same split.

        Raises:
            ValueError: the checkpoint's host part holds other parameters (another ratio).
        """
        if state_dict["host_params"] != self.host_params:
            raise ValueError(f"the checkpoint keeps {len(state_dict['host_params'])} parameters' state on the host, this "
                             f"optimizer {len(self.host_params)}: load it with the offload ratio it was saved with")
        if self.host is not None:
            self.host.load_state_dict(state_dict["host"])
        if self.device is not None:
            self.device.load_state_dict(state_dict["device"])
