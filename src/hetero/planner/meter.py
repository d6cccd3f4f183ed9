"""A plan's step measured: median seconds and the device's peak bytes (what the benchmark and
the tests hold a plan's prediction and budget to).

* On CUDA the peak is the caching allocator's (``torch.cuda.max_memory_allocated``) over the
  steps: everything the device holds for the plan, parameters included, less what the process
  held besides when the measurement began (other models, uncollected garbage) and less the
  workspaces of the CUDA libraries (cuBLAS and cuBLASLt keep one per handle and stream, 32 MiB each on Hopper, through
  the same allocator). Those belong to the process, as its CUDA context does, whatever the plan:
  a device budget is for the plan's tensors.
* On a host-only machine the device and the host share one memory, so the device's bytes are
  counted from live tensors: after warm-up steps (which build the optimizers' state), the
  storages of the device units' parameters and buffers and of the device optimizer's state,
  plus every new storage an op of the device's work creates while the measured steps run (a
  dispatch mode on the calling thread; views and in-place results share an input's storage and
  are not new), each counted until it is freed (a finalizer on the storage). Host work is not
  counted: host subgraphs' forward passes run on the partitioner's worker thread, their backward
  runs through autograd nodes the partitioner tagged as host work
  (:mod:`hetero.placement.tagging`), and the host optimizers' updates run in
  :attr:`Applied.host_work`. Host state built before (HostAdamW's masters and moments, the
  tables) is the host's. Counted in excess: small host buffers of table lookups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hetero.optim import HostAdamW
from hetero.optim.partial_offload import PartialOffloadAdamW
from hetero.placement import Target, resolve_device
from hetero.placement.tagging import TARGET
from hetero.planner.applied import Applied


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured step: median seconds over the timed steps, the device's peak bytes over all."""

    seconds: float
    device_bytes: int
    steps: int


class LiveBytes(TorchDispatchMode):
    """Bytes of the live storages counted so far, and their peak (see the module docstring).

    Thread contract: counts ops of the thread that entered it; frees may arrive from any thread
    (a finalizer), hence the lock."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.current = self.peak = 0
        self.lock = threading.Lock()
        self.paused = 0

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Ops run inside are host work: not counted."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        with self.lock:
            if ref in self.live or storage.nbytes() == 0:
                return
            self.live[ref] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self.forget, ref)

    def forget(self, ref: StorageWeakRef) -> None:
        with self.lock:
            self.current -= self.live.pop(ref, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        if self.paused or (node is not None and node.metadata.get(TARGET) == Target.HOST.value):
            return out
        inputs = {StorageWeakRef(t.untyped_storage()) for t in _strided((args, kwargs))}
        for t in _strided(out):
            if StorageWeakRef(t.untyped_storage()) not in inputs:
                self.count(t)
        return out


def _strided(tree: Any) -> list[torch.Tensor]:  # noqa: ANN401 - a pytree of op arguments
    """The tensors of ``tree`` that own storage: a sparse gradient's (a device table's) are its
    indices and values."""
    out = []
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            out += [t._indices(), t._values()] if t.is_sparse else [t]
    return out


def measure_step(applied: Applied, inputs: tuple[Any, ...], target: Any,  # noqa: ANN401
                 loss_fn: Callable[[Any, Any], torch.Tensor], steps: int = 5, warmup: int = 2) -> Measurement:
    """Run ``warmup`` untimed steps, then ``steps`` timed ones (their median), then - on a
    host-only machine - two more under the live-bytes count (its dispatch mode would slow the
    timed ones); the device's peak bytes over the counted steps (all steps on CUDA)."""
    device = resolve_device(Target.DEVICE)
    times: list[float] = []

    def run(count: int, timed: bool) -> None:
        for _ in range(count):
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # sync point: time the device's work too
            t0 = time.perf_counter()
            applied.step(inputs, target, loss_fn)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if timed:
                times.append(time.perf_counter() - t0)

    if device.type == "cuda":
        # The plan's bytes only: what the process held before (a model a caller keeps, an earlier
        # plan's cyclic garbage) is not this plan's. On an H100 the same plan measured 17.3 and
        # 23.8 MB in one process, by what had run before it (GPU run 11, session 28).
        gc.collect()
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()  # (made again, and told apart, in the steps)
        before = [*applied.model.parameters(), *applied.model.buffers(), *_device_state(applied.optimizers.dense)]
        other = torch.cuda.memory_allocated(device) - _allocated_bytes(t for t in before if t.device == device)
        torch.cuda.reset_peak_memory_stats(device)
        run(warmup, False)
        run(steps, True)
        peak = torch.cuda.max_memory_allocated(device) - _workspaces(device) - other
        return Measurement(statistics.median(times), peak, steps)
    run(warmup, False)  # the optimizers' state exists from here on
    run(steps, True)
    meter = LiveBytes()
    state = _device_state(applied.optimizers.dense) + [t for o in applied.optimizers.device_tables for t in _device_state(o)]
    for t in list(applied.model.parameters()) + list(applied.model.buffers()) + state:
        if t not in applied.host_tensors:
            for part in _strided(t):
                meter.count(part)
    applied.host_work = meter.host
    try:
        with meter:
            run(2, False)
    finally:
        applied.host_work = contextlib.nullcontext
    return Measurement(statistics.median(times), meter.peak, steps)


def _allocated_bytes(tensors: Any) -> int:  # noqa: ANN401 - an iterable of tensors
    """The caching allocator's bytes for the distinct storages of ``tensors`` (it rounds each
    block up to 512 bytes)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(-(-n // 512) * 512 for n in storages.values())


def _workspaces(device: torch.device) -> int:
    """Bytes the CUDA libraries' workspaces held (held since their first use, so through the
    peak): told by letting them go (they are made again at the next product)."""
    held = torch.cuda.memory_allocated(device)
    torch._C._cuda_clearCublasWorkspaces()  # (torch has no public call; the allocator frees them)
    return held - torch.cuda.memory_allocated(device)


def _device_state(optimizer: Any) -> list[torch.Tensor]:  # noqa: ANN401 - the plan's dense optimizer
    """The state tensors a dense optimizer keeps beside device parameters (HostAdamW keeps its
    state on the host; a partial offload's device part is a torch optimizer)."""
    if isinstance(optimizer, PartialOffloadAdamW):
        optimizer = optimizer.device
    if optimizer is None or isinstance(optimizer, HostAdamW):
        return []
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
