"""Adam/AdamW on the host for large dense models: fp32 master weights and moments in host memory,
low-precision weights on the device, the update overlapped with backward.

The reference design's optimizer heterogeneity (fp16 device weights, fp32 Adam state on the CPU,
"a third of the device memory"); anchors: DeepSpeed ZeRO-Offload (``DeepSpeedCPUAdam``), FSDP2's
``CPUOffloadPolicy``, torchao's CPU offload optimizer.

Data flow per step, per bucket of parameters (in the order backward produces their gradients):

1. a post-accumulate-grad hook copies each gradient device->host into a pinned buffer (async on
   CUDA; an event marks its end) and frees the device gradient at once. With bf16 device weights
   the buffer is bf16, as the gradient is: half the PCIe bytes and 2 fewer bytes per parameter
   for the host update to read; the kernel widens it to fp32 exactly. Otherwise it is fp32;
2. when a bucket's last gradient has arrived, a worker thread waits for the copies and runs the
   fused kernel (:mod:`hetero.optim._adam_kernels`) over the bucket: the fp32 master and moments
   are updated and, in the same pass, the new device weight is written over the gradient it came
   from (no extra buffer, no extra memory traffic); that buffer is uploaded on a side stream
   (CUDA), or, when the device is the host, becomes the parameter's storage while the old one
   receives the next gradient (a swap, no copy). fp16 weights go through an fp16 staging copy;
3. ``step()`` waits for all of it.

Backward of the remaining layers runs meanwhile. Global gradient-norm clipping and fp16 dynamic
loss scaling need every gradient before any update (the clip factor; a skipped step must touch
nothing): with either, the copies still overlap backward, and the updates run in ``step()``.
Gradient accumulation over several backward passes is not supported with streaming (one backward
per ``step()``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

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
            gradients have arrived).
        max_grad_norm: clip the global L2 norm of the gradients to this (``None``: no clipping).
        loss_scaler: dynamic loss scaling (needed for fp16); the loss must be multiplied by
            ``optimizer.loss_scale`` before backward.
        overlap: run bucket updates during backward (else all in ``step()``).
    """

    device_dtype: torch.dtype = torch.bfloat16
    bucket_bytes: int = 32 << 20
    max_grad_norm: float | None = None
    loss_scaler: DynamicLossScaler | None = None
    overlap: bool = True


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
    arrived: bool = False
    copied: Any = None  # CUDA event of the device->host gradient copy
    uploaded: Any = None  # CUDA event of the last host->device upload (it reads ``grad`` or ``staging``)


class HostAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019) with its state on the host; see the module docstring.

    Args:
        params: parameters (on the device), ``(name, parameter)`` pairs such as
            ``model.named_parameters()`` (names key the ``state_dict``), or param-group dicts.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        config: :class:`HostOffloadConfig`.

    The parameters' data are replaced by ``config.device_dtype`` copies; the fp32 values live on
    as master weights (``optimizer.master(param)``). Works with LR schedulers and param groups.

    Raises:
        ValueError: a parameter given twice, or a device dtype other than bf16/fp16/fp32.
    """

    decoupled = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, config: HostOffloadConfig = HostOffloadConfig()) -> None:
        if config.device_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"device_dtype must be bfloat16, float16 or float32, got {config.device_dtype}")
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        names: dict[int, str] = {}
        for gi, g in enumerate(groups):
            plain = []
            for j, item in enumerate(g["params"]):
                name, p = item if isinstance(item, tuple) else (f"group{gi}.param{j}", item)
                names[id(p)] = name
                plain.append(p)
            g["params"] = plain
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.config = config
        self.loss_scaler = config.loss_scaler
        cuda = torch.cuda.is_available()
        self._slots: dict[int, _Slot] = {}
        for group in self.param_groups:
            for p in group["params"]:
                master = _host_buffer(p.numel(), torch.float32, cuda)
                master.copy_(p.detach().reshape(-1))
                host = lambda dtype=torch.float32: _host_buffer(master.numel(), dtype, cuda).zero_()  # noqa: E731
                on_host = p.device.type == "cpu"
                p.data = p.data.to(config.device_dtype)  # the device keeps only the low-precision weights
                grad_dtype = torch.bfloat16 if config.device_dtype == torch.bfloat16 else torch.float32
                fp16_upload = config.device_dtype == torch.float16 and not on_host
                staging = torch.empty(master.numel(), dtype=torch.float16, pin_memory=cuda) if fp16_upload else None
                slot = _Slot(names[id(p)], p, group, master, host(), host(), host(grad_dtype), staging)
                self._slots[id(p)] = slot
                p.register_post_accumulate_grad_hook(self._on_grad)
        # Buckets in reverse registration order: backward produces the last layers' gradients first.
        self._buckets: list[list[_Slot]] = [[]]
        size = 0
        for slot in reversed(list(self._slots.values())):
            if size and size + slot.master.numel() * 4 > config.bucket_bytes:
                self._buckets.append([])
                size = 0
            slot.bucket = len(self._buckets) - 1
            self._buckets[-1].append(slot)
            size += slot.master.numel() * 4
        self._pending = [0] * len(self._buckets)
        self._futures: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._upload_stream = torch.cuda.Stream() if cuda else None
        self.peak_device_grad_bytes = 0  # largest device gradient alive at once (accounting)

    # ------------------------------------------------------------------------- streaming
    def _on_grad(self, p: Tensor) -> None:
        slot = self._slots[id(p)]
        self.peak_device_grad_bytes = max(self.peak_device_grad_bytes, p.grad.numel() * p.grad.element_size())
        # device -> host into the pinned buffer (fp16 is widened to fp32 by the copy); async on CUDA
        slot.grad.copy_(p.grad.reshape(-1), non_blocking=True)
        if p.grad.device.type == "cuda":
            slot.copied = torch.cuda.Event()
            slot.copied.record()
        p.grad = None  # free the device gradient now, not at zero_grad()
        slot.arrived = True
        with self._lock:
            self._pending[slot.bucket] += 1
            complete = self._pending[slot.bucket] == len(self._buckets[slot.bucket])
        if complete and self._can_overlap():
            self._futures.append(self._worker().submit(self._update_bucket, slot.bucket, 1.0))

    def _can_overlap(self) -> bool:
        return self.config.overlap and self.config.max_grad_norm is None and self.loss_scaler is None

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetero-host-adam")
        return self._pool

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without a loss scaler)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # ------------------------------------------------------------------------- update
    def _update_bucket(self, bucket: int, grad_scale: float) -> None:
        K = _kernels()
        for slot in self._buckets[bucket]:
            if not slot.arrived:  # no gradient this step (unused parameter): skip, as torch does
                continue
            if slot.copied is not None:
                slot.copied.synchronize()  # sync point: the host reads the streamed gradient
            g = slot.group
            slot.step += 1
            beta1, beta2 = g["betas"]
            bc1 = 1 - beta1**slot.step
            bc2_sqrt = math.sqrt(1 - beta2**slot.step)
            if slot.uploaded is not None:
                slot.uploaded.synchronize()  # sync point: the previous upload still reads the buffer
                slot.uploaded = None
            in_place = slot.grad.dtype == self.config.device_dtype  # bf16 or fp32: weight over gradient
            lr, wd = g["lr"], g["weight_decay"]
            decay = 1 - lr * wd if self.decoupled else wd  # scalars in double, rounded once (as torch)
            K.adam_step(slot.master.numpy(), slot.exp_avg.numpy(), slot.exp_avg_sq.numpy(), _np(slot.grad), in_place,
                        f32(decay), self.decoupled, f32(1 - beta1), f32(beta2), f32(1 - beta2),
                        f32(lr / bc1), f32(bc2_sqrt), f32(g["eps"]), f32(grad_scale), _chunks(slot.master.numel()))
            if not in_place:  # fp16: numba has no fp16 arithmetic, so torch rounds the copy
                (slot.staging if slot.staging is not None else slot.param.data.view(-1)).copy_(slot.master)
                if slot.staging is not None:
                    self._upload(slot, slot.staging)
            elif slot.param.device.type == "cpu":
                # The device is the host: the buffer holding the new weights becomes the
                # parameter's storage and the old storage receives the next gradient (no copy).
                new = slot.grad
                slot.grad = slot.param.data.reshape(-1)
                slot.param.data = new.view(slot.param.shape)
            else:
                self._upload(slot, slot.grad)
            slot.arrived = False

    def _upload(self, slot: _Slot, source: Tensor) -> None:
        # host -> device on a side stream; the compute stream waits for it in step(), so the next
        # backward's gradient copy into ``source`` is ordered after it. The host already waited
        # for this parameter's gradient copy, so every kernel that read the old weight has run.
        with torch.cuda.stream(self._upload_stream):
            slot.param.data.copy_(source.view_as(slot.param), non_blocking=True)
            slot.uploaded = torch.cuda.Event()
            slot.uploaded.record(self._upload_stream)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim API
        """Finish this step's updates (see the module docstring); returns ``closure()`` if given.

        With a loss scaler, a step whose gradients are not all finite is skipped (no parameter
        or state changes) and the scale shrinks; ``skipped_steps`` counts them.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for f in self._futures:
            f.result()  # sync point: wait for the updates that overlapped backward
        self._futures = []
        if not self._can_overlap():
            self._finish_global()
        if self._upload_stream is not None:
            torch.cuda.current_stream().wait_stream(self._upload_stream)  # device waits, not the host
        self._pending = [0] * len(self._buckets)
        return loss

    def _finish_global(self) -> None:
        K = _kernels()
        arrived = [s for s in self._slots.values() if s.arrived]
        for s in arrived:
            if s.copied is not None:
                s.copied.synchronize()  # sync point: all gradients on the host
        total, finite = 0.0, True
        for s in arrived:
            sq, ok = K.sum_of_squares(_np(s.grad), _chunks(s.grad.numel()))
            total, finite = total + sq, finite and ok
        scale = self.loss_scale
        if self.loss_scaler is not None:
            self.loss_scaler.update(finite)
            if not finite:
                self.skipped_steps = getattr(self, "skipped_steps", 0) + 1
                for s in arrived:
                    s.arrived = False
                return
        factor = 1.0 / scale
        if self.config.max_grad_norm is not None:
            norm = math.sqrt(total) / scale
            self.last_grad_norm = norm
            factor *= min(1.0, self.config.max_grad_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
        for b in range(len(self._buckets)):
            self._update_bucket(b, factor)

    def update_from_host_gradients(self) -> None:
        """Run the update of every parameter from the gradients already in the host buffers
        (``grad_buffer``), as ``step()`` does after backward. For benchmarks and tests of the
        host step alone."""
        for slot in self._slots.values():
            slot.arrived = True
        if self._can_overlap():
            for b in range(len(self._buckets)):
                self._update_bucket(b, 1.0)
        else:
            self._finish_global()
        if self._upload_stream is not None:
            torch.cuda.current_stream().wait_stream(self._upload_stream)

    def grad_buffer(self, param: Tensor) -> Tensor:
        """The host buffer ``param``'s next gradient streams into (flat; bf16 with bf16 device
        weights, else fp32). On a host-only machine it changes after every update (a swap with
        the parameter's storage): look it up again each step."""
        return self._slots[id(param)].grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Device gradients are freed as they stream to the host; only a stray one can remain.
        for slot in self._slots.values():
            slot.param.grad = None
            slot.arrived = False
        self._pending = [0] * len(self._buckets)

    # ------------------------------------------------------------------------- state
    def master(self, param: Tensor) -> Tensor:
        """The fp32 master weight of ``param`` (host, shaped like ``param``)."""
        return self._slots[id(param)].master.view(param.shape)

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [self._slots[id(p)].name for p in g["params"]]}
                  for g in self.param_groups]
        state = {s.name: {"step": s.step, "master": s.master, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq}
                 for s in self._slots.values()}
        scaler = self.loss_scaler.state_dict() if self.loss_scaler is not None else None
        return {"state": state, "param_groups": groups, "loss_scaler": scaler}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the device weights are rewritten from the masters.

        Raises:
            ValueError: a parameter name or shape that differs from this optimizer's.
        """
        by_name = {s.name: s for s in self._slots.values()}
        if set(by_name) != set(state_dict["state"]):
            raise ValueError(f"{type(self).__name__} state names {sorted(state_dict['state'])[:5]}... differ from "
                             f"this optimizer's {sorted(by_name)[:5]}...")
        for name, st in state_dict["state"].items():
            slot = by_name[name]
            if st["master"].shape != slot.master.shape:
                raise ValueError(f"parameter {name!r} has {st['master'].numel()} elements in the checkpoint and "
                                 f"{slot.master.numel()} here")
            slot.step = int(st["step"])
            for key in ("master", "exp_avg", "exp_avg_sq"):
                getattr(slot, key).copy_(st[key])
            slot.param.data.copy_(slot.master.view(slot.param.shape))  # rounds to the device dtype
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.loss_scaler is not None and state_dict.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    # ------------------------------------------------------------------------- accounting
    def device_bytes(self) -> dict[str, int]:
        """Bytes this optimizer's parameters hold on the device: weights, gradients (the peak of
        streamed gradients alive at once), optimizer state (none: it is on the host)."""
        weights = sum(s.param.numel() * s.param.element_size() for s in self._slots.values())
        return {"params": weights, "grads": self.peak_device_grad_bytes, "optimizer_state": 0}


class HostAdam(HostAdamW):
    """Adam (Kingma & Ba 2015) with L2 weight decay added to the gradient, as ``torch.optim.Adam``."""

    decoupled = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, config: HostOffloadConfig = HostOffloadConfig()) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, config=config)


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


def device_memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
    """Bytes held on the device by ``model``'s parameters, their gradients and optimizer state,
    and their sum per parameter. On a host-only machine "device" means the model's parameters'
    own device; host-side optimizer state (HostAdamW) counts zero.

    For ``HostAdamW`` the gradients are the peak of streamed gradients alive at once; for other
    optimizers, the gradients present now and every state tensor on a parameter's device.
    """
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    if isinstance(optimizer, HostAdamW):
        b = optimizer.device_bytes()
    else:
        b = {"params": sum(p.numel() * p.element_size() for p in params),
             "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
             "optimizer_state": 0}
        if optimizer is not None:
            for p, st in optimizer.state.items():
                b["optimizer_state"] += sum(t.numel() * t.element_size() for t in st.values()
                                            if isinstance(t, Tensor) and t.device == p.device and t.dim() > 0)
    total = b["params"] + b["grads"] + b["optimizer_state"]
    return {**b, "total": total, "num_params": n, "bytes_per_param": total / max(n, 1)}
