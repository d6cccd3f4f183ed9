"""The dedup kernels against plain Python: the serial dedup with its occurrence chains, the parallel
one without, the prefetch's read-after-write check, at several thread counts, and a device lookup's
plan built with either dedup."""

import numpy as np
import pytest
import torch

from hetero.embedding import HostEmbedding, TableConfig
from hetero.embedding.kernels import dedup_kernels


def reference(ids, ascending):
    """unique ids (ascending, or in first-occurrence order), each id's position among them, and each
    unique id's positions in increasing order (plain Python)."""
    unique = sorted({int(x) for x in ids}) if ascending else list(dict.fromkeys(int(x) for x in ids))
    index = {x: k for k, x in enumerate(unique)}
    where: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
        where.setdefault(int(x), []).append(i)
    return np.array(unique, np.int64), np.array([index[int(x)] for x in ids], np.int64), [where[x] for x in unique]


def chain(first, nxt, k):
    """The positions of unique id ``k``'s occurrence chain."""
    out, i = [], int(first[k])
    while i >= 0:
        out.append(i)
        i = int(nxt[i])
    return out


@pytest.mark.parametrize("sort", [False, True], ids=["marker", "sort"])
@pytest.mark.parametrize("case", ["uniform", "skewed", "repeated", "one", "empty", "wide"])
def test_both_dedups_equal_plain_python_at_any_thread_count(case, sort):
    """The serial dedup (and its chains, in occurrence order) and the parallel one, through a
    marker (first-occurrence order) or a sort (ascending); ``wide``: rows past 2**31, which do not
    pack into a sort word. Each marker call has a new stamp, the marker keeping the last call's."""
    if case == "wide" and not sort:
        pytest.skip("a marker has a word a row")
    K = dedup_kernels()
    rng = np.random.default_rng(0)
    n = {"empty": 0, "one": 1, "repeated": 5_000}.get(case, 20_000)  # 20,000 ids: up to 4 parts in parallel
    rows = 2**40 if case == "wide" else 3_000
    ids = {"uniform": lambda: rng.integers(0, rows, n), "skewed": lambda: np.minimum(rng.zipf(1.2, n), rows) - 1,
           "repeated": lambda: np.full(n, 7), "one": lambda: np.array([5]), "empty": lambda: np.empty(0, np.int64),
           "wide": lambda: rng.integers(0, 2_000, n) * (rows // 2_000)}[case]()
    ids = ids.astype(np.int64)
    want_u, want_inv, want_chains = reference(ids, sort)
    marker = np.zeros(0 if sort else rows, np.int64)
    a, b = np.full(n, -5, np.int64), np.full(n, -5, np.int64)  # (the scratch holds garbage between calls)
    stamp = 1
    for threads in (1, 2, 3, 7, 64):
        stamp += 1
        unique, inverse = K.dedup_unique(ids, marker, stamp, a, b, threads)
        np.testing.assert_array_equal(unique, want_u, err_msg=f"unique, {threads} threads")
        np.testing.assert_array_equal(inverse, want_inv, err_msg=f"inverse, {threads} threads")
    unique, inverse, first, nxt = K.dedup(ids, marker, stamp + 1, a, b)
    np.testing.assert_array_equal(unique, want_u)
    np.testing.assert_array_equal(inverse, want_inv)
    assert [chain(first, nxt, k) for k in range(len(unique))] == want_chains


def test_a_group_sorts_from_its_size_on(monkeypatch):
    """A group under ``SORTED_DEDUP_BYTES`` dedups through a marker (first-occurrence order), one at
    or over it sorts (ascending)."""
    from hetero.embedding import group as group_module
    from hetero.embedding.group import Request

    ids = torch.randint(0, 1_000, (512, 3), generator=torch.Generator().manual_seed(4))
    flat = ids.reshape(-1).tolist()
    small = HostEmbedding(TableConfig("t", 1_000, 4))
    assert small.group.deduper.marker.shape == (1_000,)
    assert small.group.plan([Request(small, ids)]).unique.tolist() == list(dict.fromkeys(flat))
    monkeypatch.setattr(group_module, "SORTED_DEDUP_BYTES", 1_000 * 4 * 4)
    large = HostEmbedding(TableConfig("t", 1_000, 4))
    assert large.group.deduper.marker.shape == (0,)
    assert large.group.plan([Request(large, ids)]).unique.tolist() == sorted(set(flat))


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_stale_positions_are_the_rows_updated_after_the_version(threads):
    rng = np.random.default_rng(1)
    row_version = rng.integers(0, 10, 5_000).astype(np.int64)
    unique = rng.permutation(5_000)[:1_234].astype(np.int64)
    want = [k for k, r in enumerate(unique) if row_version[r] > 6]
    got = dedup_kernels().stale_positions(row_version, unique, 6, threads)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n, top", [(0, 10), (1, 10), (500, 1), (1000, 3), (106_496, 5_200_000), (20_000, 2**62),
                                    (5_000, 2**63 - 1)])
