"""TinyLFU admission of dynamic tables (``DynamicConfig(tinylfu=True)``): against a plain Python
reference of the rule, its effect on a stream of one-off keys, exact resume, and bad settings."""

from __future__ import annotations

import numpy as np
import pytest

from hetero.data.schema import Categorical
from hetero.dynamic import DynamicConfig, Eviction, KeyMap

M = (1 << 64) - 1
C1, C2, GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


def mix(x: int) -> int:
    """SplitMix64's finalizer (Steele, Lea & Flood 2014) in plain Python."""
    x &= M
    x = ((x ^ (x >> 30)) * C1) & M
    x = ((x ^ (x >> 27)) * C2) & M
    return x ^ (x >> 31)


class Reference:
    """A full LFU table's rules with TinyLFU admission, in plain Python: rows handed out from a free
    stack (row 0 first; evicted rows pushed in row order), exact sighting counts instead of the
    sketch (wide enough here not to collide), and the victim sample drawn from SplitMix64 of the
    key and the step over the rows."""

    def __init__(self, capacity: int, chunk: int) -> None:
        self.capacity, self.chunk = capacity, chunk
        self.key_of: dict[int, int] = {}  # row -> key
        self.row_of: dict[int, int] = {}  # key -> row
        self.count: dict[int, int] = {}  # row -> use count
        self.last: dict[int, int] = {}  # row -> last step
        self.free = list(range(capacity - 1, -1, -1))
        self.seen: dict[int, int] = {}  # sightings without a row
        self.admitted = self.evicted = self.default = 0

    def _outranks(self, key: int, step: int) -> bool:
        est = self.seen[key]
        if est <= 1:
            return False
        base = mix((key & M) ^ mix(step ^ GOLDEN))
        sampled = [mix(base + (t + 1) * GOLDEN) % self.capacity for t in range(16)]
        counts = [self.count[r] for r in sampled if r in self.key_of and self.last[r] < step]
        return bool(counts) and est > min(counts)

    def _evict(self, step: int) -> None:
        cand = sorted((self.count[r], self.last[r], self.key_of[r], r) for r in self.key_of if self.last[r] < step)
        for r in sorted(r for *_, r in cand[: self.chunk]):
            del self.row_of[self.key_of.pop(r)]
            self.free.append(r)
            self.evicted += 1

    def translate(self, keys: list[int], step: int) -> list[int]:
        out: list[int | None] = []
        for k in keys:
            if k in self.row_of:
                r = self.row_of[k]
                self.count[r] += 1
                self.last[r] = step
                out.append(r)
            else:
                self.seen[k] = self.seen.get(k, 0) + 1
                out.append(None)
        for i, k in enumerate(keys):
            if out[i] is not None:
                continue
            if k in self.row_of:  # admitted by an earlier occurrence
                out[i] = self.row_of[k]
                self.count[out[i]] += 1
                continue
            admit = not (len(self.free) < self.chunk and not self._outranks(k, step))
            if admit and not self.free:
                self._evict(step)
            if not admit or not self.free:
                out[i] = self.capacity
                self.default += 1
                continue
            r = self.free.pop()
            self.key_of[r], self.row_of[k], self.count[r], self.last[r] = k, r, 1, step
            self.admitted += 1
            out[i] = r
        return out


def stream(steps: int, seed: int = 0) -> list[np.ndarray]:
    """Batches of 40 keys: skewed draws from 120 returning keys, and one-off keys (each seen once)."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**62), 2**62, 120)
    out = []
    for s in range(steps):
        returning = pool[np.minimum(rng.zipf(1.2, 28) - 1, 119)]
        once = np.arange(12, dtype=np.int64) + 10**15 + 100 * s
        out.append(rng.permutation(np.concatenate([returning, once])))
    return out


@pytest.mark.parametrize("chunk", [1, 4])
def test_tinylfu_admission_follows_a_plain_python_reference(chunk):
    capacity = 32
    c = DynamicConfig(eviction=Eviction.LFU, evict_chunk=chunk, tinylfu=True, sketch_width=1 << 16)
    m, ref = KeyMap("t", capacity, c), Reference(capacity, chunk)
    refused_by_filter = 0
    for step, keys in enumerate(stream(80)):
        rows, _ = m.translate(keys, step)
        want = ref.translate(keys.tolist(), step)
        assert rows.tolist() == want, step
        assert (m.stats.admitted, m.stats.evicted, m.stats.default_lookups) == (ref.admitted, ref.evicted, ref.default)
        refused_by_filter = ref.default
    held_rows, held_keys = m.keys()
    assert dict(zip(held_rows.tolist(), held_keys.tolist())) == ref.key_of
    assert ref.evicted > 0 and refused_by_filter > 0  # the stream filled the table and the filter refused keys


def test_one_off_keys_do_not_evict_the_rows_of_returning_ones():
    """A table holding 16 keys, each seen 3 times, then 50 steps of 8 keys seen once each: with
    TinyLFU none of the 16 loses its row; plain LFU gives 8 of them up to the first step's one-off
    keys (later steps' evict the one-off keys before, which were used less)."""
    held = np.arange(16, dtype=np.int64) * 7919 + 11
    for tinylfu, kept in ((True, 16), (False, 8)):
        m = KeyMap("t", 16, DynamicConfig(evict_chunk=1, tinylfu=tinylfu, sketch_width=1 << 12))
        for step in range(3):
            m.translate(held, step)
        for step in range(3, 53):
            m.translate(np.arange(8, dtype=np.int64) + 10**12 + 8 * step, step)
        assert np.isin(held, m.keys()[1]).sum() == kept, tinylfu
    assert m.stats.evicted > 0


def test_a_key_map_with_tinylfu_resumes_exactly_from_its_state_dict():
    c = DynamicConfig(evict_chunk=2, tinylfu=True, sketch_width=1 << 12)
    batches = stream(40, seed=2)
    straight, first = KeyMap("t", 24, c), KeyMap("t", 24, c)
    for step, keys in enumerate(batches):
        rows, _ = straight.translate(keys, step)
        if step < 20:
            first.translate(keys, step)
    resumed = KeyMap("t", 24, c)
    resumed.load_state_dict(first.state_dict())
    for step, keys in enumerate(batches[20:], start=20):
        rows_resumed, _ = resumed.translate(keys, step)
    assert np.array_equal(rows, rows_resumed)
    for k, v in straight.state_dict().items():
        assert np.array_equal(v, resumed.state_dict()[k]), k


def test_tinylfu_with_admission_by_probability_is_refused_naming_both():
    with pytest.raises(ValueError, match="tinylfu.*admit_probability"):
        DynamicConfig(tinylfu=True, admit_probability=0.5)


def test_a_job_files_tinylfu_reaches_the_tables_config_and_needs_dynamic():
    assert Categorical(column="u", dynamic=True, capacity=10, tinylfu=True).dynamic_config().tinylfu
    with pytest.raises(ValueError, match="'u'.*tinylfu.*dynamic = true"):
        Categorical(column="u", tinylfu=True)


def test_a_part_without_rows_refuses_every_key_with_tinylfu():
    """A map of no rows (a rank's or a server's empty part of a table) reads the default row for
    every key, seen however often: the victim sample has no rows to draw from."""
    m = KeyMap("t", 0, DynamicConfig(tinylfu=True, sketch_width=64))
    for step in range(3):
        rows, new = m.translate(np.array([5, 5, 7], np.int64), step)
        assert rows.tolist() == [0, 0, 0] and new.rows.shape[0] == 0
    assert m.stats.default_lookups == 9 and m.stats.admitted == 0
