"""Dynamic tables (hetero.dynamic): raw keys -> rows with admission and eviction, against a fitted
vocabulary and against a plain Python reference of the map."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hetero.dynamic import DynamicConfig, Eviction, KeyMap, Keys
from hetero.embedding import HostEmbedding, HostEmbeddingCollection, Pooling, TableConfig
from hetero.optim import SparseOptimizerKind

D, B, L = 4, 32, 3


def key_stream(steps: int, distinct: int, seed: int = 0) -> list[np.ndarray]:
    """Batches of ``B * L`` raw keys (large, negative ones too) drawn with skew from ``distinct`` keys."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**62), 2**62, distinct)
    return [pool[np.minimum(rng.zipf(1.3, B * L) - 1, distinct - 1)] for _ in range(steps)]


class Model(nn.Module):
    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.table, self.top = table, nn.Linear(D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.top(self.table(ids)).squeeze(-1)


def train(model: Model, optimizer_kind: SparseOptimizerKind, batches: list[torch.Tensor], labels: list[torch.Tensor]):
    sparse = optimizer_kind.optimizer({"t": model.table})
    dense = torch.optim.SGD(model.top.parameters(), lr=0.1)
    losses = []
    for ids, y in zip(batches, labels):
        sparse.zero_grad()
        dense.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(ids), y)
        loss.backward()
        sparse.step()
        dense.step()
        losses.append(loss.item())
    return losses, sparse


def _user_item_steps(coll, opt, stream, items, steps, loss_of) -> list[float]:
    """Train a collection of tables ``user`` (``stream[s]``'s first ``B`` keys) and ``item``
    (``items[s]``) at ``steps`` with the loss ``loss_of(user rows, item rows)``; the losses."""
    losses = []
    for s in steps:
        opt.zero_grad()
        out = coll({"user": torch.from_numpy(stream[s][:B]), "item": items[s]})
        loss = loss_of(out["user"], out["item"])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", list(SparseOptimizerKind))
@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.NONE])
def test_a_dynamic_table_with_room_for_every_key_trains_as_a_fitted_vocabulary(kind, pooling):
    stream = key_stream(25, 120)
    vocab = np.unique(np.concatenate(stream))
    labels = [torch.randint(0, 2, (B,) if pooling is Pooling.SUM else (B, L), generator=torch.Generator().manual_seed(i))
              .float() for i in range(len(stream))]
    torch.manual_seed(0)
    dyn = Model(HostEmbedding(TableConfig("t", 200, D, pooling=pooling, init_std=0.1, keys=Keys.DYNAMIC)))
    torch.manual_seed(0)
    fixed = Model(HostEmbedding(TableConfig("t", vocab.shape[0], D, pooling=pooling, init_std=0.1)))
    fixed.table.weight.data[:] = torch.from_numpy(dyn.table.keymap.init_rows(vocab, D, 0.1))  # the same first rows per key
    as_keys = [torch.from_numpy(k.reshape(B, L)) for k in stream]
    as_ids = [torch.from_numpy(np.searchsorted(vocab, k).reshape(B, L)) for k in stream]
    got, opt = train(dyn, kind, as_keys, labels)
    want, _ = train(fixed, kind, as_ids, labels)
    assert got == want  # bit for bit
    rows, keys = dyn.table.keymap.keys()
    assert sorted(keys.tolist()) == vocab.tolist() and dyn.table.keymap.stats.admitted == vocab.shape[0]
    order = np.argsort(keys)
    assert torch.equal(dyn.table.weight.detach()[torch.from_numpy(rows[order])], fixed.table.weight.detach())
    assert torch.equal(dyn.top.weight, fixed.top.weight)
    # evaluation reads the same rows and changes nothing
    dyn.eval(), fixed.eval()
    before = dyn.table.keymap.state_dict()
    with torch.no_grad():
        assert torch.equal(dyn(as_keys[0]), fixed(as_ids[0]))
    assert all(np.array_equal(before[k], v) for k, v in dyn.table.keymap.state_dict().items() if k != "stats")