def test_the_sorted_dedup_equals_torch_unique(n, top):
    """The radix-sort dedup of groups that dedup as the plan is built (row-sharded, SSD tier) against
    ``torch.unique``: one digit, several, digits every id shares, ids past 2**31 (numpy's stable sort)."""
    ids = np.random.default_rng(n).integers(0, top, n)
    unique, inverse = dedup_kernels().sorted_unique(ids)
    want = torch.unique(torch.from_numpy(ids), return_inverse=True)
    assert np.array_equal(unique, want[0].numpy()) and np.array_equal(inverse, want[1].numpy())


def test_a_plan_without_chains_dedups_in_parallel_to_the_same_plan(monkeypatch):
    from hetero.embedding import dedup as group_module
    from hetero.embedding.group import Request

    table = HostEmbedding(TableConfig("t", 1_000, 4))
    ids = torch.randint(0, 1_000, (512, 3), generator=torch.Generator().manual_seed(2))
    with_chains = table.group.plan([Request(table, ids)])
    calls = []
    original = dedup_kernels().dedup_unique
    monkeypatch.setattr(group_module, "PARALLEL_DEDUP_THREADS", 1)
    monkeypatch.setattr(dedup_kernels(), "dedup_unique", lambda *a: calls.append(a) or original(*a))
    without = table.group.plan([Request(table, ids)], chains=False)
    assert calls, "the parallel dedup did not run"
    assert without.first is None and without.next is None
    torch.testing.assert_close(without.unique, with_chains.unique, rtol=0, atol=0)
    torch.testing.assert_close(without.inverse, with_chains.inverse, rtol=0, atol=0)


def _device_training(prefetch, threads=4, steps=8):
    """A two-table collection whose lookups go to the GPU, trained ``steps`` steps (row-wise Adagrad);
    consecutive batches share rows, so a row gathered ahead is overtaken by the update every step."""
    from hetero.embedding import HostEmbeddingCollection, Prefetcher, set_num_threads
    from hetero.optim import RowWiseAdagrad, RowWiseAdagradConfig

    set_num_threads(threads)
    try:
        torch.manual_seed(0)
        coll = HostEmbeddingCollection([TableConfig("a", 500, 8), TableConfig("b", 300, 8)]).cuda()
        opt = RowWiseAdagrad(coll.tables.values(), RowWiseAdagradConfig(lr=0.1))
        g = torch.Generator().manual_seed(3)
        batches = [{"a": torch.cat([torch.arange(20), torch.randint(0, 500, (4_000,), generator=g)]),
                    "b": torch.randint(0, 300, (4_020,), generator=g)} for _ in range(steps)]
        outs = []
        for feats in (batches if prefetch is None else Prefetcher(coll, batches, prefetch, features=lambda b: b)):
            out = coll(feats)
            outs.append({n: o.detach().cpu() for n, o in out.items()})
            sum((o * (k + 1)).square().sum() for k, o in enumerate(out.values())).backward()
            opt.step()
        return coll, outs
    finally:
        set_num_threads(None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_lookups_train_the_same_with_either_dedup_and_any_prefetch(monkeypatch):
    from hetero.embedding import PrefetchConfig
    from hetero.embedding import dedup as group_module

    monkeypatch.setattr(group_module, "PARALLEL_DEDUP_THREADS", 1_000)  # the serial dedup: the reference
    ref, ref_outs = _device_training(None)
    monkeypatch.undo()
    # the parallel dedup at any thread count (under OMP_NUM_THREADS=1 numba's pool holds one thread)
    monkeypatch.setattr(group_module, "PARALLEL_DEDUP_THREADS", 1)
    calls = []
    original = dedup_kernels().dedup_unique
    monkeypatch.setattr(dedup_kernels(), "dedup_unique", lambda *a: calls.append(a) or original(*a))
    for config in (None, PrefetchConfig(gather_rows=True), PrefetchConfig(gather_rows=False),
                   PrefetchConfig(gather_rows=True, worker=False)):
        calls.clear()
        got, outs = _device_training(config)
        assert calls, f"{config}: the parallel dedup did not run"
        for a, b in zip(ref_outs, outs):
            for n in a:
                assert torch.equal(a[n], b[n]), (config, n)
        for n in ref.tables:
            assert torch.equal(ref.tables[n].weight, got.tables[n].weight), (config, n)
