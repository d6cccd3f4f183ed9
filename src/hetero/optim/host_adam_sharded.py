"""ZeRO-Offload: HostAdamW with its state sharded over the data-parallel ranks.

With ``N`` ranks each host keeps the fp32 master weights and both moments of ``1/N`` of every
parameter (elements ``[r c, (r + 1) c)`` of its flat view, ``c = ceil(numel / N)``). Gradients
stream to the host as backward produces them, exactly as in :class:`HostAdamW`; per bucket, in
the same order on every rank, they are reduce-scattered (each rank receives the sum of its
elements), the fused kernel updates the rank's shard, and the new low-precision weights are
all-gathered into every rank's device parameter. Host memory for the state drops from 12 to
``12 / N`` bytes per parameter; N ranks on B/N samples equal one process on B. Reference:
Ren et al. 2021 (ZeRO-Offload); Rajbhandari et al. 2020 (ZeRO); DeepSpeed's
``DeepSpeedCPUAdam`` with ``offload_optimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hetero.optim.host_adam import HostAdamW
from hetero.optim.host_state import HostOffloadConfig, _host_buffer, _Slot, _sum_over


class ShardedHostAdamW(HostAdamW):
    """:class:`HostAdamW` whose masters and moments are sharded over ``process_group`` (see the
    module docstring). Arguments, thread contract and errors as :class:`HostAdamW`.

    ``state_dict()`` gathers the shards (every rank gets the whole state, the same format as
    :class:`HostAdamW`'s: a checkpoint moves between the two and across world sizes; a
    collective, as :meth:`master` is); ``load_state_dict()`` keeps this rank's elements.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, config: HostOffloadConfig = HostOffloadConfig(),
                 process_group: dist.ProcessGroup | None = None, norm_group: dist.ProcessGroup | None = None) -> None:
        on = dist.is_available() and dist.is_initialized()
        group = process_group if process_group is not None else (dist.group.WORLD if on else None)
        self._rank = dist.get_rank(group) if on else 0
        self._ranks = dist.get_world_size(group) if on else 1
        super().__init__(params, lr, betas, eps, weight_decay, config=config, process_group=process_group,
                         norm_group=norm_group)
        cuda = torch.cuda.is_available()
        # Each bucket's shards are views of one buffer: its reduce-scatter's output and its
        # all-gather's input, one collective each (the comm fusion). Its input and output is the
        # rank-major packing of the bucket's gradients: ``self._fused[b]`` viewed (ranks, sum of chunks).
        self._shards: list[Tensor] = []
        for bucket in self._buckets:
            chunks = [self._chunk(sl.param.numel()) for sl in bucket]
            flat = _host_buffer(sum(chunks), bucket[0].grad.dtype, cuda).zero_()
            for sl, part in zip(bucket, flat.split(chunks)):
                sl.shard = part
            self._shards.append(flat)

    # ------------------------------------------------------------------------- layout
    def _chunk(self, n: int) -> int:
        return -(-n // self._ranks)

    def _owned(self, n: int) -> slice:
        c = self._chunk(n)
        lo = min(self._rank * c, n)
        return slice(lo, min(lo + c, n))

    def _grad_elements(self, n: int) -> int:
        return self._chunk(n) * self._ranks  # padded: every rank's chunk has the same length

    def _reduced_grad(self, slot: _Slot) -> Tensor:
        return slot.shard[: slot.master.numel()]

    def _global_sum_of_squares(self, total: float, finite: bool) -> tuple[float, bool]:
        return _sum_over(self._group, total, finite)  # each rank summed its shards only

    # ------------------------------------------------------------------------- exchange
    def _exchange(self, bucket: int) -> None:
        """Reduce-scatter the bucket's gradients, one collective: each rank receives the sum over
        the ranks of its elements of every slot (a slot no rank got a gradient for sends zeros:
        arrivals are agreed first, and its update is skipped)."""
        slots = self._buckets[bucket]
        if self._world == 1:
            for sl in slots:
                sl.shard.copy_(sl.grad)
            return
        if len(slots) == 1:
            dist.reduce_scatter_tensor(slots[0].shard, slots[0].grad, group=self._group)
            return
        packed = self._packed(bucket)
        for sl, part in zip(slots, self._columns(bucket, packed)):
            part.copy_(sl.grad.view(self._ranks, -1))  # rank r's chunk of every slot, together
        dist.reduce_scatter_tensor(self._shards[bucket], packed.view(-1), group=self._group)

    def _packed(self, bucket: int) -> Tensor:
        return self._fused[bucket].view(self._ranks, -1)

    def _columns(self, bucket: int, packed: Tensor) -> list[Tensor]:
        return list(packed.split([sl.shard.numel() for sl in self._buckets[bucket]], dim=1))

    def _update_bucket(self, bucket: int, grad_scale: float) -> None:
        slots = [sl for sl in self._buckets[bucket] if sl.arrived]  # no gradient on any rank: skip, as torch does
        for slot in slots:
            mine = slot.shard[: slot.master.numel()]
            in_place = self._adam_step(slot, mine, grad_scale)  # bf16 or fp32: the new weights over ``mine``
            if not in_place:  # fp16 device weights: gather the fp32 values, the copy rounds them
                mine.copy_(slot.master)
        if not slots:
            return
        # every rank's new weights into every rank: one all-gather per bucket (every rank skips the same slots)
        if self._world == 1:
            for slot in slots:
                slot.grad.copy_(slot.shard)
        elif len(self._buckets[bucket]) == 1:
            dist.all_gather_into_tensor(slots[0].grad, slots[0].shard, group=self._group)
        else:
            packed = self._packed(bucket)
            dist.all_gather_into_tensor(packed.view(-1), self._shards[bucket], group=self._group)
            for sl, part in zip(self._buckets[bucket], self._columns(bucket, packed)):
                if sl.arrived:
                    sl.grad.view(self._ranks, -1).copy_(part)
        for slot in slots:
            whole = slot.grad[: slot.param.numel()]
            if slot.param.device.type == "cpu":
                slot.param.data.view(-1).copy_(whole)  # rounds fp32 to fp16 where the device keeps fp16
            else:
                self._upload(slot, whole)
            slot.arrived = False

    # ------------------------------------------------------------------------- state
    def _gather(self, shard: Tensor, n: int) -> Tensor:
        """The whole flat ``n``-element tensor from every rank's shard (collective)."""
        c = self._chunk(n)
        padded = torch.zeros(c, dtype=shard.dtype)
        padded[: shard.numel()] = shard
        if self._world == 1:
            return padded[:n].clone()
        out = torch.empty(c * self._ranks, dtype=shard.dtype)
        dist.all_gather_into_tensor(out, padded, group=self._group)
        return out[:n]

    def master(self, param: Tensor) -> Tensor:
        """The whole fp32 master weight of ``param``, gathered from the ranks' shards (collective)."""
        return self._gather(self._slots[param].master, param.numel()).view(param.shape)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        for slot in self._slots.values():
            st = out["state"][slot.name]
            for key in ("master", "exp_avg", "exp_avg_sq"):
                st[key] = self._gather(getattr(slot, key), slot.param.numel())
        return out
