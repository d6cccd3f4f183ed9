"""Data parallelism: dense parameters through DDP; host tables replicated or row-sharded.

Every rank holds the whole model and reads its shard of the data (see ``BatchConfig``'s
``rank``/``world_size``). Dense (device) parameters are synchronised by
``DistributedDataParallel``, whose gradient buckets are the comm fusion of the reference design
(``fusion.allreduce``: :mod:`hetero.parallel.comm_fusion`); gradients are averaged (``gradients_mean=True``) or summed. Host tables are
either replicated - after backward each rank all-gathers every group's sparse gradient (unique
rows and their coalesced gradients, padded to the largest rank's row count), sums them in rank
order and scales like the dense gradients, so every replica applies the same update and stays
identical - or row-sharded (:func:`~hetero.parallel.row_sharded.shard_rows`: all-to-all of ids,
rows and gradients). :class:`DistributedSparse` handles both. With world size 1 all of this is
skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence, Set
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetero.embedding import HostEmbedding, RowPlacement, RowSpace, SparseGrad, host_tables
from hetero.optim import SparseOptimizer
from hetero.parallel.comm_fusion import CommFusion, IndexFusedAllReduce, by_size
from hetero.parallel.env import DataParallelGroup, host_group
from hetero.parallel.replicated_keys import gather_keys
from hetero.parallel.sharded_keys import rehome_state
from hetero.parallel.row_sharded import (
    RowSharding,
    gather_rows,
    local_table_rows,
    reduce_gradients,
    table_rows,
)


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    """How the dense part of a model trains data-parallel.

    Attributes:
        fusion: DDP's gradient buckets (its ``allreduce``) and the replicated tables'
            sparse-gradient all-gathers (its ``allgather``); see :class:`CommFusion`.
        gradients_mean: average the gradients over the ranks (else sum them).
        dense_sharded: the dense part is sharded by ZeRO stage 2 or 3 (FSDP2, which
            reduce-scatters its own gradients): no DDP wrapper.
    """

    fusion: CommFusion = CommFusion()
    gradients_mean: bool = True
    dense_sharded: bool = False


def data_parallel(model: nn.Module, config: DataParallelConfig = DataParallelConfig(),
                  host: Set[torch.Tensor] = frozenset(), group: DataParallelGroup = DataParallelGroup()) -> nn.Module:
    """Wrap ``model`` for data parallelism over ``group`` (default: the whole job); the model
    itself on a group of one rank.

    Host tables are left out of DDP: they are not broadcast (ranks build them identically from
    the same seed; :func:`check_replicas` verifies it) and their gradients go through
    :class:`DistributedSparse`. So are the parameters and buffers in ``host`` (a partitioned
    model's host units: DDP takes one device type; their gradients go through
    :class:`HostReplicaOptimizer`).
    """
    if not group.active or config.dense_sharded:
        return model
    # Host tables stay out of DDP, and so do their zero-size device anchors: a model whose only
    # buffers they are then needs no buffer broadcast before every forward (measured 11 ms per
    # step with 4 processes on 2 cores).
    ignore = [f"{name}.{attr}" for name in host_tables(model) for attr in ("weight", "_device_anchor")]
    if host:  # by the names DDP matches: a parameter's module path, a buffer's as named_buffers gives it
        ignore += [f"{m}.{n}" for m, module in model.named_modules() for n, p in module.named_parameters(recurse=False)
                   if p in host] + [n for n, b in model.named_buffers() if b in host]  # (tensors hash by identity)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    ignored = set(ignore)
    dense = [p for name, p in model.named_parameters() if name not in ignored and p.requires_grad]
    device_ids = [torch.cuda.current_device()] if dense and dense[0].is_cuda else None
    pg = group.group
    setting = config.fusion.allreduce
    if isinstance(setting, tuple):  # an index list: one parameter per DDP bucket, fused by the comm hook
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb_list=[1e-9],
                                                  process_group=pg)
        ddp.register_comm_hook(IndexFusedAllReduce(dense, setting, pg, config.gradients_mean),
                               IndexFusedAllReduce.hook)
        return ddp
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=pg,
                                              bucket_cap_mb=config.fusion.bucket_mb("allreduce"))
    if not config.gradients_mean:
        ddp.register_comm_hook(pg, _sum_hook)
    return ddp


def _sum_hook(group, bucket):  # noqa: ANN001 - DDP comm hook signature (state: the process group)
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class HostReplicaOptimizer:
    """A torch optimizer over host parameters that every data-parallel rank holds (a partitioned
    model's host units, which DDP does not take): :meth:`step` first averages (or sums) their
    gradients over the ranks, then steps, so every replica applies the same update.

    A parameter with no gradient here contributes zeros; it gets the averaged gradient when any
    rank produced one (one process on the global batch would have), else stays without one
    (torch's optimizer skips it, as it would). One all-reduce per step of one flat float32 host
    buffer (every gradient, then one arrival count per parameter) on ``group`` (gloo; ``None``:
    :func:`~hetero.parallel.env.host_group`), on the calling thread. After the update the host
    units' ``buffers`` (BatchNorm's running statistics, each rank's from its own share) are
    broadcast from the group's first rank, one collective per device and dtype: DDP's rule for
    the device part's buffers (``broadcast_buffers``), so the replicas keep one set (a model
    without DDP - its optimizer state on the host - passes its device buffers here too). Reference: DDP's
    gradient averaging and buffer broadcast (Li et al., PyTorch Distributed, VLDB 2020).

    Args:
        optimizer: torch's optimizer over the host parameters (CPU tensors); ``None`` when the
            host units hold buffers only.
        config: ``gradients_mean`` (else the sum) of :class:`DataParallelConfig`.
        group: the data-parallel ranks (gloo).
        buffers: the buffers to keep equal over the ranks (the host units'; CPU or device
            tensors, in the same order on every rank), overwritten in place at each step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: DataParallelConfig = DataParallelConfig(),
                 group: dist.ProcessGroup | None = None, buffers: Sequence[torch.Tensor] = ()) -> None:
        self.optimizer, self.config = optimizer, config
        self.group = group if group is not None else host_group()
        self.params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self.buffers = list(buffers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        # several ranks in the group (none without a process group: a single process)
        replicas = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1
        if self.optimizer is not None:
            if replicas:
                self._reduce()
            self.optimizer.step()
        if replicas and self.buffers:
            self._broadcast_buffers()

    def _broadcast_buffers(self) -> None:
        kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for b in self.buffers:
            kinds.setdefault((b.device, b.dtype), []).append(b)
        for buffers in kinds.values():
            # the copy: one collective per device and dtype, not per buffer (gloo broadcasts CUDA tensors too)
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, group=self.group, group_src=0)
            for b, part in zip(buffers, flat.split([b.numel() for b in buffers])):
                b.copy_(part.view_as(b))

    def _reduce(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        arrived = [float(p.grad is not None) for p in self.params]
        # the copy into one buffer: one collective's latency per step, not one per parameter
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [torch.tensor(arrived)])
        dist.all_reduce(flat, group=self.group)
        if self.config.gradients_mean:
            flat[: flat.numel() - len(arrived)] /= dist.get_world_size(self.group)
        counts = flat[flat.numel() - len(arrived):].tolist()
        for p, part, n in zip(self.params, flat.split([g.numel() for g in grads] + [len(arrived)]), counts):
            p.grad = part.view_as(p).to(p.dtype) if n > 0 else None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict() if self.optimizer is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state)