class Reference:
    """The map's rules in plain Python (exact counts instead of the sketch)."""

    def __init__(self, capacity: int, c: DynamicConfig) -> None:
        self.capacity, self.c = capacity, c
        self.rows: dict[int, list[int]] = {}  # key -> [count, last]
        self.seen: dict[int, int] = {}
        self.next_scan = 0
        self.admitted = self.evicted = self.default = 0

    def _evict(self, k: int, step: int, lfu: bool, before: int) -> None:
        cand = [(c, last, key) if lfu else (last, key) for key, (c, last) in self.rows.items() if last < before]
        for *_, key in sorted(cand)[:max(k, 0)]:
            del self.rows[key]
            self.evicted += 1

    def translate(self, keys: list[int], step: int) -> list[int | None]:
        c = self.c
        if c.ttl_steps is not None and step >= self.next_scan:
            self._evict(len(self.rows) - c.keep_floor, step, False, step - c.ttl_steps)
            self.next_scan = step + c.interval()
        out: list[int | None] = []
        for k in keys:
            if k in self.rows:
                self.rows[k][0] += 1
                self.rows[k][1] = step
                out.append(k)
            else:
                self.seen[k] = self.seen.get(k, 0) + 1
                out.append(None)
        for i, k in enumerate(keys):
            if out[i] is not None:
                continue
            if k in self.rows:
                self.rows[k][0] += 1
                out[i] = k
                continue
            admit = self.seen[k] >= c.admit_after
            if admit and len(self.rows) == self.capacity:
                self._evict(c.chunk(self.capacity), step, c.eviction is Eviction.LFU, step)
            if not admit or len(self.rows) == self.capacity:
                self.default += 1
                continue
            self.rows[k] = [1, step]
            self.admitted += 1
            out[i] = k
        return out


@pytest.mark.parametrize("c", [
    DynamicConfig(admit_after=2, eviction=Eviction.LFU, evict_chunk=1, sketch_width=1 << 16),
    DynamicConfig(admit_after=3, eviction=Eviction.LRU, evict_chunk=5, sketch_width=1 << 16),
    DynamicConfig(admit_after=1, eviction=Eviction.LFU, ttl_steps=3, ttl_interval=2, keep_floor=10),
    DynamicConfig(admit_after=2, eviction=Eviction.LRU, ttl_steps=2, sketch_width=1 << 16),
], ids=["lfu", "lru_chunk", "ttl_floor", "ttl_lru"])
def test_admission_and_eviction_follow_a_plain_python_reference(c):
    capacity = 40
    m, ref = KeyMap("t", capacity, c, seed=3), Reference(capacity, c)
    for step, keys in enumerate(key_stream(60, 150, seed=1)):
        keys = keys[:48]
        rows, new = m.translate(keys, step)
        want = ref.translate(keys.tolist(), step)
        held_rows, held_keys = m.keys()
        assert sorted(held_keys.tolist()) == sorted(ref.rows), step
        assert len(held_keys) <= capacity
        row_of = dict(zip(held_keys.tolist(), held_rows.tolist()))
        assert rows.tolist() == [capacity if k is None else row_of[k] for k in want], step
        assert (m.stats.admitted, m.stats.evicted, m.stats.default_lookups) == (ref.admitted, ref.evicted, ref.default)
    assert ref.evicted > 0 and (ref.default > 0 or c.admit_after == 1)  # the stream exercised both


