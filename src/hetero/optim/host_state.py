"""The host side of HostAdamW: its configuration, the per-parameter slot of host buffers, the
helpers that allocate and read them (pinned or huge-page memory, numpy views for the fused
kernels, the optimizer's own gloo group), and what the plain and the sharded optimizer do alike
slot by slot (a bucket's arrival agreement and fused all-reduce, the state dict, the device bytes)."""

from __future__ import annotations

import dataclasses
import typing
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from hetero._numba import load, num_threads
from hetero.optim.loss_scale import DynamicLossScaler
from hetero.placement import host_empty

f32 = np.float32


@dataclasses.dataclass(frozen=True)
class HostOffloadConfig:
    """How ``HostAdam``/``HostAdamW`` keep and move state.

    Attributes:
        device_dtype: dtype of the weights on the device (``torch.bfloat16``, ``torch.float16``
            or ``torch.float32``).
        bucket_bytes: fp32 bytes of parameters per bucket (a bucket's update starts once all of its
            gradients have arrived; it is one all-reduce, or one reduce-scatter and one all-gather
            when sharded); a bucket closes once it reaches this size, in backward order.
        bucket_starts: parameter indices (registration order, strictly increasing) where a new
            bucket starts, instead of ``bucket_bytes`` (``hetero.parallel.comm_fusion``'s index
            list); empty: by ``bucket_bytes``.
        max_grad_norm: clip the global L2 norm of the gradients to this (``None``: no clipping).
        loss_scaler: dynamic loss scaling (needed for fp16); the loss must be multiplied by
            ``optimizer.loss_scale`` before backward.
        overlap: run bucket updates during backward (else all in ``step()``).
        accumulate: backward passes per step (micro-batches, e.g. a pipeline's): a parameter's
            gradient stays on the device, summed by autograd, until its last pass, then streams;
            the update uses their sum, as ``p.grad`` holds it for torch's optimizers (scale each
            pass's loss by ``1 / accumulate`` for the whole batch's mean, as a pipeline does).
    """

    device_dtype: torch.dtype = torch.bfloat16
    bucket_bytes: int = 32 << 20
    bucket_starts: tuple[int, ...] = ()
    max_grad_norm: float | None = None
    loss_scaler: DynamicLossScaler | None = None
    overlap: bool = True
    accumulate: int = 1

    def __post_init__(self) -> None:
        if self.accumulate < 1:
            raise ValueError(f"HostOffloadConfig.accumulate={self.accumulate}: a step takes at least 1 backward pass")


@dataclasses.dataclass
class _Slot:
    name: str
    param: Tensor  # on the device, in device_dtype
    group: dict
    master: Tensor  # host fp32, flat
    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad: Tensor  # host, flat: the streamed gradient (bf16 with bf16 device weights, else fp32),
    # then the new device weight when its dtype is the device dtype
    staging: Tensor | None  # fp16 device weights on CUDA: the host fp16 copy for the upload
    bucket: int = 0
    step: int = 0
    arrived: bool = False  # a gradient waits for the update (cleared by the update)
    seen: bool = False  # a gradient came in this step (cleared by step() and zero_grad())
    accumulated: int = 0  # backward passes summed into the device gradient, not streamed yet
    copied: Any = None  # CUDA event of the device->host gradient copy
    uploaded: Any = None  # CUDA event of the last host->device upload (it reads ``grad`` or ``staging``)
    shard: Tensor | None = None  # ShardedHostAdamW: this rank's reduced gradient elements, then its new weights


