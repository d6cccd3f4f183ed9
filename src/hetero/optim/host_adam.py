"""Adam/AdamW on the host for large dense models: fp32 master weights and moments in host memory,
low-precision weights on the device, the update overlapped with backward.

The reference design's optimizer heterogeneity (fp16 device weights, fp32 Adam state on the CPU,
"a third of the device memory"); anchors: DeepSpeed ZeRO-Offload (``DeepSpeedCPUAdam``), FSDP2's
``CPUOffloadPolicy``, torchao's CPU offload optimizer.

Per bucket of parameters, as backward produces their gradients: a hook streams each gradient to a
host buffer, a worker thread all-reduces the bucket and runs the fused update; ``step()`` waits.
The whole data flow, what is skipped, clipping, loss scaling, DDP: docs/host-optimizers.md."""

from __future__ import annotations

import functools
import math
import threading
import warnings
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hetero.optim.host_state import (
    HostOffloadConfig, _chunks, _kernels, _np, agree_arrivals, all_reduce_bucket, host_all_reduce_group, load_slots,
    new_slot, _buckets, _call_weakly, _remove_all, _Slot, _sum_over, f32, slots_device_bytes, slots_state,
)
from hetero.placement.threads import host_worker


class HostAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019) with its state on the host; see the module docstring.

    Args:
        params: parameters (on the device), ``(name, parameter)`` pairs such as
            ``model.named_parameters()`` (names key the ``state_dict``), or param-group dicts.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        config: :class:`HostOffloadConfig`.
        process_group: the data-parallel ranks whose gradients are averaged before every update
            (``None``: the default group when ``torch.distributed`` is initialised, else none).
            Every rank of the group must build this optimizer (a collective over it: it creates
            a gloo group for the host all-reduces).
        norm_group: the ranks holding the model's other parameters - a pipeline's ``pp`` group,
            whose stages each step their own part - whose sums of squares the global gradient
            norm adds (with ``config.max_grad_norm`` or a loss scaler: every stage clips by the
            same norm and skips the same steps). A collective to build, as ``process_group``.

    The parameters' data are replaced by ``config.device_dtype`` copies; the fp32 values live on
    as master weights (``optimizer.master(param)``). Works with LR schedulers and param groups.

    Thread contract: the post-accumulate-grad hooks run on autograd's thread and only copy; the
    updates and the host all-reduces run on one worker thread, which ``step()`` and
    ``zero_grad()`` join before they return.

    Raises:
        ValueError: a parameter given twice, or a device dtype other than bf16/fp16/fp32.
        RuntimeError: (from backward) a parameter that receives a second gradient before ``step()``.
    """

    decoupled = True

    def replica_averaged_parameters(self) -> list[Tensor]:
        """Every parameter: their gradients are averaged over ``process_group`` before each update
        (:class:`~hetero.optim.host_state.AveragesReplicas`)."""
        return [p for g in self.param_groups for p in g["params"]]

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, config: HostOffloadConfig = HostOffloadConfig(),
                 process_group: dist.ProcessGroup | None = None, norm_group: dist.ProcessGroup | None = None) -> None:
        if config.device_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"device_dtype must be bfloat16, float16 or float32, got {config.device_dtype}")
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        named: list[tuple[str, Tensor]] = []
        for gi, g in enumerate(groups):
            items = [item if isinstance(item, tuple) else (f"group{gi}.param{j}", item) for j, item in enumerate(g["params"])]
            named += items
            g["params"] = [p for _, p in items]
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.config = config
        self.loss_scaler = config.loss_scaler
        self._group, self._world = host_all_reduce_group(process_group)
        self._norm_group = host_all_reduce_group(norm_group)[0] if norm_group is not None else None
        cuda = torch.cuda.is_available()
        names = dict((p, n) for n, p in reversed(named))  # keyed by the tensor itself, as torch.optim's state
        self._slots: dict[Tensor, _Slot] = {}
        on_grad, hooks = weakref.WeakMethod(self._on_grad), []
        for group in self.param_groups:
            for p in group["params"]:
                self._slots[p] = new_slot(names[p], p, group, self._owned(p.numel()), self._grad_elements(p.numel()),
                                          config.device_dtype, cuda)
                hooks.append(p.register_post_accumulate_grad_hook(functools.partial(_call_weakly, on_grad)))
        # the hooks hold the optimizer weakly and go with it: holding it, they kept it, its host state and
        # worker alive as long as the parameters (torch's collector cannot see a cycle through a tensor's hooks)
        weakref.finalize(self, _remove_all, hooks)
        self._buckets = _buckets(list(self._slots.values()), config)
        for b, bucket in enumerate(self._buckets):
            for slot in bucket:
                slot.bucket = b
        # the flat buffer of each bucket's fused all-reduce (several slots, several ranks)
        self._fused = [torch.empty(sum(sl.grad.numel() for sl in bucket), dtype=bucket[0].grad.dtype)
                       if len(bucket) > 1 and self._world > 1 else None for bucket in self._buckets]
        self._pending = [0] * len(self._buckets)
        self._ready = [threading.Event() for _ in self._buckets]  # a bucket may be reduced and updated
        self._loop: Future | None = None  # the worker's pass over this step's buckets
        self._abort = False
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._upload_stream = torch.cuda.Stream() if cuda else None
        self._warned_ddp = False
        self.skipped_steps = 0  # steps skipped by the loss scaler (non-finite gradients)
        self.last_grad_norm: float | None = None  # global gradient norm of the last clipped step
        self.peak_device_grad_bytes = 0  # largest device gradient alive at once (accounting)

    # ------------------------------------------------------------------------- streaming
    def _on_grad(self, p: Tensor) -> None:
        slot = self._slots[p]
        slot.accumulated += 1
        if slot.accumulated < self.config.accumulate:
            return  # autograd sums the next backward pass's gradient into p.grad
        self._stream(slot, p)

    def _stream(self, slot: _Slot, p: Tensor) -> None:
        slot.accumulated = 0
        if slot.seen:  # (``arrived`` is cleared by the update, which may already have run)
            raise RuntimeError(f"{type(self).__name__}: parameter {slot.name!r} received a second gradient before "
                               f"step(); gradients stream to the host as backward produces them, so accumulation over "
                               f"several backward passes is not supported: call step() after every backward")
        self.peak_device_grad_bytes = max(self.peak_device_grad_bytes, p.grad.numel() * p.grad.element_size())
        # device -> host into the pinned buffer (fp16 is widened to fp32 by the copy); async on CUDA
        slot.grad[: p.numel()].copy_(p.grad.reshape(-1), non_blocking=True)
        if p.grad.device.type == "cuda":
            slot.copied = torch.cuda.Event()
            slot.copied.record()
        p.grad = None  # free the device gradient now, not at zero_grad()
        slot.arrived = slot.seen = True
        with self._lock:
            self._pending[slot.bucket] += 1
            if self._pending[slot.bucket] == len(self._buckets[slot.bucket]):
                self._ready[slot.bucket].set()
            if self._loop is None and self._can_overlap():
                self._loop = self._worker().submit(self._run_buckets)

    # Hooks of the sharded variant (hetero.optim.host_adam_sharded): which elements a rank keeps
    # state for, how large the streamed-gradient buffer is, where the reduced gradient is.
    def _owned(self, n: int) -> slice:
        return slice(0, n)

    def _grad_elements(self, n: int) -> int:
        return n

    def _reduced_grad(self, slot: _Slot) -> Tensor:
        return slot.grad

    def _global_sum_of_squares(self, total: float, finite: bool) -> tuple[float, bool]:
        return total, finite  # the reduced gradients are whole on every rank

    def _can_overlap(self) -> bool:
        return self.config.overlap and self.config.max_grad_norm is None and self.loss_scaler is None

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = host_worker("hetero-host-adam")  # (its OpenMP team: what the device's leaves)
        return self._pool

    def _run_buckets(self) -> None:
        # Buckets in a fixed order on every rank, so the ranks' all-reduces pair up even when a
        # parameter is unused on some rank (its bucket then waits for step()).
        for b in range(len(self._buckets)):
            self._ready[b].wait()  # sync point: the bucket's gradients have all arrived, or backward is over
            if self._abort:
                return
            self._reduce(b)
            self._update_bucket(b, 1.0 / self._world)  # sums over the ranks

    def _reduce(self, bucket: int) -> None:
        """Wait for the bucket's gradient copies; sum its gradients over the data-parallel ranks.

        A parameter that got no gradient here contributes zeros; it counts as arrived when it got
        one on any rank (one process on the global batch would have seen that gradient)."""
        agree_arrivals(self._buckets[bucket], self._group, self._world)
        self._exchange(bucket)

    def _exchange(self, bucket: int) -> None:
        """Sum the bucket's gradients over the data-parallel ranks (whole, on every rank): one
        all-reduce per bucket (the comm fusion), on the optimizer's own gloo group."""
        if self._world > 1:
            all_reduce_bucket(self._buckets[bucket], self._fused[bucket], self._group)

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without a loss scaler)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # ------------------------------------------------------------------------- update
    def _adam_step(self, slot: _Slot, grad: Tensor, grad_scale: float) -> bool:
        """One AdamW step of ``slot``'s master and moments (all or this rank's elements) from the
        reduced ``grad`` (flat, the same elements); returns whether the kernel wrote the new
        weights over ``grad`` (bf16 or fp32 device weights) - else (fp16) they are in the master."""
        g = slot.group
        slot.step += 1
        beta1, beta2 = g["betas"]
        bc1 = 1 - beta1**slot.step
        bc2_sqrt = math.sqrt(1 - beta2**slot.step)
        if slot.uploaded is not None:
            slot.uploaded.synchronize()  # sync point: the previous upload still reads the buffer
            slot.uploaded = None
        in_place = grad.dtype == self.config.device_dtype
        lr, wd = g["lr"], g["weight_decay"]
        decay = 1 - lr * wd if self.decoupled else wd  # scalars in double, rounded once (as torch)
        if grad.numel():
            _kernels().adam_step(slot.master.numpy(), slot.exp_avg.numpy(), slot.exp_avg_sq.numpy(), _np(grad),
                                 in_place, f32(decay), self.decoupled, f32(1 - beta1), f32(beta2), f32(1 - beta2),
                                 f32(lr / bc1), f32(bc2_sqrt), f32(g["eps"]), f32(grad_scale), _chunks(grad.numel()))
        return in_place

    def _update_bucket(self, bucket: int, grad_scale: float) -> None:
        for slot in self._buckets[bucket]:
            if not slot.arrived:  # no gradient this step on any rank (unused parameter): skip, as torch does
                continue
            in_place = self._adam_step(slot, slot.grad, grad_scale)
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
        for slot in self._slots.values():
            if slot.accumulated:  # fewer passes than ``accumulate`` reached it (unused in some): apply what came
                self._stream(slot, slot.param)
        self._check_no_late_gradients()
        self._finish_step()
        return loss

    def _finish_step(self) -> None:
        """Wait for (or run) every bucket's update, then begin the next step."""
        if self._can_overlap():
            for ready in self._ready:
                ready.set()  # backward is over: buckets with an unused parameter are complete too
            if self._loop is not None:
                self._loop.result()  # sync point: wait for the updates that overlapped backward
            else:  # no gradient arrived here during backward; the other ranks' all-reduces still need ours
                self._run_buckets()
        else:
            self._finish_global()
        self._new_step()
        if self._upload_stream is not None:
            torch.cuda.current_stream().wait_stream(self._upload_stream)  # device waits, not the host

    def _new_step(self) -> None:
        for slot in self._slots.values():
            slot.seen = False
        self._loop = None
        self._pending = [0] * len(self._buckets)
        for ready in self._ready:
            ready.clear()

    def _check_no_late_gradients(self) -> None:
        late = [s.name for s in self._slots.values() if s.param.grad is not None]
        if late and not self._warned_ddp:
            self._warned_ddp = True
            warnings.warn(f"{type(self).__name__}: parameters {late[:3]} got a gradient after HostAdamW took theirs "
                          f"(is the model wrapped in DistributedDataParallel?). HostAdamW averages gradients over the "
                          f"ranks itself and ignores these; leave its parameters out of DDP to save that all-reduce",
                          stacklevel=3)

    def _finish_global(self) -> None:
        K = _kernels()
        for b in range(len(self._buckets)):
            self._reduce(b)  # in bucket order on every rank
        arrived = [s for s in self._slots.values() if s.arrived]
        total, finite = 0.0, True
        for s in arrived:
            g = self._reduced_grad(s)
            sq, ok = K.sum_of_squares(_np(g), _chunks(g.numel()))
            total, finite = total + sq, finite and ok
        total, finite = self._global_sum_of_squares(total, finite)
        total, finite = _sum_over(self._norm_group, total, finite)  # the other stages' parameters
        scale = self.loss_scale * self._world  # sums over the ranks
        if self.loss_scaler is not None:
            self.loss_scaler.update(finite)  # the same verdict on every rank: the sums are non-finite everywhere
            if not finite:
                self.skipped_steps += 1
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
        self._finish_step()  # (no hook ran: the buckets' updates run here)

    def grad_buffer(self, param: Tensor) -> Tensor:
        """The host buffer ``param``'s next gradient streams into (flat; bf16 with bf16 device
        weights, else fp32). On a host-only machine it changes after every update (a swap with
        the parameter's storage): look it up again each step."""
        return self._slots[param].grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients (after a failed backward, too: an update loop still waiting
        for them is stopped, so nothing is applied)."""
        if self._loop is not None:
            self._abort = True
            for ready in self._ready:
                ready.set()
            try:
                self._loop.result()
            finally:
                self._abort = False
        # Device gradients are freed as they stream to the host; only a stray one can remain.
        for slot in self._slots.values():
            slot.param.grad = None
            slot.arrived = False
            slot.accumulated = 0
        self._new_step()

    # ------------------------------------------------------------------------- state
    def master(self, param: Tensor) -> Tensor:
        """The fp32 master weight of ``param`` (host, shaped like ``param``)."""
        return self._slots[param].master.view(param.shape)

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [self._slots[p].name for p in g["params"]]}
                  for g in self.param_groups]
        scaler = self.loss_scaler.state_dict() if self.loss_scaler is not None else None
        return {"state": slots_state(self._slots.values()), "param_groups": groups, "loss_scaler": scaler}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (whole tensors; a sharded optimizer keeps its elements);
        the device weights are rewritten from the masters. Nothing changes when it raises.

        Raises:
            ValueError: a parameter name or size that differs from this optimizer's.
        """
        load_slots(type(self).__name__, self._slots.values(), state_dict["state"], self._owned)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.loss_scaler is not None and state_dict.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    # ------------------------------------------------------------------------- accounting
    def device_bytes(self) -> dict[str, int]:
        """Bytes this optimizer's parameters hold on their device (:func:`slots_device_bytes`): the
        gradients are the largest one alive at once (each is freed by its hook as it streams away)."""
        return slots_device_bytes(self._slots.values(), self.peak_device_grad_bytes)


class HostAdam(HostAdamW):
    """Adam (Kingma & Ba 2015) with L2 weight decay added to the gradient, as ``torch.optim.Adam``."""

    decoupled = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, config: HostOffloadConfig = HostOffloadConfig(),
                 process_group: dist.ProcessGroup | None = None, norm_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, config=config, process_group=process_group,
                         norm_group=norm_group)
