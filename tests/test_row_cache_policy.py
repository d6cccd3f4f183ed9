"""The SSD tier's row cache keeps the rows a skewed id distribution comes back to (LFU: GCLOCK with
W-TinyLFU's admission), and lets go of a popularity that has passed. Exactness through the cache is
tests/test_ssd_tier.py's; these check which rows stay cached, against what plain CLOCK does."""

import numpy as np
import pytest
import torch

from hetero.storage import cache as cache_module
from hetero.storage.cache import CachePolicy, RowCache
from hetero.storage.layout import Field, RecordLayout
from hetero.storage.records import RowFile

CAPACITY = 80  # LFU: 70 main slots, a ring of 10


def _cache(tmp_path, policy: CachePolicy) -> RowCache:
    file = RowFile(tmp_path / f"{policy.value}.rows", RecordLayout((Field("w", torch.float32, 4),)), rows=10_000,
                   threads=2)
    return RowCache(file, CAPACITY, policy)


def _hits(cache: RowCache, rows: range) -> int:
    before = cache.stats.hits
    cache.acquire(np.array(rows, np.int64))
    return cache.stats.hits - before


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_one_time_rows_do_not_push_out_the_rows_that_come_back(tmp_path, policy):
    cache = _cache(tmp_path, policy)
    hot = range(50)
    for _ in range(5):
        cache.acquire(np.array(hot, np.int64))
    for step in range(40):  # a scan: 8 rows a step, each seen once
        cache.acquire(np.arange(1000 + 8 * step, 1008 + 8 * step, dtype=np.int64))
    kept = _hits(cache, hot)
    if policy is CachePolicy.LFU:
        assert kept == 50  # the scan passed through the ring; the main slots kept every hot row
    else:
        assert kept < 25  # (the scenario discriminates: CLOCK, without admission, lets them go)
    cache.file.close()


def _scan(cache: RowCache, start: int, steps: int = 5) -> None:
    for step in range(steps):  # 8 rows a step, each seen once: the ring turns over
        cache.acquire(np.arange(start + 8 * step, start + 8 * step + 8, dtype=np.int64))


@pytest.mark.parametrize("halving", [True, False])
def test_a_popularity_that_has_passed_fades(tmp_path, monkeypatch, halving):
    # Rows once hot fill the main slots with saturated sightings; rows hot now come back as often, so
    # without the halving they would tie with the old rows forever and never be admitted
    if not halving:  # (the break check, kept: the mechanism off, the new rows stay in the ring)
        monkeypatch.setattr(cache_module, "AGING", 10**9)
    cache = _cache(tmp_path, CachePolicy.LFU)
    for _ in range(10):
        cache.acquire(np.arange(70, dtype=np.int64))  # (the 70 main slots)
    hot = range(100, 108)
    for step in range(100):
        cache.acquire(np.array([*hot, 5000 + 2 * step, 5001 + 2 * step], np.int64))
    _scan(cache, 6000)  # the hot rows leave the ring, then miss once: admitted now
    cache.acquire(np.array(hot, np.int64))
    _scan(cache, 7000)
    assert _hits(cache, hot) == (8 if halving else 0)
    cache.file.close()


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_a_row_given_twice_to_one_lookup_stops_it(tmp_path, policy):
    # the cache takes a lookup's unique rows; a row given twice would take two slots, one of them lost
    # to the index: an internal invariant (the callers dedup), checked rather than trained past
    cache = _cache(tmp_path, policy)
    cache.acquire(np.arange(10, dtype=np.int64))
    with pytest.raises(AssertionError, match="a row given twice"):
        cache.acquire(np.array([20, 21, 20], np.int64))
    cache.file.close()