def check_replicas(model: nn.Module, group: DataParallelGroup = DataParallelGroup()) -> None:
    """Raise ``ValueError`` if a replicated host table differs between the ranks of ``group``
    (a CRC-32 of its bytes, read in place block by block: no copy of a table, which may be most
    of host memory). Tables whose rows are not all here (row-sharded, on parameter servers) are
    left out: their parts differ by design. Collective over ``group``."""
    if not group.active:
        return
    tables = host_tables(model)
    names = [name for name, t in tables.items() if t.group.exchange.placement is RowPlacement.LOCAL]
    local = torch.tensor([_table_crc(tables[name]) for name in names], dtype=torch.int64)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group.host_group())  # max == min on every rank iff all equal
    for name, hi, neg_lo in zip(names, both[: len(names)].tolist(), both[len(names) :].tolist()):
        if hi != -neg_lo:
            raise ValueError(f"host table {name!r} differs between ranks; build the model with the same seed on every rank")


def _table_crc(table: HostEmbedding, rows_per_block: int = 1 << 16) -> int:
    """CRC-32 of a host table's rows, fed block by block from views of the table (no copy), or
    read block by block from the SSD tier."""
    crc, rows = 0, table.config.num_rows
    for lo in range(0, rows, rows_per_block):
        n = min(rows_per_block, rows - lo)
        block = table.group.ssd_read(table.group_row + lo, n, ("weight",))["weight"] if table.group.ssd_config is not None \
            else table.weight.detach()[lo : lo + n]
        if block.dtype in (torch.bfloat16, torch.float16):
            block = block.view(torch.int16)  # numpy has no bf16: the same bytes as int16
        crc = zlib.crc32(memoryview(block.numpy()).cast("B"), crc)
    return crc


