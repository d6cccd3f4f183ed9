"""Device memory accounting: what a model and its optimizer hold on the device, counted from
the live tensors (each storage once), not computed from formulas."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hetero.optim.host_adam import HostAdamW
from hetero.optim.host_state import storage_bytes
from hetero.optim.partial_offload import PartialOffloadAdamW


def device_memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | PartialOffloadAdamW | None = None
                         ) -> dict[str, float]:
    """Bytes held on the device by ``model``'s parameters, their gradients and the optimizer's
    state, counted from the live tensors (each storage once), and their sum per parameter.

    "Device" is the parameters' own device: on a host-only machine that is the host, and host-side
    state (HostAdamW's masters and moments) counts there. For ``HostAdamW`` the gradients are the
    largest one alive at once (they stream away during backward); for other optimizers, the
    gradients present now and every state tensor on a parameter's device. DTensors (operator
    parallel) count this rank's shards.
    """
    params = list(model.parameters())
    n = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)  # this rank's share
    if isinstance(optimizer, PartialOffloadAdamW):  # the two parts, each counted as below
        parts = [optimizer.host.device_bytes()] if optimizer.host is not None else []
        host_params = {s.param for s in optimizer.host._slots.values()} if optimizer.host is not None else set()
        rest = [p for p in params if p not in host_params]
        if optimizer.device is not None:
            state = [t for p, st in optimizer.device.state.items() for t in st.values()
                     if isinstance(t, Tensor) and t.device == p.device]
            parts.append({"params": storage_bytes(rest), "grads": storage_bytes(p.grad for p in rest if p.grad is not None),
                          "optimizer_state": storage_bytes(state)})
        b = {k: sum(part[k] for part in parts) for k in ("params", "grads", "optimizer_state")}
    elif isinstance(optimizer, HostAdamW):
        b = optimizer.device_bytes()
    else:
        state = [t for p, st in (optimizer.state.items() if optimizer is not None else ())
                 for t in st.values() if isinstance(t, Tensor) and t.device == p.device]
        b = {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params if p.grad is not None),
             "optimizer_state": storage_bytes(state)}
    total = b["params"] + b["grads"] + b["optimizer_state"]
    return {**b, "total": total, "num_params": n, "bytes_per_param": total / max(n, 1)}


@dataclasses.dataclass(frozen=True)
class Allocations:
    """What a call allocated, in bytes above what was allocated when it started.

    Attributes:
        peak: the most held at any moment during the call (transient buffers included).
        net: still held when it returned (e.g. the activations a forward pass keeps for backward).
    """

    peak: int
    net: int


def measure_allocations(fn: Callable[[], object], device: torch.device | str = "cpu") -> Allocations:
    """Run ``fn()`` and measure its allocations from the allocator: CUDA's statistics on a CUDA
    device; on the CPU, the allocation and free events torch's profiler records
    (``profile_memory=True``), summed in time order (a block allocated before the call and freed
    during it is not seen: the net can only be over-counted by what the call frees of older data).

    Thread contract: counts this process's allocations (all threads) while ``fn`` runs.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return Allocations(torch.cuda.max_memory_allocated(device) - start, torch.cuda.memory_allocated(device) - start)
    import gc

    from torch.profiler import ProfilerActivity, profile

    # older garbage collected now, not by a cycle collection inside the call: its frees would
    # count against the call's own allocations (measured: a recompute policy's net halved)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return Allocations(peak, live)
