"""Row-sharded host tables: each rank's host memory holds 1/N of every table's rows.

The rows of a table group (its global row space, see :class:`~hetero.embedding.group.TableGroup`)
are cut into N contiguous blocks of ``ceil(rows / N)`` rows, rank ``r`` holding block ``r`` -
``torch.chunk``'s rule, which is also ``DTensor``'s ``Shard(0)``, so a distributed checkpoint
can describe a shard as a DTensor and load it into another world size. A table therefore grows
with the number of hosts: each rank stores at most ``ceil(rows / N)`` rows and their optimizer
state. (Block partitioning puts a vocabulary's hot low ids on one rank unless ids are hashed;
TorchRec's row-wise sharding makes the same choice.)

A lookup on every rank (the same tables in the same order, as data parallelism guarantees):

1. check and dedup the batch's ids locally (a radix sort, the result of ``torch.unique``);
2. all-to-all of the unique ids, bucketed by owner rank (counts first, then ids);
3. each owner gathers the requested rows from its shard; all-to-all of the rows back;
4. pool / expand on the device as usual (``F.embedding_bag``); backward yields one coalesced
   gradient row per unique id, kept with the routing of step 2.

The optimizer step (:class:`DistributedSparse`) sends each rank's gradient rows back to their
owners with the reverse all-to-all; an owner sums what it receives in rank order (then divides by
N with ``gradients_mean``) and applies its sparse optimizer to its shard only. The collectives run
in ``forward`` and ``step``, never inside backward, so they cannot interleave with DDP's
all-reduces differently on different ranks. This is TorchRec's row-wise sharding on host memory
(Ivchenko et al., "TorchRec: a PyTorch domain library for recommendation systems", RecSys 2022).

At world size 1 nothing is sharded (one shard is the table).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hetero.embedding import RowExchange, RowPlacement, RowSpace, SparseGrad, host_tables
from hetero.embedding.group import TableGroup
from hetero.embedding.plan import LookupPlan, Request
from hetero.placement import copy_to, host_empty
from hetero.storage import SsdRows
from hetero.parallel.env import active, host_group, rank, world_size
from hetero.parallel.sharded_keys import shard_keys


def block_range(rows: int, r: int, n: int) -> tuple[int, int]:
    """Global rows ``[lo, hi)`` of a ``rows``-row group that rank ``r`` of ``n`` holds."""
    block = -(-rows // n)
    return min(r * block, rows), min((r + 1) * block, rows)


@dataclasses.dataclass
class _Routed:
    """One lookup's routing, kept for the gradient's way back to the owners."""

    order: Tensor  # (U,) permutation of the unique ids that sorts them by owner rank
    send_counts: list[int]  # ids (and later gradient rows) this rank sends to each rank
    recv_counts: list[int]  # ids this rank received from each rank, as owner
    local_rows: Tensor  # (sum recv_counts,) local shard rows of the received ids
    live: int  # unique ids that take an update (a dynamic table's default row takes none)
    grad: Tensor | None = None  # (U, D) coalesced gradient of the unique rows, once backward ran


class RowSharding(RowExchange):
    """The exchange of one row-sharded table group (``group.exchange``); see the module docstring.

    Its ``routes`` are this step's lookups awaiting their gradient; :func:`reduce_gradients` sends
    the gradients to their owners and returns this shard's (``RowSpace.LOCAL`` rows).
    """

    placement = RowPlacement.ROW_SHARDED

    def __init__(self, group: TableGroup, global_rows: int) -> None:
        self.rank, self.world = rank(), world_size()
        self._global_rows = global_rows
        self.block = -(-global_rows // self.world)  # rows per rank (the last may hold fewer)
        self.lo, self.hi = block_range(global_rows, self.rank, self.world)
        self.routes: list[_Routed] = []
        self.touched = False  # whether the last reduce_gradients saw rows of this group on any rank
        self.group = host_group()  # the rows and ids are host tensors: gloo even when NCCL is the default
        self.frozen = torch.from_numpy(group.dynamic.frozen.copy())  # (dynamic tables' default rows: group rows)

    @property
    def global_rows(self) -> int:
        return self._global_rows

    def clear(self) -> None:
        self.routes = []

    def lookup(self, group: TableGroup, requests: list[Request], plan: LookupPlan | None) -> list[Tensor]:
        assert plan is None, "a row-sharded lookup is a collective: it is never prefetched"
        anchor = requests[0].table._device_anchor
        plan = group.plan(requests)  # ids checked (IndexError before any communication) and deduplicated
        unique, n = plan.unique, self.world
        owner = unique // self.block
        order = torch.argsort(owner, stable=True)  # identity for torch.unique's sorted ids; any dedup order works
        send_counts = torch.bincount(owner, minlength=n)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # how many ids each rank asks of this one
        send, recv = send_counts.tolist(), recv_counts.tolist()
        asked = torch.empty(sum(recv), dtype=torch.int64)
        dist.all_to_all_single(asked, unique[order], recv, send, group=self.group)
        local_rows = asked - self.lo
        served = group.read_rows(local_rows).float()  # the rows this rank owns and was asked for
        got = torch.empty(unique.numel(), group.dim)
        dist.all_to_all_single(got, served, send, recv, group=self.group)
        rows = torch.empty_like(got)
        rows[order] = got  # back to the order of ``unique``
        live = unique.numel() - (int(torch.isin(unique, self.frozen).sum()) if self.frozen.numel() else 0)
        routed = _Routed(order, send, recv, local_rows, live)
        rows = copy_to(rows, anchor.device).to(anchor.dtype)  # host -> device: U rows
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(lambda grad, routed=routed: self._capture(routed, grad))
            self.routes.append(routed)
        return plan.pool(rows)

    @staticmethod
    def _capture(routed: _Routed, grad: Tensor) -> None:
        # Runs inside backward: only keep the coalesced gradient; the exchange runs in step().
        routed.grad = grad.detach().to("cpu", torch.float32)  # device -> host (sync point on CUDA)



def reduce_gradients(exchanges: list[RowSharding], dims: list[int], mean: bool) -> list[SparseGrad]:
    """Send every pending lookup's gradient rows of every group to their owners; return each
    group's summed gradient of this shard (local rows). Every rank calls it with the same groups
    in the same order, each with the same number of pending lookups.

    Fused: one all-reduce for all groups' ``touched`` flags and one all-to-all for all groups'
    gradient rows (each destination's segment holds every group's rows for it, group by group):
    a step's row exchange is one collective whatever the number of tables. No size limit splits
    it: the row counts differ per rank, and a split must be the same on every rank.
    """
    if not exchanges:
        return []
    group = exchanges[0].group
    n = exchanges[0].world
    # Whether any rank looked up rows of each group that take an update: a shard that got none still counts the step, as
    # one process would (LazyAdam's bias correction uses the table's step count).
    touched = torch.tensor([sum(r.live for r in ex.routes) for ex in exchanges])
    dist.all_reduce(touched, group=group)
    parts = [(i, dim, routed) for i, (ex, dim) in enumerate(zip(exchanges, dims)) for routed in ex.routes]
    send = [[] for _ in range(n)]  # per destination rank: flat gradient rows, group by group
    for ex, dim, routed in parts:
        grad = routed.grad if routed.grad is not None else torch.zeros(routed.order.numel(), dim)
        for r, rows in enumerate(grad[routed.order].split(routed.send_counts)):
            send[r].append(rows.reshape(-1))
    send_splits = [sum(x.numel() for x in per_rank) for per_rank in send]
    recv_splits = [sum(routed.recv_counts[r] * dim for _, dim, routed in parts) for r in range(n)]
    received = torch.empty(sum(recv_splits))
    if parts:
        dist.all_to_all_single(received, torch.cat([x for per_rank in send for x in per_rank]), recv_splits,
                               send_splits, group=group)
    ids: list[list[Tensor]] = [[] for _ in exchanges]  # per group: the received rows' local ids and gradients
    rows: list[list[Tensor]] = [[] for _ in exchanges]
    offset = 0
    for src in range(n):  # the received rows, source rank by source rank, then group by group as sent
        for i, dim, routed in parts:
            lo = sum(routed.recv_counts[:src])
            count = routed.recv_counts[src]
            ids[i].append(routed.local_rows[lo : lo + count])
            rows[i].append(received[offset : offset + count * dim].view(count, dim))
            offset += count * dim
    out = []
    for i, (ex, dim, hit) in enumerate(zip(exchanges, dims, touched.tolist())):
        ex.touched = bool(hit)
        ex.routes = []
        if not ids[i]:
            out.append(SparseGrad.empty(dim, RowSpace.LOCAL))
            continue
        # summed in the order received (by source rank): the same sum on every run
        summed = SparseGrad.coalesce([SparseGrad(a, b, RowSpace.LOCAL) for a, b in zip(ids[i], rows[i])])
        out.append(SparseGrad(summed.ids, summed.rows / n, RowSpace.LOCAL) if mean else summed)
    return out


def shard_rows(module: nn.Module) -> int:
    """Row-shard every host table group in ``module`` across the ranks; returns how many groups.

    Call it on every rank after building the model (from the same seed) and before creating the
    sparse optimizers (their state is allocated per shard). Each rank keeps only the rows it owns
    (the whole table is built once at construction; a table that does not fit one host must be
    initialised per shard instead). Does nothing at world size 1.
    """
    if not active():
        return 0
    r, n = rank(), world_size()
    groups = list(dict.fromkeys(t.group for t in host_tables(module).values()))  # in model order, each once
    for group in groups:
        if group.exchange.placement is not RowPlacement.LOCAL:
            continue
        total = group.num_rows
        lo, hi = block_range(total, r, n)
        ssd = None
        if group.ssd_config is not None:  # the SSD tier: the shard's rows laid out when first needed, from row lo
            shard = torch.empty((hi - lo, group.dim), dtype=group.dtype, device="meta")
            if group.ssd is not None:  # laid out whole already: this rank's block of it replaces it
                old = group.ssd
                ssd = SsdRows(old.name, hi - lo, group.dim, group.dtype, old.config, None, old.state, previous=old, first=lo)
        else:
            shard = host_empty((hi - lo, group.dim), group.dtype)
            shard.copy_(group.storage[lo:hi])
        # ids and row offsets stay global: the exchange maps them to ranks
        group.place(RowSharding(group, total), storage=shard, first_row=lo, ssd=ssd)
        if group.dynamic.tables:  # each key's rows where its owner is (hetero.parallel.sharded_keys)
            shard_keys(group, [block_range(total, q, n) for q in range(n)])
    return len(groups)


def sharded_tables(module: nn.Module) -> dict[str, "torch.nn.Module"]:
    """Host tables of ``module`` whose rows are sharded across the ranks, by qualified name."""
    return {k: t for k, t in host_tables(module).items() if t.group.exchange.placement is RowPlacement.ROW_SHARDED}


def gather_rows(shard: Tensor, global_rows: int) -> Tensor:
    """The full ``(global_rows, ...)`` tensor from every rank's block (see :func:`block_range`).
    Collective: every rank calls it; every rank gets the result."""
    n = world_size()
    block = -(-global_rows // n)
    padded = torch.zeros((block, *shard.shape[1:]), dtype=shard.dtype)
    padded[: shard.shape[0]] = shard
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=host_group())
    return torch.cat(parts)[:global_rows]


def table_rows(t: nn.Module, full_group: Tensor) -> Tensor:
    """Table ``t``'s rows within a full (gathered) group tensor."""
    start = t.group_row
    return full_group[start : start + t.config.num_rows]


def local_table_rows(t: nn.Module, full_table: Tensor) -> Tensor:
    """This rank's rows of a full table tensor (the inverse of gathering)."""
    g = t.group
    start = t.group_row
    lo, hi = block_range(g.exchange.global_rows, rank(), world_size())
    a, b = min(max(start, lo), hi), min(max(start + t.config.num_rows, lo), hi)
    return full_table[a - start : b - start]
