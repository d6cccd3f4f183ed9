"""Targets, storage tiers and the resolver that maps a target to a concrete ``torch.device``.

Reference semantics: MindSpore's ``Primitive.set_device("CPU")`` / ``EmbeddingLookup(target="CPU")``
(host) versus the accelerator (device). hetero uses PyTorch's words: *host* is the CPU and its DRAM,
*device* is the accelerator (CUDA or any ``torch.accelerator``), and on a host-only machine the
device part runs on the CPU, which :func:`resolve_device` says in one log line.
"""

from __future__ import annotations

import enum
import logging

import torch
from torch._subclasses import FakeTensor

log = logging.getLogger("hetero")


class Target(enum.Enum):
    """Where an op runs or a parameter lives."""

    HOST = "host"
    DEVICE = "device"

    @classmethod
    def parse(cls, value: "Target | str") -> "Target":
        """Parse ``"host"``/``"device"`` (case-insensitive; ``"cpu"`` is accepted for host).

        Raises:
            ValueError: ``value`` names no target; the message lists the valid choices.
        """
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower()
        if key == "cpu":  # MindSpore spelling of the host target
            return cls.HOST
        for member in cls:
            if member.value == key:
                return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown placement target {value!r}; valid targets are {choices}")


class StorageTier(enum.Enum):
    """Memory tier that holds a tensor."""

    HOST_DRAM = "host_dram"  # pageable host memory: where embedding tables and their states live
    HOST_PINNED = "host_pinned"  # page-locked host memory: staging buffers for async copies
    DEVICE_MEMORY = "device_memory"  # accelerator memory (HBM)
    SSD = "ssd"  # a local disk under a DRAM row cache (hetero.storage): tables larger than host memory


_announced: set[str] = set()


def _accelerator() -> torch.device | None:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6: generic accelerator API
    if acc is not None and acc.is_available():
        return torch.device(acc.current_accelerator())
    return None


def resolve_device(target: Target | str = Target.DEVICE) -> torch.device:
    """Map a target to the ``torch.device`` it runs on on this machine.

    ``HOST`` is always ``cpu``. ``DEVICE`` is the current CUDA device (or other ``torch.accelerator``)
    when one is present, otherwise ``cpu``; the first resolution logs which one was chosen, so a
    host-only run says that its device part runs on the CPU.

    Raises:
        ValueError: ``target`` is not a valid target.
    """
    target = Target.parse(target)
    if target is Target.HOST:
        return torch.device("cpu")
    device = _accelerator()
    if device is None:
        if "cpu" not in _announced:
            _announced.add("cpu")
            log.info("hetero: no accelerator found; the device part runs on the CPU")
        return torch.device("cpu")
    if str(device) not in _announced:
        _announced.add(str(device))
        log.info("hetero: device part runs on %s", device)
    return device


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without blocking the host where that is possible.

    On CUDA the source is staged in pinned memory so the host-to-device copy is a real async DMA
    (``non_blocking``); the copy is ordered on the current stream, so kernels queued after it see
    the data without a host sync. On a CPU device this returns ``tensor`` itself (no copy).
    """
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned() and \
            not isinstance(tensor, FakeTensor):  # (the planner's capture traces with fake tensors: no memory)
        tensor = tensor.pin_memory()  # copy 1: pageable -> pinned (cannot be avoided for pageable input)
    return tensor.to(device, non_blocking=True)  # copy 2: host -> device, async on CUDA