class DistributedSparse:
    """A sparse optimizer over tables that are replicated or row-sharded across the ranks.

    ``step()`` first exchanges the sparse gradients: a replicated group gets the sum (or mean)
    over all ranks, so every replica applies the same update; a row-sharded group sends each
    gradient row to its owner (see :mod:`hetero.parallel.row_sharded`). ``state_dict()`` holds
    full tables' state (a collective: every rank calls it); ``load_state_dict()`` takes a full
    state and keeps this rank's rows, so it loads at any world size.

    Args:
        group: the data-parallel ranks (default: the whole job); row-sharded tables span the
            whole job (:func:`~hetero.parallel.row_sharded.shard_rows`).
    """

    def __init__(self, optimizer: SparseOptimizer, config: DataParallelConfig = DataParallelConfig(),
                 group: DataParallelGroup = DataParallelGroup()) -> None:
        self.optimizer, self.config, self.group = optimizer, config, group
        if group.active:
            for g in optimizer.groups:
                if g.exchange.placement is RowPlacement.LOCAL:  # replicated: every rank admits every rank's keys
                    g.dynamic.gather = functools.partial(gather_keys, group)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        if self.group.active:
            groups = self.optimizer.groups
            sharded = [g for g in groups if isinstance(g.exchange, RowSharding)]
            replicated = [g for g in groups if not isinstance(g.exchange, RowSharding)]
            assert all(g.exchange.placement is RowPlacement.LOCAL for g in replicated), replicated
            # row-sharded groups: one all-to-all of all their gradient rows (row_sharded.reduce_gradients)
            grads = reduce_gradients([g.exchange for g in sharded], [g.dim for g in sharded], self.config.gradients_mean)
            for group, grad in zip(sharded, grads):
                if group.dynamic.frozen.shape[0]:  # (a dynamic table's default row takes no update, nor counts one)
                    grad = grad.without(group.dynamic.frozen)
                if grad.ids.numel() == 0 and group.exchange.touched:
                    self.optimizer.count_step(group)  # the table's other shards step: keep the count equal
                group.pending.set(grad)
            if replicated:
                local = [g.pending.take() or SparseGrad.empty(g.dim, RowSpace.GROUP) for g in replicated]
                for group, grad in zip(replicated, self._all_reduce(local)):
                    group.pending.set(grad)
        self.optimizer.step()

    def _all_reduce(self, grads: list[SparseGrad]) -> list[SparseGrad]:
        """The sum (or mean) over the ranks of each replicated group's sparse gradient: one
        all-gather of every group's row count, then one all-gather per ``fusion.allgather``
        bucket of groups (ids and rows padded to the longest rank's count, the int64 ids carried
        bit for bit as float32 pairs), summed in rank order - the same sum on every rank."""
        n = self.group.size
        group = self.group.host_group()  # host tensors: gloo even when NCCL is the default
        counts = torch.empty(n * len(grads), dtype=torch.int64)
        dist.all_gather_into_tensor(counts, torch.tensor([g.ids.numel() for g in grads]), group=group)
        counts = counts.view(n, len(grads))
        longest = counts.max(0).values.tolist()
        width = [2 * c + c * g.rows.shape[1] for c, g in zip(longest, grads)]  # float32 words per group and rank
        out: list[SparseGrad] = []
        for bucket in by_size([4 * w for w in width], self.config.fusion.bucket_mb("allgather")):
            send = torch.zeros(sum(width[i] for i in bucket))
            offset = 0
            for i in bucket:
                g, c = grads[i], longest[i]
                k = g.ids.numel()
                send[offset : offset + 2 * k] = g.ids.contiguous().view(torch.float32)  # the int64 bits, not their values
                send[offset + 2 * c : offset + 2 * c + g.rows.numel()] = g.rows.reshape(-1)
                offset += width[i]
            got = torch.empty(n * send.numel())
            dist.all_gather_into_tensor(got, send, group=group)
            got = got.view(n, -1)
            offset = 0
            for i in bucket:
                c, dim = longest[i], grads[i].rows.shape[1]
                part = got[:, offset : offset + width[i]]
                # each rank's part (ids: an aligned copy of their bits), summed in rank order: the same
                # sum on every rank
                summed = SparseGrad.coalesce([SparseGrad(part[r, : 2 * int(counts[r, i])].clone().view(torch.int64),
                                                         part[r, 2 * c : 2 * c + int(counts[r, i]) * dim].view(-1, dim),
                                                         RowSpace.GROUP) for r in range(n)])
                if self.config.gradients_mean:
                    summed = SparseGrad(summed.ids, summed.rows / n, RowSpace.GROUP)
                out.append(summed)
                offset += width[i]
        return out

    def state_dict(self, include_state: bool = True):
        state = self.optimizer.state_dict(include_state)
        if not include_state:
            return state
        opt = self.optimizer
        for group in opt.groups:
            if not isinstance(group.exchange, RowSharding) or not group.rows_in_state_dict:
                continue
            for s, x in opt.group_state[group].items():
                if group.ssd_config is not None:  # (one field at a time: the copies a checkpoint holds at once)
                    x = group.ssd_read(0, group.num_rows, (s,))[s]
                full = gather_rows(x, group.exchange.global_rows)
                for name, t in opt.tables.items():
                    if t.group is group:
                        state["state"][name][s] = table_rows(t, full)
        return state

    def load_state_dict(self, state):
        opt = self.optimizer
        if "state" not in state:  # counts only: a sharded checkpoint loaded the rows in place
            opt.load_state_dict(state)
            return
        local = {name: dict(tensors) for name, tensors in state["state"].items()}
        for name, t in opt.tables.items():
            if isinstance(t.group.exchange, RowSharding) and name in local:
                # (a row-sharded dynamic table's keys given rows at this world size: the state moves with them)
                local[name] = {s: local_table_rows(t, rehome_state(t, x, opt.state_initial(s)))
                               for s, x in local[name].items()}
                if t.key_shard is not None:
                    t.key_shard.rehomed = None
        self.optimizer.load_state_dict({**state, "state": local})
