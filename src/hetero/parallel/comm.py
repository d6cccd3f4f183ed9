"""Collectives and their bytes: one cost definition for what the planner predicts and for what a
run actually sends.

Bytes are counted per rank as the ring algorithms move them (NCCL's and gloo's large-message
algorithms; Patarasuk & Yuan 2009, Thakur et al. 2005): for a group of ``n`` ranks and a local
input of ``L`` bytes, all-gather receives ``L (n - 1)``, all-reduce ``2 L (n - 1) / n``,
reduce-scatter ``L (n - 1) / n``, all-to-all ``L (n - 1) / n``.

:class:`CollectiveCounter` counts them on a running program: a ``TorchDispatchMode`` that sees
every functional collective (``torch.ops._c10d_functional``, which DTensor's ``redistribute``,
``parallelize_module`` and ``loss_parallel`` issue) and every ``torch.distributed`` collective
(``torch.ops.c10d``: DDP's buckets, FSDP2's all-gathers and reduce-scatters, hetero's own), with
its real input tensors and group. Reference: torch's ``CommDebugMode`` (which counts calls, not
bytes).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


class Collective(enum.Enum):
    """The collectives redistributions use."""

    ALL_GATHER = "all-gather"
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    BROADCAST = "broadcast"


def collective_bytes(kind: Collective, local_bytes: float, n: int) -> float:
    """Bytes one rank receives in ``kind`` over ``n`` ranks with a local input of ``local_bytes``."""
    if n <= 1:
        return 0.0
    if kind is Collective.ALL_GATHER:
        return local_bytes * (n - 1)
    if kind is Collective.ALL_REDUCE:
        return 2 * local_bytes * (n - 1) / n
    if kind is Collective.BROADCAST:
        return local_bytes  # what a receiver gets (the root's share is no more in a tree or a ring)
    return local_bytes * (n - 1) / n  # reduce-scatter, all-to-all


# functional collective op name -> (kind, index of the group-name argument)
_OPS = {
    "all_gather_into_tensor": (Collective.ALL_GATHER, 2),
    "all_reduce": (Collective.ALL_REDUCE, 2),
    "reduce_scatter_tensor": (Collective.REDUCE_SCATTER, 3),
    "all_to_all_single": (Collective.ALL_TO_ALL, 3),
}
# torch.distributed's in-place collective op name -> (kind, index of the local input: a tensor or a list)
_C10D_OPS = {
    "allreduce_": (Collective.ALL_REDUCE, 0),
    "_allgather_base_": (Collective.ALL_GATHER, 1),
    "allgather_": (Collective.ALL_GATHER, 1),
    "_reduce_scatter_base_": (Collective.REDUCE_SCATTER, 1),
    "reduce_scatter_": (Collective.REDUCE_SCATTER, 1),
    "alltoall_base_": (Collective.ALL_TO_ALL, 1),
    "broadcast_": (Collective.BROADCAST, 0),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x[:1]) if x and isinstance(x[0], list) else sum(_nbytes(t) for t in x)


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective a rank issued.

    Attributes:
        kind: which collective.
        group_size: ranks in its group.
        input_bytes: bytes of the local input tensor handed to it.
        bytes: bytes this rank receives (:func:`collective_bytes`).
    """

    kind: Collective
    group_size: int
    input_bytes: int
    bytes: float


def summarize(calls: Iterable[Any]) -> dict[str, dict[str, float]]:
    """Per collective kind of ``calls`` (each with ``kind`` and ``bytes``, ``None`` counting as
    unknown, 0): ``{"calls": ..., "bytes": ...}``. Counted calls and planned ones alike."""
    out: dict[str, dict[str, float]] = {}
    for c in calls:
        row = out.setdefault(c.kind.value, {"calls": 0, "bytes": 0.0})
        row["calls"] += 1
        row["bytes"] += c.bytes or 0.0
    return out


class CollectiveCounter(TorchDispatchMode):
    """Record every functional collective issued inside ``with CollectiveCounter() as c:``.

    Thread contract: a dispatch mode is per thread (backward on the CPU runs in the calling
    thread, with its modes); collectives issued by other threads (the host optimizer's worker)
    are not seen. ``calls`` lists them in issue order; ``total_bytes`` sums their per-rank bytes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _OPS:
            kind, group_arg = _OPS[name]
            group = dist.distributed_c10d._resolve_process_group(args[group_arg])
            self._record(kind, dist.get_world_size(group), _nbytes(args[0]))
        elif func.namespace == "c10d" and name in _C10D_OPS:
            kind, input_arg = _C10D_OPS[name]
            group = next(a for a in args if isinstance(a, torch.ScriptObject))  # the process group comes first
            self._record(kind, dist.ProcessGroup.unbox(group).size(), _nbytes(args[input_arg]))
        return func(*args, **(kwargs or {}))

    def _record(self, kind: Collective, n: int, nbytes: int) -> None:
        self.calls.append(CollectiveCall(kind, n, nbytes, collective_bytes(kind, nbytes, n)))

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes for c in self.calls)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per collective kind: ``{"calls": ..., "bytes": ...}``."""
        return summarize(self.calls)


class TrafficCounter(CollectiveCounter):
    """:class:`CollectiveCounter` that also sums the bytes copied host -> device and device ->
    host (``aten._to_copy`` / ``copy_`` between a CPU tensor and an accelerator's) inside
    ``with TrafficCounter() as t:``. Same thread contract: copies made by other threads (an
    accelerator's autograd threads in backward, a prefetch worker) are not seen; C++ callers
    that bypass the dispatcher (DDP's reducer) neither."""

    def __init__(self) -> None:
        super().__init__()
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = func.__name__.split(".")[0]
        if func.namespace == "aten" and name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0] if name == "copy_" else out
            if isinstance(src, torch.Tensor) and src.device.type != dst.device.type:
                nbytes = dst.numel() * dst.element_size()
                if src.device.type == "cpu":
                    self.h2d_bytes += nbytes
                elif dst.device.type == "cpu":
                    self.d2h_bytes += nbytes
        return out