def test_a_full_table_never_exceeds_its_capacity_and_a_new_key_starts_from_fresh_state():
    """A row evicted and given to a new key trains as that key's first row would: its value is the
    key's initial one and its optimizer state starts from zero (LazyAdam's moments)."""
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", 8, D, init_std=0.1, keys=Keys.DYNAMIC,
                                      dynamic=DynamicConfig(eviction=Eviction.LRU, evict_chunk=1)))
    opt = SparseOptimizerKind.LAZY_ADAM.optimizer({"t": table})
    for step in range(12):  # keys 0..7 fill it, then each step a new key evicts the least recent
        keys = torch.tensor([step, max(step - 1, 0)])
        opt.zero_grad()
        table(keys).sum().backward()
        opt.step()
        assert table.keymap.size <= 8
    assert table.keymap.stats.evicted == 4 and sorted(table.keymap.keys()[1].tolist()) == list(range(4, 12))
    # the same key trained alone from its first row: an independent reference (torch's Adam on one row)
    row = int(table.keymap.lookup(np.array([11]))[0])
    first = torch.from_numpy(table.keymap.init_rows(np.array([11]), D, 0.1))
    w = nn.Parameter(first.clone())
    ref = torch.optim.Adam([w], lr=1e-3, eps=1e-8)
    # LazyAdam's step count is the table's (its 12th step): a first row there has zero moments at t = 12
    ref.state[w] = {"step": torch.tensor(11.0), "exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}
    ref.zero_grad()
    w.sum().backward()
    ref.step()
    assert torch.allclose(table.weight.detach()[row], w.detach()[0], atol=1e-7, rtol=0)
    state = opt.group_state[table.group]
    assert torch.allclose(state["exp_avg"][row], torch.full((D,), 0.1))  # one gradient of ones, (1 - b1) * 1


def test_keys_without_a_row_read_the_default_row_and_it_takes_no_update():
    torch.manual_seed(0)
    c = DynamicConfig(admit_after=3, default_value=0.5, sketch_width=1 << 10)
    table = HostEmbedding(TableConfig("t", 16, D, keys=Keys.DYNAMIC, dynamic=c))
    opt = SparseOptimizerKind.ADAGRAD.optimizer({"t": table})
    for _ in range(2):  # seen twice: not yet admitted
        opt.zero_grad()
        out = table(torch.tensor([7, 9]))
        assert torch.equal(out, torch.full((2, D), 0.5))
        (out * torch.arange(D)).sum().backward()
        opt.step()
        assert torch.equal(table.weight.detach()[16], torch.full((D,), 0.5))
        assert torch.equal(opt.group_state[table.group]["sum"][16], torch.zeros(D))
    assert table.keymap.size == 0 and table.keymap.stats.default_lookups == 4
    opt.zero_grad()
    table(torch.tensor([7, 9])).sum().backward()  # the third sightings admit them
    opt.step()
    assert table.keymap.size == 2 and not torch.equal(table.weight.detach()[0], torch.zeros(D))


def test_a_collection_groups_dynamic_and_fixed_tables_and_a_state_dict_resumes_exactly(tmp_path):
    def build():
        torch.manual_seed(0)
        coll = HostEmbeddingCollection([
            TableConfig("user", 20, D, keys=Keys.DYNAMIC, init_std=0.1,
                        dynamic=DynamicConfig(admit_after=2, evict_chunk=3, sketch_width=1 << 10)),
            TableConfig("item", 30, D, init_std=0.1)])
        return coll, SparseOptimizerKind.ROWWISE_ADAGRAD.optimizer(coll.tables.values())

    stream = key_stream(30, 90, seed=2)
    items = [torch.from_numpy(k[:B] % 30) for k in stream]

    def run(coll, opt, steps):
        return _user_item_steps(coll, opt, stream, items, steps, lambda u, i: (u * i).sum())

    coll, opt = build()
    assert len(coll.groups) == 1  # one storage: the dynamic table's rows beside the fixed one's
    straight = run(coll, opt, range(30))
    assert coll.tables["user"].keymap.stats.evicted > 0
    coll, opt = build()
    first = run(coll, opt, range(15))
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in coll.state_dict().items()}
    saved_opt = opt.state_dict()
    coll, opt = build()
    coll.load_state_dict(saved)
    opt.load_state_dict(saved_opt)
    assert first + run(coll, opt, range(15, 30)) == straight
    # and through a sharded (DCP) checkpoint: the maps come back too (a load in place reached copies of them)
    from hetero.parallel import load_distributed_checkpoint, save_distributed_checkpoint

    coll, opt = build()
    run(coll, opt, range(15))
    save_distributed_checkpoint(coll, tmp_path / "dcp", {"rw": opt})
    coll, opt = build()
    load_distributed_checkpoint(coll, tmp_path / "dcp", sparse_optimizers={"rw": opt})
    assert first + run(coll, opt, range(15, 30)) == straight


@pytest.mark.parametrize("kwargs, named", [
    (dict(num_embeddings=0), "num_embeddings"),
    (dict(dynamic=DynamicConfig(keep_floor=20)), "keep_floor"),
    (dict(hashed=True), "hashed"),
    (dict(keys=Keys.FIXED, dynamic=DynamicConfig()), "dynamic="),
])
def test_bad_settings_are_refused_naming_the_setting(kwargs, named):
    base = dict(name="t", num_embeddings=10, embedding_dim=D, keys=Keys.DYNAMIC)
    with pytest.raises(ValueError, match=named):
        TableConfig(**{**base, **kwargs})


@pytest.mark.parametrize("field, value", [("admit_after", 0), ("admit_probability", 0.0), ("ttl_steps", 0),
                                          ("evict_chunk", 0), ("sketch_width", 100), ("keep_floor", -1)])
def test_bad_admission_or_eviction_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DynamicConfig(**{field: value})


def test_float_keys_are_refused_naming_the_table():
    table = HostEmbedding(TableConfig("user_id", 10, D, keys=Keys.DYNAMIC))
    with pytest.raises(ValueError, match="user_id.*int64"):
        table(torch.tensor([1.5, 2.0]))


