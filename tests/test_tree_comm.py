"""Collectives over nested values (hetero.parallel.tree_comm): equal values on every rank, and
views of one large storage sent without their storage (issue: --pp 2 on the Criteo job pickled
each table view with the whole collection's storage and was killed for memory)."""

import resource

import torch
import torch.distributed as dist

from conftest import run_ranks


def _value(rank):
    g = torch.Generator().manual_seed(rank)
    flat = torch.randn(1000, generator=g)
    return {"views": [flat[i * 100:(i + 1) * 100].view(10, 10) for i in range(10)],
            "mixed": (torch.tensor(3.5, dtype=torch.float64), torch.tensor([True, False, True]),
                      torch.arange(7, dtype=torch.int16), torch.randn(3, 4, generator=g).t()),
            "plain": {1: "text", 2: [rank, None, 2.5]}, "empty": torch.zeros(0, 3)}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _trees():
    from hetero.parallel.tree_comm import broadcast_tree, gather_tree, recv_tree, send_tree

    me = dist.get_rank()
    every = gather_tree(_value(me))
    one = broadcast_tree(_value(1) if me == 1 else None, 1)
    if me == 0:
        send_tree(_value(0), 1)
        got = None
    else:
        got = recv_tree(0)
    if me == 1:  # rank 1 checks what it received against the reference it builds itself
        _same(got, _value(0))
    return every, one


def test_trees_arrive_whole_and_equal(tmp_path):
    every, one = run_ranks(tmp_path, 2, _trees)
    for r in range(2):
        _same(every[r], _value(r))
    _same(one, _value(1))


def _storage_sent_once(mb):
    from hetero.parallel.tree_comm import gather_tree

    storage = torch.ones(mb << 18)  # mb MiB of float32
    views = {f"t{i}": storage[i * (storage.numel() // 20):(i + 1) * (storage.numel() // 20)] for i in range(20)}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far
    parts = gather_tree(views if dist.get_rank() == 0 else {})
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert all(torch.equal(parts[0][k], v) for k, v in views.items())
    return grown


def test_views_of_one_storage_do_not_send_it_per_view(tmp_path):
    # pickled, 20 views of a 64 MiB storage are 1280 MiB on the sender; as tensors, its bytes
    # once (a bucket copy, plus the gathered views)
    grown = run_ranks(tmp_path, 2, _storage_sent_once, 64)
    assert grown < 400, f"rank 0's peak memory grew {grown:.0f} MiB gathering views of a 64 MiB storage"
