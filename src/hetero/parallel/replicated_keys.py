"""A dynamic table replicated over data-parallel ranks admits and evicts every rank's keys
(:func:`gather_keys`), so that the replicas' key maps, rows and optimizer state stay equal - the
same admissions as one process given the ranks' batches one after the other."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from hetero.parallel.env import DataParallelGroup


def gather_keys(group: DataParallelGroup, keys: list[Tensor]) -> list[tuple[Tensor, int, int]]:
    """For each of one lookup's tables, every rank's ``keys`` (``(N_r,)`` int64, host) concatenated
    in rank order, and this rank's ``[lo, hi)`` among them: two all-gathers on the host group for
    all the tables (the counts, then the keys, table after table, padded to the longest). A
    collective: every rank calls it for the same lookup.

    Returns:
        per table, ``(sum N_r,)`` int64 keys, ``lo``, ``hi``.
    """
    n, pg, T = group.size, group.host_group(), len(keys)
    counts = torch.empty(n * T, dtype=torch.int64)
    dist.all_gather_into_tensor(counts, torch.tensor([k.numel() for k in keys], dtype=torch.int64), group=pg)
    counts = counts.view(n, T)
    sizes = counts.sum(1)
    longest = int(sizes.max())
    send = torch.zeros(longest, dtype=torch.int64)
    if T:
        torch.cat(keys, out=send[: int(sizes[group.rank])])
    got = torch.empty(n * longest, dtype=torch.int64)
    dist.all_gather_into_tensor(got, send, group=pg)
    got = got.view(n, longest)
    starts = torch.cumsum(counts, 1) - counts  # (n, T): where table j's keys start in rank r's message
    out = []
    for j in range(T):
        everyone = torch.cat([got[r, int(starts[r, j]) : int(starts[r, j] + counts[r, j])] for r in range(n)])
        lo = int(counts[: group.rank, j].sum())
        out.append((everyone, lo, lo + keys[j].numel()))
    return out
