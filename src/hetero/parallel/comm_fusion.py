"""Communication fusion: how many tensors one collective carries.

Many small collectives cost a latency each; one huge collective cannot start until its last
tensor is ready. Fusion groups tensors into buckets: each bucket is one collective, launched once
all of its tensors are ready. :class:`CommFusion` sets the bucket size per collective kind, as the
reference design's ``comm_fusion`` does: ``auto`` (64 MB buckets), a size in MB, or, for
all-reduce, an index list (the parameter indices, in registration order, where a new bucket
starts). Where each setting applies:

- ``allreduce``: DDP's gradient buckets (a size: DDP's own ``bucket_cap_mb``; an index list: one
  parameter per DDP bucket and a comm hook that fuses them as listed), :class:`HostAdamW`'s
  buckets (each bucket one all-reduce of its host gradients, overlapping backward).
- ``allgather``: FSDP2 units (ZeRO stages 2, 3) when no units are named - consecutive modules
  grouped to the size of the smaller of ``allgather`` and ``reducescatter`` (a unit is one
  all-gather and one reduce-scatter); the replicated host tables' sparse-gradient exchange (one
  all-gather per bucket of table groups).
- ``reducescatter``: :class:`ShardedHostAdamW`'s buckets (one reduce-scatter and one all-gather
  each) and the FSDP2 units above.

Bucket sizes count the bytes a collective carries, closing a bucket once it reaches the size
(DDP's rule), in the order the collectives are issued (backward order: last parameters first).
Reference: MindSpore's ``comm_fusion`` / ``all_reduce_fusion_config``; PyTorch DDP's gradient
bucketing (Li et al., "PyTorch Distributed", VLDB 2020).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Union

import torch
import torch.distributed as dist
from torch import Tensor

from hetero.optim import HostOffloadConfig

MB = 1 << 20
AUTO_BUCKET_MB = 64.0


class FusionMode(enum.Enum):
    """A fusion setting that is not a number: let hetero choose (:data:`AUTO_BUCKET_MB` buckets)."""

    AUTO = "auto"


Fusion = Union[float, tuple[int, ...], FusionMode]


@dataclasses.dataclass(frozen=True)
class CommFusion:
    """Bucket sizes per collective kind (see the module docstring for where each applies).

    Attributes:
        allreduce: ``FusionMode.AUTO``, a bucket size in MB (> 0), or a tuple of parameter indices
            (registration order, strictly increasing, each in ``(0, number of parameters)``)
            where a new bucket starts: ``(2, 5)`` fuses parameters 0-1, 2-4 and 5-end.
        allgather: ``FusionMode.AUTO`` or a bucket size in MB (> 0).
        reducescatter: ``FusionMode.AUTO`` or a bucket size in MB (> 0).

    Raises:
        ValueError: a size that is not a positive finite number, an index list that is not
            strictly increasing positive integers, or an index list for all-gather or
            reduce-scatter (naming the field and the valid values).
    """

    allreduce: Fusion = FusionMode.AUTO
    allgather: Fusion = FusionMode.AUTO
    reducescatter: Fusion = FusionMode.AUTO

    def __post_init__(self) -> None:
        for field in ("allreduce", "allgather", "reducescatter"):
            value = getattr(self, field)
            if isinstance(value, FusionMode):
                continue
            if isinstance(value, (list, tuple)):
                if field != "allreduce":
                    raise ValueError(f"CommFusion.{field}={value!r}: only allreduce takes an index list; "
                                     f"{field} takes FusionMode.AUTO or a size in MB > 0")
                value = tuple(value)
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in value) or \
                        any(b <= a for a, b in zip((0, *value), value)):
                    raise ValueError(f"CommFusion.allreduce={value!r}: an index list must be strictly increasing "
                                     f"parameter indices > 0, e.g. (2, 5)")
                object.__setattr__(self, field, value)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"CommFusion.{field}={value!r}: valid values are FusionMode.AUTO or a size in MB > 0"
                                 + (" or a tuple of parameter indices" if field == "allreduce" else ""))
            object.__setattr__(self, field, float(value))

    def bucket_mb(self, field: str) -> float | None:
        """``field``'s bucket size in MB (``auto``: :data:`AUTO_BUCKET_MB`); ``None`` for an index list."""
        value = getattr(self, field)
        if isinstance(value, FusionMode):
            return AUTO_BUCKET_MB
        return None if isinstance(value, tuple) else value

    @property
    def unit_mb(self) -> float:
        """The size of an FSDP2 unit: one all-gather and one reduce-scatter, so the smaller size."""
        return min(self.bucket_mb("allgather"), self.bucket_mb("reducescatter"))  # type: ignore[type-var]


def by_size(sizes: Sequence[int], limit_mb: float) -> list[list[int]]:
    """Consecutive groups of ``sizes`` (bytes, in issue order), each closed once it reaches
    ``limit_mb`` MB; returns the indices into ``sizes``."""
    limit = limit_mb * MB
    groups: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        groups[-1].append(i)
        total += size
        if total >= limit:
            groups.append([])
            total = 0
    return [g for g in groups if g]


