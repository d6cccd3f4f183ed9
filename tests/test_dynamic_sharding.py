"""Which rank owns a row-sharded dynamic table's key, and where a checkpoint's keys go at another
world size (:mod:`hetero.dynamic.sharding`), against plain Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_ranks

from hetero.dynamic.sharding import KeySpans, rehome

M64 = (1 << 64) - 1


def _home(key: int, capacity: int) -> int:
    """SplitMix64's output for state ``key`` (Steele, Lea & Flood 2014), reduced to a row: plain Python."""
    z = (key + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) % capacity


def _owner(key: int, spans: KeySpans) -> int:
    home = _home(key, spans.capacity)
    return next(r for r, (a, c) in enumerate(zip(spans.starts, spans.counts)) if a <= home < a + c)


def test_a_key_is_owned_by_the_rank_holding_its_home_row_and_ranks_own_keys_by_their_rows():
    # a 1000-row table from group row 300 of a 2000-row group over 4 ranks: spans of 200, 500, 300, 0 rows
    spans = KeySpans.of_blocks(1000, 300, [(0, 500), (500, 1000), (1000, 1500), (1500, 2000)])
    assert spans.starts.tolist() == [0, 200, 700, 1000] and spans.counts.tolist() == [200, 500, 300, 0]
    keys = np.random.default_rng(0).integers(-(2**62), 2**62, 20_000)
    owner = spans.owner(keys)
    assert owner.tolist()[:200] == [_owner(int(k) & M64, spans) for k in keys[:200]]
    share = np.bincount(owner, minlength=4) / keys.shape[0]
    assert np.allclose(share, [0.2, 0.5, 0.3, 0.0], atol=0.02)


def _table(spans: KeySpans, rng, held: int):
    """A checkpointed table's key map with ``held`` keys, each at a row of its owner's span."""
    row_key = np.zeros(spans.capacity, np.int64)
    last = np.full(spans.capacity, -1, np.int64)
    count = np.zeros(spans.capacity, np.int64)
    keys = rng.choice(10**9, 4 * held, replace=False)
    free = {r: list(range(int(a), int(a + c))) for r, (a, c) in enumerate(zip(spans.starts, spans.counts))}
    placed = 0
    for k in keys:
        r = _owner(int(k), spans)
        if placed < held and free[r]:
            row = free[r].pop(rng.integers(len(free[r])))
            row_key[row], last[row], count[row] = k, rng.integers(0, 50), rng.integers(1, 9)
            placed += 1
    return row_key, count, last


def test_a_checkpoints_keys_stay_at_its_world_size_and_move_to_their_owners_at_another():
    rng = np.random.default_rng(1)
    two = KeySpans.of_blocks(600, 0, [(0, 301), (301, 601)])
    row_key, count, last = _table(two, rng, 400)
    same = rehome(two, row_key, count, last)
    assert same.identity and same.dropped == 0
    three = KeySpans.of_blocks(600, 0, [(0, 201), (201, 402), (402, 601)])
    moved = rehome(three, row_key, count, last)
    assert not moved.identity and moved.dropped == 0
    got = {int(row_key[s]): i for i, s in enumerate(moved.source) if s >= 0}
    assert sorted(got) == sorted(int(k) for k, t in zip(row_key, last) if t >= 0)  # every key, once
    for key, row in got.items():  # at a row of its owner's span now
        r = _owner(key, three)
        assert three.starts[r] <= row < three.starts[r] + three.counts[r]


def test_an_owner_short_of_rows_drops_the_least_used_keys_moving_in():
    keys = np.arange(1, 200, dtype=np.int64)
    two = KeySpans.of_blocks(8, 0, [(0, 5), (5, 9)])  # rank 1 holds rows 5-7
    mine = [int(k) for k in keys if _owner(int(k), two) == 1][:5]  # 5 keys rank 1 owns, saved at rows 0-4
    row_key = np.array(mine + [0, 0, 0], np.int64)
    count = np.array([5, 1, 7, 1, 3, 0, 0, 0], np.int64)
    last = np.array([0, 4, 0, 3, 0, -1, -1, -1], np.int64)
    assert rehome(KeySpans.of_blocks(8, 0, [(0, 9)]), row_key, count, last).identity  # one process: nothing moves
    moved = rehome(two, row_key, count, last)
    # rank 1's 3 rows go to the most used (counts 7, 5, 3), in the order of their old rows
    assert moved.dropped == 2 and moved.source.tolist() == [-1, -1, -1, -1, -1, 0, 2, 4]


def _sketches(case: str, ranks: int):
    """Each rank's admission sketch (4 x 4096 int32) and the loaded base, for ``case``: a few
    counters changed since the load (sent sparse; ``sparse_top``: some near int32's top, the sum
    saturating), most of them (all-reduced as int32), or counters near int32's top (all-reduced as
    int64, the sum saturating)."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 50, (4, 4096)).astype(np.int32)
    if case == "sparse_top":
        base[0, :100] = 2**31 - 10
    mine = []
    for _ in range(ranks):
        s = base.copy()
        if case.startswith("sparse"):
            cells = rng.choice(200, 40, replace=False)  # (ranks change some of the same counters)
            s.reshape(-1)[cells] += rng.integers(1, 9, 40).astype(np.int32)
        else:
            s += rng.integers(0, 9, s.shape).astype(np.int32)
            if case == "wide":
                s.reshape(-1)[:100] = 2**31 - 10
        mine.append(s)
    return base, mine


def _summed_on_ranks(case: str, ranks: int):
    from types import SimpleNamespace

    from hetero.parallel.env import rank
    from hetero.parallel.sharded_keys import _summed_sketch

    base, mine = _sketches(case, ranks)
    table = SimpleNamespace(keymap=SimpleNamespace(sketch=mine[rank()]), key_shard=SimpleNamespace(sketch_base=base))
    before = mine[rank()].copy()
    out = _summed_sketch(table)
    assert np.array_equal(mine[rank()], before)  # the live sketch is not written
    return out


@pytest.mark.parametrize("case", ["sparse", "sparse_top", "dense", "wide"])
def test_a_checkpoint_sums_every_ranks_sketch_counts_as_plain_python_does(tmp_path, case):
    """The whole sketch a row-sharded checkpoint holds: the base plus every rank's counts since the
    load, saturated at int32's top once (plain Python integers as the reference), whichever way
    the counters travel."""
    base, mine = _sketches(case, 2)
    want = [min(int(b) + sum(int(m.reshape(-1)[i]) - int(b) for m in mine), 2**31 - 1)
            for i, b in enumerate(base.reshape(-1))]
    got = run_ranks(tmp_path, 2, _summed_on_ranks, case, 2)
    assert got.dtype == torch.int32 and got.shape == base.shape
    assert got.reshape(-1).tolist() == want
