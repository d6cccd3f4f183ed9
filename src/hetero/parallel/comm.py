"""Collectives and their bytes: one cost definition for what the planner predicts and for what a
run actually sends.

Bytes are counted per rank as the ring algorithms move them (NCCL's and gloo's large-message
algorithms; Patarasuk & Yuan 2009, Thakur et al. 2005): for a group of ``n`` ranks and a local
input of ``L`` bytes, all-gather receives ``L (n - 1)``, all-reduce ``2 L (n - 1) / n``,
reduce-scatter ``L (n - 1) / n``, all-to-all ``L (n - 1) / n``.

:class:`CollectiveCounter` counts them on a running program: a ``TorchDispatchMode`` that sees
every functional collective (``torch.ops._c10d_functional``, which DTensor's ``redistribute``,
``parallelize_module`` and ``loss_parallel`` issue) with its real input tensor and group. Reference:
torch's ``CommDebugMode`` (which counts calls, not bytes).
"""

from __future__ import annotations

import dataclasses
import enum
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


def collective_bytes(kind: Collective, local_bytes: float, n: int) -> float:
    """Bytes one rank receives in ``kind`` over ``n`` ranks with a local input of ``local_bytes``."""
    if n <= 1:
        return 0.0
    if kind is Collective.ALL_GATHER:
        return local_bytes * (n - 1)
    if kind is Collective.ALL_REDUCE:
        return 2 * local_bytes * (n - 1) / n
    return local_bytes * (n - 1) / n  # reduce-scatter, all-to-all


# functional collective op name -> (kind, index of the group-name argument)
_OPS = {
    "all_gather_into_tensor": (Collective.ALL_GATHER, 2),
    "all_reduce": (Collective.ALL_REDUCE, 2),
    "reduce_scatter_tensor": (Collective.REDUCE_SCATTER, 3),
    "all_to_all_single": (Collective.ALL_TO_ALL, 3),
}


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


class CollectiveCounter(TorchDispatchMode):
    """Record every functional collective issued inside ``with CollectiveCounter() as c:``.

    Thread contract: a dispatch mode is per thread; collectives issued by other threads (the
    host optimizer's worker, DDP's reducer, which use ``torch.distributed`` directly) are not
    seen. ``calls`` lists them in issue order; ``total_bytes`` sums their per-rank bytes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in _OPS:
            kind, group_arg = _OPS[func.__name__.split(".")[0]]
            x = args[0]
            group = dist.distributed_c10d._resolve_process_group(args[group_arg])
            n = dist.get_world_size(group)
            nbytes = x.numel() * x.element_size()
            self.calls.append(CollectiveCall(kind, n, nbytes, collective_bytes(kind, nbytes, n)))
        return func(*args, **(kwargs or {}))

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes for c in self.calls)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per collective kind: ``{"calls": ..., "bytes": ...}``."""
        out: dict[str, dict[str, float]] = {}
        for c in self.calls:
            row = out.setdefault(c.kind.value, {"calls": 0, "bytes": 0.0})
            row["calls"] += 1
            row["bytes"] += c.bytes
        return out