def test_a_prefetcher_prepares_the_fixed_tables_and_leaves_the_dynamic_ones_to_their_step():
    """A dynamic table (capped, evicting) beside a fixed one of another width: prefetched, the fixed
    group's plans are built ahead on the worker, the dynamic group's at its lookup; training equals
    training without the prefetcher, step for step."""
    from hetero.embedding import Prefetcher
    from hetero.embedding.prefetch import looked_up_at_step

    def build():
        torch.manual_seed(0)
        coll = HostEmbeddingCollection([
            TableConfig("user", 20, D, keys=Keys.DYNAMIC, init_std=0.1,
                        dynamic=DynamicConfig(admit_after=2, evict_chunk=3, sketch_width=1 << 10)),
            TableConfig("item", 30, 2 * D, init_std=0.1)])
        return coll, SparseOptimizerKind.LAZY_ADAM.optimizer(coll.tables.values())

    stream = key_stream(30, 90, seed=4)
    batches = [{"user": torch.from_numpy(k[:B]), "item": torch.from_numpy(k[B : 2 * B] % 30)} for k in stream]

    def run(coll, opt, batches):
        losses = []
        for b in batches:
            opt.zero_grad()
            out = coll(b)
            loss = (out["user"].sum(1) * out["item"].sum(1)).square().sum()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    coll, opt = build()
    straight = run(coll, opt, batches)
    assert coll.tables["user"].keymap.stats.evicted > 0
    coll, opt = build()
    prefetched = Prefetcher(coll, batches, features=lambda b: b)
    assert looked_up_at_step(coll) == ["user"]
    dynamic = next(i for i, g in enumerate(coll.groups) if g.dynamic.tables)
    ahead = prefetched._prepare_batch(batches[0])[0]  # (the collection's, a plan a group)
    assert ahead[dynamic] is None and all(p is not None for i, p in enumerate(ahead) if i != dynamic)
    assert run(coll, opt, prefetched) == straight and coll.mismatched_plans == 0


def test_a_state_dict_without_the_key_map_is_refused_and_a_fixed_table_has_none():
    dyn = HostEmbedding(TableConfig("user_id", 10, D, keys=Keys.DYNAMIC))
    fixed = HostEmbedding(TableConfig("user_id", 11, D))
    assert "keymap.row_key" in dyn.state_dict() and not any("keymap" in k for k in fixed.state_dict())
    with pytest.raises(RuntimeError, match="Missing key.*keymap.row_key"):
        dyn.load_state_dict(fixed.state_dict())
    with pytest.raises(RuntimeError, match="Unexpected key.*keymap.row_key"):
        fixed.load_state_dict(dyn.state_dict())


def test_admission_by_probability_admits_about_that_share_of_sightings_reproducibly():
    c = DynamicConfig(admit_probability=0.25)
    keys = np.arange(20_000, dtype=np.int64) * 7919  # each key sighted once
    runs = []
    for _ in range(2):
        m = KeyMap("t", 30_000, c, seed=5)
        rows, new = m.translate(keys, 0)
        runs.append(np.sort(new.keys))
        assert np.array_equal(rows == 30_000, ~np.isin(keys, new.keys))  # the others read the default row
    assert np.array_equal(runs[0], runs[1])  # the same draws for the same keys, step and seed
    assert 0.23 < runs[0].shape[0] / keys.shape[0] < 0.27  # binomial: 0.25 +- 7 standard deviations


def test_a_new_keys_initial_row_is_normal_with_the_tables_std():
    """The per-key draws (no torch generator: a stream seeded by the key) against N(0, std**2):
    moments, a Kolmogorov-Smirnov test, and no correlation between a row's values."""
    from scipy import stats

    values = KeyMap("t", 10, DynamicConfig(), seed=7).init_rows(np.arange(50_000, dtype=np.int64) * 7919, 16, 0.05)
    assert abs(values.mean()) < 1e-3 and abs(values.std() / 0.05 - 1) < 0.01
    assert stats.kstest(values.ravel() / 0.05, "norm").pvalue > 1e-3
    assert abs(np.corrcoef(values[:, 0], values[:, 1])[0, 1]) < 0.02
    # the tail past 3.5 std (the ziggurat's base strip ends at 3.65): 2 * sf(3.5) of the draws, +- 6 sd
    expected = 2 * stats.norm.sf(3.5) * values.size
    assert abs((np.abs(values) > 3.5 * 0.05).sum() - expected) < 6 * np.sqrt(expected)
    assert np.array_equal(values[:5], KeyMap("t", 10, DynamicConfig(), seed=7).init_rows(np.arange(5) * 7919, 16, 0.05))


def test_use_counts_saturate_at_int32s_top_whatever_the_threads_order():
    """The count pass adds on every core (atomic adds): a count near the top saturates there, as the
    serial count did, and a sketch counter too."""
    m = KeyMap("t", 4, DynamicConfig(admit_after=3, sketch_width=64))
    m.translate(np.array([7], np.int64), 0)
    m.translate(np.array([7, 7], np.int64), 0)  # admitted at the third sighting
    row = int(m.lookup(np.array([7], np.int64))[0])
    m.stat[row, 0] = 2**31 - 4
    m.sketch[:] = 2**31 - 4
    keys = np.array([7] * 20_000 + [8] * 20_000, np.int64)  # (several chunks of the parallel pass)
    m.translate(keys, 1)
    assert int(m.stat[row, 0]) == 2**31 - 1
    assert int(m.sketch.max()) == 2**31 - 1 and int(m.sketch.min()) >= 0