def host_all_reduce_group(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int]:
    """A gloo group over ``group``'s ranks for the host all-reduces, and its size (``None``, 1
    without a process group of more than one rank). A group of its own: the worker thread's
    collectives must not interleave with the training thread's (DDP, loss averaging) on a
    shared group. Collective: every rank of ``group`` calls it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if len(ranks) == 1:
        return None, 1
    # local synchronisation: only the group's ranks call this (torch's default would have every rank
    # of the job create every group in one order, and a pipeline's stages build different groups)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True), len(ranks)


def _sum_over(group: dist.ProcessGroup | None, total: float, finite: bool) -> tuple[float, bool]:
    """``total`` summed and ``finite`` and-ed over the ranks of the (gloo) ``group``; as they
    are without one. Collective."""
    if group is None:
        return total, finite
    both = torch.tensor([total, 0.0 if finite else 1.0], dtype=torch.float64)
    dist.all_reduce(both, group=group)
    return both[0].item(), both[1].item() == 0


def _host_buffer(n: int, dtype: torch.dtype, pin: bool) -> Tensor:
    """A flat host buffer: pinned on CUDA machines (async copies to and from the device), else
    huge-page backed (the update streams five arrays; with 4 KiB pages the hardware prefetcher
    stops at every page boundary)."""
    return torch.empty(n, dtype=dtype, pin_memory=True) if pin else host_empty((n,), dtype)


def _np(t: Tensor) -> np.ndarray:
    """A numpy view for the kernels: bf16 as its uint16 bits (numpy has no bf16)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _chunks(n: int) -> int:
    return max(1, min(num_threads() * 4, n // 65536 or 1))


def _kernels():
    return load("hetero.optim._adam_kernels")


def _buckets(slots: list[_Slot], config: HostOffloadConfig) -> list[list[_Slot]]:
    """The slots (registration order) grouped into buckets, in backward order: backward produces
    the last layers' gradients first. Raises ``ValueError`` for a ``bucket_starts`` index past
    the parameters."""
    n = len(slots)
    if config.bucket_starts:
        if config.bucket_starts[-1] >= n:
            raise ValueError(f"bucket start {config.bucket_starts[-1]} is past the last parameter: the optimizer has "
                             f"{n} parameters (indices 1..{n - 1} start a bucket)")
        bounds = (0, *config.bucket_starts, n)
        return [slots[lo:hi][::-1] for lo, hi in reversed(list(zip(bounds, bounds[1:])))]
    buckets: list[list[_Slot]] = [[]]
    size = 0
    for slot in reversed(slots):
        buckets[-1].append(slot)
        size += slot.param.numel() * 4  # the whole parameter: the same buckets on every rank when sharded
        if size >= config.bucket_bytes:  # closed once it reaches the size: DDP's rule
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


def _call_weakly(method: weakref.WeakMethod, p: Tensor) -> None:
    """A parameter's hook: ``method(p)`` while its optimizer lives."""
    bound = method()
    if bound is not None:
        bound(p)


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


@typing.runtime_checkable
class AveragesReplicas(typing.Protocol):
    """A dense optimizer that averages some parameters' gradients over the data-parallel
    replicas itself (``HostAdamW``, the host part of ``PartialOffloadAdamW``): a data-parallel
    wrapper (DDP) must leave those parameters out, as ``hetero.apply`` does - averaging them
    twice is wasted traffic, and DDP takes one device type."""

    def replica_averaged_parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the optimizer averages, in its order."""
        ...


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view or a shared buffer counts once).
    A DTensor counts its local shard: what this rank holds."""
    seen: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[(t.device, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def agree_arrivals(slots: list[_Slot], group: dist.ProcessGroup | None, world: int) -> None:
    """Wait for the slots' gradient copies; zero the buffers of those that got none here; make
    every rank of ``group`` agree which arrived (on any rank), so the exchanges pair up.
    Collective over ``group`` (``world`` ranks; nothing to agree at 1)."""
    for s in slots:
        if s.copied is not None:
            s.copied.synchronize()  # sync point: the host reads the streamed gradient
            s.copied = None
    if world == 1:
        return
    arrived = torch.tensor([s.arrived for s in slots], dtype=torch.int32)
    for s in slots:
        if not s.arrived:
            s.grad.zero_()  # holds the last step's gradient or (host-only, sharded) old weights
    dist.all_reduce(arrived, group=group)
    for s, n in zip(slots, arrived.tolist()):
        s.arrived = n > 0


def slots_state(slots: Iterable[_Slot]) -> dict[str, dict[str, Any]]:
    """The optimizer state of ``slots`` by parameter name: step, master and moments (this rank's
    elements, flat host tensors; not copies)."""
    return {s.name: {"step": s.step, "master": s.master, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq}
            for s in slots}


def load_slots(owner: str, slots: Iterable[_Slot], state: dict[str, dict[str, Any]],
               owned: typing.Callable[[int], slice]) -> None:
    """Restore ``state`` (:func:`slots_state` of whole tensors) into ``slots``: each keeps the
    elements ``owned(numel)``, and its device weight is rewritten from the whole master. Every
    name and size is checked before anything is written.

    Raises:
        ValueError: a parameter name or size that differs from ``slots``' (``owner``: the optimizer's class).
    """
    by_name = {s.name: s for s in slots}
    if set(by_name) != set(state):
        raise ValueError(f"{owner} state names {sorted(state)[:5]}... differ from this optimizer's "
                         f"{sorted(by_name)[:5]}...")
    for name, st in state.items():
        if st["master"].numel() != by_name[name].param.numel():
            raise ValueError(f"parameter {name!r} has {st['master'].numel()} elements in the checkpoint and "
                             f"{by_name[name].param.numel()} here")
    for name, st in state.items():
        slot = by_name[name]
        own = owned(slot.param.numel())
        slot.step = int(st["step"])
        for key in ("master", "exp_avg", "exp_avg_sq"):
            getattr(slot, key).copy_(st[key].reshape(-1)[own])
        slot.param.data.copy_(st["master"].view(slot.param.shape))  # rounds to the device dtype


def slots_device_bytes(slots: Iterable[_Slot], peak_grad_bytes: int) -> dict[str, int]:
    """Bytes the parameters of ``slots`` hold on their device, counted from the live tensors (each
    storage once): weights; gradients (``peak_grad_bytes``, the largest alive at once); optimizer
    state: every buffer of the slots (masters, moments, gradient and staging buffers) that is on
    its parameter's device - none on a machine with an accelerator, all on a host-only machine."""
    slots = list(slots)
    weights = storage_bytes(s.param for s in slots)
    buffers = [t for s in slots for t in (s.master, s.exp_avg, s.exp_avg_sq, s.grad, s.staging)
               if t is not None and t.device == s.param.device]
    params = {s.param.untyped_storage().data_ptr() for s in slots}
    state = storage_bytes(t for t in buffers if t.untyped_storage().data_ptr() not in params)
    return {"params": weights, "grads": peak_grad_bytes, "optimizer_state": state}


def new_slot(name: str, param: Tensor, group: dict, own: slice, grad_elements: int, device_dtype: torch.dtype,
             pin: bool) -> _Slot:
    """The host buffers of ``param`` (``pin``: pinned, for a machine with an accelerator): its
    fp32 master (the elements ``own`` of its current values: this rank's, all of them unsharded)
    and zeroed moments, the buffer its gradient streams into (``grad_elements``; bf16 with bf16
    device weights, else fp32) and, for fp16 weights on an accelerator, an fp16 staging copy for
    the upload. Casts ``param`` in place to ``device_dtype``: the device keeps only the
    low-precision weights."""
    master = _host_buffer(own.stop - own.start, torch.float32, pin)
    master.copy_(param.detach().reshape(-1)[own])
    on_host = param.device.type == "cpu"
    param.data = param.data.to(device_dtype)
    grad_dtype = torch.bfloat16 if device_dtype == torch.bfloat16 else torch.float32
    fp16_upload = device_dtype == torch.float16 and not on_host
    staging = torch.empty(master.numel(), dtype=torch.float16, pin_memory=pin) if fp16_upload else None
    zeros = lambda n, dtype=torch.float32: _host_buffer(n, dtype, pin).zero_()  # noqa: E731
    return _Slot(name, param, group, master, zeros(master.numel()), zeros(master.numel()),
                 zeros(grad_elements, grad_dtype), staging)


def all_reduce_bucket(slots: list[_Slot], flat: Tensor | None, group: dist.ProcessGroup | None) -> None:
    """Sum the slots' streamed gradients over ``group`` (whole, on every rank): one all-reduce for
    the bucket, through ``flat`` (their total size) when there are several. Collective."""
    if len(slots) == 1:
        dist.all_reduce(slots[0].grad, group=group)
        return
    # A copy in and out of one flat buffer: each slot's buffer stays its own (on the CPU it
    # swaps with the parameter's storage), and a host memcpy costs less than a collective's latency.
    torch.cat([sl.grad for sl in slots], out=flat)
    dist.all_reduce(flat, group=group)
    for sl, part in zip(slots, flat.split([sl.grad.numel() for sl in slots])):
        sl.grad.copy_(part)
