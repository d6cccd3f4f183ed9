"""A dynamic table replicated over data-parallel ranks admits and evicts every rank's keys
(:func:`gather_keys`), so that the replicas' key maps, rows and optimizer state stay equal - the
same admissions as one process given the ranks' batches one after the other."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from hetero.parallel.env import DataParallelGroup


def gather_keys(group: DataParallelGroup, keys: Tensor) -> tuple[Tensor, int, int]:
    """Every rank's ``keys`` (``(N_r,)`` int64, host) concatenated in rank order, and this rank's
    ``[lo, hi)`` among them: two all-gathers on the host group (the counts, then the keys padded
    to the longest). A collective: every rank calls it for the same lookup.

    Returns:
        ``(sum N_r,)`` int64 keys, ``lo``, ``hi``.
    """
    n, pg = group.size, group.host_group()
    counts = torch.empty(n, dtype=torch.int64)
    dist.all_gather_into_tensor(counts, torch.tensor([keys.numel()]), group=pg)
    longest = int(counts.max())
    send = torch.zeros(longest, dtype=torch.int64)
    send[: keys.numel()] = keys
    got = torch.empty(n * longest, dtype=torch.int64)
    dist.all_gather_into_tensor(got, send, group=pg)
    got = got.view(n, longest)
    lo = int(counts[: group.rank].sum())
    return torch.cat([got[r, : int(counts[r])] for r in range(n)]), lo, lo + keys.numel()