def gradient_buckets(sizes: Sequence[int], setting: Fusion, ready: Sequence[int] | None = None) -> list[list[int]]:
    """The gradient buckets of parameters with ``sizes`` (bytes, registration order) in the
    order they are reduced; each bucket lists registration indices in the order its gradients
    arrive. ``ready``: the registration indices in the order backward produces their gradients
    (DDP rebuilds its size buckets in that order after the first step); default: reverse
    registration order. An index list's buckets are complete in the order of their last gradient.

    Raises:
        ValueError: an index list reaching past the parameters (naming both).
    """
    n = len(sizes)
    if isinstance(setting, tuple):
        if setting and setting[-1] >= n:
            raise ValueError(f"CommFusion.allreduce index {setting[-1]} is past the last parameter: the model has "
                             f"{n} parameters (indices 1..{n - 1} start a bucket)")
        bounds = (0, *setting, n)
        if ready is None:
            return [list(range(hi - 1, lo - 1, -1)) for lo, hi in reversed(list(zip(bounds, bounds[1:])))]
        position = {i: k for k, i in enumerate(ready)}
        buckets = [sorted(range(lo, hi), key=position.__getitem__) for lo, hi in zip(bounds, bounds[1:])]
        return sorted(buckets, key=lambda b: position[b[-1]])
    limit = AUTO_BUCKET_MB if isinstance(setting, FusionMode) else setting
    backward = list(ready) if ready is not None else list(range(n - 1, -1, -1))
    return [[backward[i] for i in g] for g in by_size([sizes[j] for j in backward], limit)]


def host_offload_config(fusion: CommFusion, config: HostOffloadConfig, *, sharded: bool = False) -> HostOffloadConfig:
    """``config`` with :class:`HostAdamW`'s buckets set by ``fusion``: its ``allreduce`` setting,
    or ``reducescatter`` for :class:`ShardedHostAdamW` (``sharded=True``)."""
    setting = fusion.reducescatter if sharded else fusion.allreduce
    if isinstance(setting, tuple):
        return dataclasses.replace(config, bucket_starts=setting)
    mb = fusion.bucket_mb("reducescatter" if sharded else "allreduce")
    return dataclasses.replace(config, bucket_bytes=int(mb * MB), bucket_starts=())


class IndexFusedAllReduce:
    """A DDP comm hook that fuses one-parameter DDP buckets into the buckets of an index list.

    DDP is built with one parameter per bucket; each bucket's hook call parks its gradient and
    returns a future; once every parameter of an index-list bucket has arrived, one all-reduce
    carries them all and completes their futures. DDP runs the hooks in bucket order, the same on
    every rank, so the fused all-reduces are issued in the same order everywhere.

    Thread contract: DDP calls the hook from backward's thread; the futures complete on the
    process group's thread. Gradients are divided by the group size before the all-reduce
    (``mean``: DDP's default hook's order) or summed.
    """

    def __init__(self, params: list[Tensor], starts: tuple[int, ...], group: dist.ProcessGroup, mean: bool) -> None:
        buckets = gradient_buckets([0] * len(params), starts)
        self._bucket_of = {params[i]: b for b, idx in enumerate(buckets) for i in idx}  # keyed by the tensor, as torch.optim's state
        self._sizes = [len(idx) for idx in buckets]
        self._waiting: list[list[tuple[torch.futures.Future, Tensor]]] = [[] for _ in buckets]
        self._group, self._mean = group, mean

    @staticmethod
    def hook(state: "IndexFusedAllReduce", bucket):  # noqa: ANN001, ANN205 - DDP checks these annotations as
        # objects, which string annotations (this module's __future__ import) are not
        """The DDP comm hook (``ddp.register_comm_hook(state, IndexFusedAllReduce.hook)``): takes a
        ``dist.GradBucket`` of one parameter, returns a ``torch.futures.Future[Tensor]``."""
        (param,) = bucket.parameters()
        b = state._bucket_of[param]
        fut: torch.futures.Future = torch.futures.Future()
        state._waiting[b].append((fut, bucket.buffer()))
        if len(state._waiting[b]) == state._sizes[b]:
            state._launch(b)
        return fut

    def _launch(self, b: int) -> None:
        waiting, self._waiting[b] = self._waiting[b], []
        flat = torch.cat([buf.reshape(-1) for _, buf in waiting])  # the fused bucket: one copy of its gradients
        if self._mean:
            flat.div_(dist.get_world_size(self._group))

        def scatter(done: torch.futures.Future) -> None:
            reduced = done.value()[0]
            offset = 0
            for fut, buf in waiting:
                # a copy, not a view: DDP cuts a bucket's result with as_strided from storage offset 0
                fut.set_result(reduced[offset : offset + buf.numel()].clone())
                offset += buf.numel()

        dist.all_reduce(flat, group=self._group, async_op=True).get_future().then(scatter)
