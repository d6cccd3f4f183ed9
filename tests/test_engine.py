"""The fused host engine: kernels, table groups, determinism, prefetch hazards, lazy import."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hetero.embedding import (
    HostEmbedding,
    HostEmbeddingCollection,
    Pooling,
    PrefetchConfig,
    Prefetcher,
    TableConfig,
    set_num_threads,
)
from hetero.optim import FTRL, SGD, Adagrad, AdagradConfig, FTRLConfig, LazyAdam, LazyAdamConfig, RowWiseAdagrad, RowWiseAdagradConfig, SGDConfig

OPTIMIZERS = [
    (LazyAdam, LazyAdamConfig(lr=0.05)),
    (FTRL, FTRLConfig(lr=0.1, l1=0.01, l2=0.1, initial_accumulator=0.1)),
    (Adagrad, AdagradConfig(lr=0.1)),
    (RowWiseAdagrad, RowWiseAdagradConfig(lr=0.1)),
    (SGD, SGDConfig(lr=0.1)),
]


def reference_update(kind, config, w, state, g, t):
    """One row's update by the published rule, in float64 (``state`` is a dict, mutated)."""
    c = config
    if kind is LazyAdam:
        state["m"] = c.beta1 * state.get("m", 0) + (1 - c.beta1) * g
        state["v"] = c.beta2 * state.get("v", 0) + (1 - c.beta2) * g * g
        return w - c.lr * np.sqrt(1 - c.beta2**t) / (1 - c.beta1**t) * state["m"] / (np.sqrt(state["v"]) + c.eps)
    if kind is FTRL:
        n = state.get("n", np.full_like(g, c.initial_accumulator))
        z = state.get("z", np.zeros_like(g)) + g - (np.sqrt(n + g * g) - np.sqrt(n)) / c.lr * w
        state["n"], state["z"] = n + g * g, z
        w_new = -(z - np.sign(z) * c.l1) / ((c.beta + np.sqrt(state["n"])) / c.lr + c.l2)
        return np.where(np.abs(z) <= c.l1, 0.0, w_new)
    if kind is Adagrad:
        state["s"] = state.get("s", c.initial_accumulator) + g * g
        return w - c.lr * g / (np.sqrt(state["s"]) + c.eps)
    if kind is RowWiseAdagrad:
        state["s"] = state.get("s", c.initial_accumulator) + np.mean(g * g)
        return w - c.lr * g / (np.sqrt(state["s"]) + c.eps)
    return w - c.lr * g


@pytest.mark.parametrize("kind,config", OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
def test_fused_kernels_equal_reference_with_duplicates_empty_and_10k_repeats(kind, config):
    torch.manual_seed(1)
    table = HostEmbedding(TableConfig("t", 40, 8, pooling=Pooling.SUM, init_std=0.3))
    opt = kind([table], config)
    w = table.weight.double().numpy().copy()
    states = {}
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.tensor([3, 3, 7, 3, 39, 0]), torch.tensor([0, 2, 2, 6])),  # duplicates, an empty bag
        (torch.tensor([], dtype=torch.int64), torch.tensor([0, 0])),  # an empty batch: no update
        (torch.full((10_000,), 5), torch.tensor([0, 10_000])),  # one id repeated 10,000 times
        (torch.tensor([5, 3, 11]), torch.tensor([0, 1, 3])),
    ]
    t = 0
    for ids, offsets in batches:
        bags = offsets.numel() - 1
        # upstream values that are multiples of 1/64: the 10,000-fold sum is exact in fp32
        upstream = torch.randint(-32, 33, (bags, 8), generator=g).float() / 64
        opt.zero_grad()
        (table(ids, offsets) * upstream).sum().backward()
        opt.step()
        if ids.numel() == 0:
            continue
        t += 1
        grads = {}
        for b in range(bags):
            for i in ids[offsets[b]: offsets[b + 1]].tolist():
                grads[i] = grads.get(i, 0) + upstream[b].double().numpy()
        for i, gi in grads.items():
            w[i] = reference_update(kind, config, w[i], states.setdefault(i, {}), gi, t)
    np.testing.assert_allclose(table.weight.double().numpy(), w, rtol=1e-6, atol=1e-6)
    assert opt.steps["t"] == 3


@pytest.mark.parametrize("sort", [False, True], ids=["marker", "sort"])
@pytest.mark.parametrize("case", ["per_id", "sum", "mean", "repeated", "empty"])
def test_dedup_beside_pooling_equals_dedup_then_pooling_bitwise(case, sort):
    from hetero.embedding.kernels import dedup_kernels, kernels

    K = kernels()
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((500, 8)).astype(np.float32)
    n = {"empty": 0, "repeated": 10_000}.get(case, 5_000)  # 5,000 ids: several pooling chunks
    ids = np.full(n, 7) if case == "repeated" else rng.integers(0, 500, n)
    offsets, scale = np.empty(0, np.int64), np.empty(0, np.float32)
    if case in ("sum", "mean"):
        offsets = np.concatenate([[0], np.sort(rng.integers(0, n + 1, 1_500)), [n]])  # empty bags too
        if case == "mean":
            lengths = np.diff(offsets)
            scale = np.repeat(1 / np.maximum(lengths, 1), lengths).astype(np.float32)
    bags = offsets.shape[0] - 1 if offsets.shape[0] else n
    want = np.empty((bags, 8), np.float32)
    marker = np.zeros(0 if sort else 500, np.int64)
    expected = [x.copy() for x in dedup_kernels().dedup(ids, marker, 1, np.empty(n, np.int64), np.empty(n, np.int64))]
    K.pool_forward(rows, ids, offsets, scale, want)
    for threads in (1, 2):
        out = np.full((bags, 8), np.nan, np.float32)
        got = K.dedup_pool(ids, marker, 1 + threads, np.empty(n, np.int64), np.empty(n, np.int64), rows, offsets,
                           scale, out, threads)
        for name, a, b in zip(("unique", "inverse", "first", "next"), got, expected):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}, {threads} thread(s)")
        np.testing.assert_array_equal(out, want, err_msg=f"pooled rows, {threads} thread(s)")


def test_host_lookup_dedups_beside_pooling_and_fills_the_plan():
    from hetero.embedding.group import Request

    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", 100, 4))
    ids = torch.randint(0, 100, (64, 3), generator=torch.Generator().manual_seed(1))
    plan = table.group.plan([Request(table, ids)], dedup=False)
    assert plan.unique is None  # left to the lookup
    out = table.group.lookup([Request(table, ids)], plan)[0]
    ref = table.group.plan([Request(table, ids)])
    for name in ("unique", "inverse", "first", "next"):
        assert torch.equal(getattr(plan, name), getattr(ref, name)), name
    assert torch.equal(out, table.weight[ids])
    with torch.no_grad():  # no backward follows: the lookup pools without deduplicating
        plan = table.group.plan([Request(table, ids)], dedup=False)
        assert torch.equal(table.group.lookup([Request(table, ids)], plan)[0], out)
    assert plan.unique is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tables_update_in_fp32_and_round_once(dtype):
    torch.manual_seed(0)
    ref = HostEmbedding(TableConfig("t", 30, 4, init_std=0.5))
    low = HostEmbedding(TableConfig("t", 30, 4, init_std=0.5, dtype=dtype))
    low.weight.data.copy_(ref.weight.to(dtype))
    ref.weight.data.copy_(low.weight.float())  # both start from the same representable values
    opts = [LazyAdam([ref], LazyAdamConfig(lr=0.01)), LazyAdam([low], LazyAdamConfig(lr=0.01))]
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        ids = torch.randint(0, 30, (16,), generator=g)
        upstream = torch.randn(16, 4, generator=g)
        for table, opt in zip((ref, low), opts):
            opt.zero_grad()
            (table(ids) * upstream).sum().backward()
            opt.step()
    assert low.weight.dtype == dtype
    # the loss is linear in the rows, so the fp32 state is the same bit for bit
    assert torch.equal(opts[0].table_state["t"]["exp_avg_sq"], opts[1].table_state["t"]["exp_avg_sq"])
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(low.weight.float(), ref.weight, rtol=5 * eps, atol=5 * eps)


def _collection(seed=0):
    torch.manual_seed(seed)
    return HostEmbeddingCollection([
        TableConfig("a", 50, 8, init_std=0.5), TableConfig("b", 30, 8, init_std=0.5, pooling=Pooling.MEAN),
        TableConfig("c", 20, 8, init_std=0.5, hashed=True), TableConfig("w", 40, 1, init_std=0.5),
    ])


def _features(g):
    return {
        "a": torch.randint(0, 50, (32, 3), generator=g),
        "b": (torch.randint(0, 30, (70,), generator=g), torch.sort(torch.randint(0, 71, (33,), generator=g)).values.index_fill_(0, torch.tensor([0, 32]), 0).index_fill_(0, torch.tensor([32]), 70)),
        "c": torch.randint(-1000, 1000, (32,), generator=g),
        "w": torch.randint(0, 40, (32,), generator=g),
    }


def test_collection_groups_tables_and_equals_standalone_tables_bitwise():
    coll = _collection()
    assert [[t.name for t in grp.tables] for grp in coll.groups] == [["a", "b", "c"], ["w"]]
    alone = {name: HostEmbedding(t.config) for name, t in coll.tables.items()}
    for name, t in alone.items():
        t.weight.data.copy_(coll.tables[name].weight)
    opt_c = LazyAdam(coll.tables.values(), LazyAdamConfig(lr=0.05))
    opt_a = LazyAdam(alone.values(), LazyAdamConfig(lr=0.05))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        feats = _features(g)
        ups = {"a": torch.randn(32, 3, 8, generator=g), "b": torch.randn(32, 8, generator=g),
               "c": torch.randn(32, 8, generator=g), "w": torch.randn(32, 1, generator=g)}
        out_c = coll(feats)
        out_a = {n: (t(*feats[n]) if isinstance(feats[n], tuple) else t(feats[n])) for n, t in alone.items()}
        for n in ups:
            assert torch.equal(out_c[n], out_a[n]), n
        for opt, out in ((opt_c, out_c), (opt_a, out_a)):
            opt.zero_grad()
            torch.autograd.backward([out[n] for n in ups], [ups[n] for n in ups])
            opt.step()
    for n in alone:
        assert torch.equal(coll.tables[n].weight, alone[n].weight), n
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_c.table_state[n][s], opt_a.table_state[n][s])


def test_out_of_range_id_in_any_table_fails_before_anything_changes():
    coll = _collection()
    opt = LazyAdam(coll.tables.values())
    before = {n: t.weight.clone() for n, t in coll.tables.items()}
    feats = _features(torch.Generator().manual_seed(0))
    feats["w"] = feats["w"].clone()
    feats["w"][17] = 40
    with pytest.raises(IndexError, match=r"table 'w': id 40 is out of range for vocab size 40"):
        coll(feats)
    opt.step()
    assert all(torch.equal(t.weight, before[n]) for n, t in coll.tables.items())
    assert all(s == 0 for s in opt.steps.values())


def test_optimizer_must_own_whole_groups():
    coll = _collection()
    with pytest.raises(ValueError, match=r"table 'a' shares storage with tables \['b', 'c'\]"):
        LazyAdam([coll.tables["a"]])


def _train(threads, prefetch=None, steps=6, rebuild=False, skip=None, on_step=None):
    set_num_threads(threads)
    try:
        coll = _collection()
        opt = FTRL(coll.tables.values(), FTRLConfig(lr=0.2, l1=0.01))
        g = torch.Generator().manual_seed(5)
        # consecutive batches share rows: every batch hits rows 0..9 of table 'a'
        batches = []
        for _ in range(steps):
            f = _features(g)
            f["a"][:, 0] = torch.arange(32) % 10
            batches.append(f)
        # rebuild: a new mapping around the same tensors, for the prefetcher and again for the model
        it = batches if prefetch is None else Prefetcher(coll, batches, prefetch,
                                                         features=(lambda b: dict(b)) if rebuild else (lambda b: b))
        outs = []
        for i, feats in enumerate(it):
            if i == skip:  # the model is called with another batch than the one prepared
                feats = _features(torch.Generator().manual_seed(99))
            opt.zero_grad()
            out = coll(dict(feats) if rebuild else feats)
            assert len(coll._prepared) <= 1
            outs.append({n: o.detach().clone() for n, o in out.items()})
            sum((o * (k + 1)).sum() for k, o in enumerate(out.values())).backward()
            opt.step()
            if on_step is not None:
                on_step()
        return coll, outs, it, batches
    finally:
        set_num_threads(None)


def test_results_do_not_depend_on_the_thread_count():
    from hetero.embedding.kernels import num_threads

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: there is no second thread count to compare")
    set_num_threads(2)
    try:
        if num_threads() < 2:  # numba's pool was sized to one thread (OMP_NUM_THREADS=1, as under pytest -n)
            pytest.skip("numba's thread pool holds one thread: there is no second thread count to compare")
    finally:
        set_num_threads(None)
    counts = []
    one = _train(1, on_step=lambda: counts.append(num_threads()))[0]
    two = _train(2, on_step=lambda: counts.append(num_threads()))[0]
    assert set(counts[:6]) == {1} and set(counts[6:]) == {2}  # the kernels really ran with 1, then 2 threads
    for n in one.tables:
        assert torch.equal(one.tables[n].weight, two.tables[n].weight), n


def test_prefetched_rows_are_never_stale():
    # worker=False prepares batch i+1 (gathering its rows) before batch i's update, every time:
    # the read-after-write hazard is certain, not left to thread timing.
    ref, ref_outs, _, _ = _train(2)
    pre, pre_outs, prefetcher, batches = _train(2, PrefetchConfig(gather_rows=True, worker=False))
    touched = [{"a": set(f["a"].reshape(-1).tolist()), "b": set(f["b"][0].tolist()),
                "c": set((f["c"] % 20).tolist()), "w": set(f["w"].tolist())} for f in batches]
    expected = sum(len(cur[n] & prev[n]) for prev, cur in zip(touched[:-1], touched[1:]) for n in cur)
    assert expected > 0 and prefetcher.refreshed_rows == expected  # exactly the rows the previous step updated
    for a, b in zip(ref_outs, pre_outs):
        for n in a:
            assert torch.equal(a[n], b[n]), n
    for n in ref.tables:
        assert torch.equal(ref.tables[n].weight, pre.tables[n].weight)


def test_prefetch_on_a_worker_thread_is_exact():
    ref, ref_outs, _, _ = _train(2)
    pre, pre_outs, _, _ = _train(2, PrefetchConfig(gather_rows=True))
    assert all(torch.equal(a[n], b[n]) for a, b in zip(ref_outs, pre_outs) for n in a)


def test_staleness_bound_allows_stale_rows_only_when_configured():
    ref, ref_outs, _, _ = _train(2)
    _, stale_outs, prefetcher, _ = _train(2, PrefetchConfig(gather_rows=True, max_staleness=1, worker=False))
    assert prefetcher.refreshed_rows == 0
    assert not torch.equal(ref_outs[-1]["a"], stale_outs[-1]["a"])  # this test can see stale reads


def test_prefetch_without_early_gather_is_exact_and_cleans_up():
    ref, ref_outs, _, _ = _train(2)
    pre, pre_outs, _, _ = _train(2, PrefetchConfig())
    assert all(torch.equal(a[n], b[n]) for a, b in zip(ref_outs, pre_outs) for n in a)
    assert len(pre._prepared) == 0
    # rows read at their step cannot be stale: no update versions are kept (a random write per
    # updated row into a table-sized array, every step)
    assert all(g.row_version is None for g in pre.groups)
    gathered, _, _, _ = _train(2, PrefetchConfig(gather_rows=True))
    assert all(g.row_version is not None for g in gathered.groups)


def test_a_prefetcher_refuses_to_gather_rows_whose_updates_it_does_not_track():
    # (tables moved to a device after the prefetcher was built would gather ahead untracked)
    coll = _collection()
    prefetcher = Prefetcher(coll, [_features(torch.Generator().manual_seed(0))], PrefetchConfig(worker=False),
                            features=lambda b: b)
    prefetcher.config = PrefetchConfig(gather_rows=True, worker=False)
    with pytest.raises(RuntimeError, match=r"moved to cpu after the Prefetcher was built; build it after placing"):
        next(iter(prefetcher))


def test_prefetch_plans_match_a_feature_mapping_rebuilt_per_batch():
    # The plans follow the ids, not the mapping object: a mapping rebuilt per batch (as a data
    # loader or a model's forward does) uses every prepared plan, and nothing accumulates.
    ref, ref_outs, _, _ = _train(2)
    pre, pre_outs, prefetcher, _ = _train(2, PrefetchConfig(gather_rows=True, worker=False), rebuild=True)
    assert pre.mismatched_plans == 0 and prefetcher.refreshed_rows > 0  # the prepared rows were used
    assert all(torch.equal(a[n], b[n]) for a, b in zip(ref_outs, pre_outs) for n in a)


def test_a_prepared_plan_for_other_ids_is_never_used():
    ref, ref_outs, _, _ = _train(2, skip=2)
    pre, pre_outs, _, _ = _train(2, PrefetchConfig(gather_rows=True, worker=False), skip=2)
    assert pre.mismatched_plans == 1
    assert all(torch.equal(a[n], b[n]) for a, b in zip(ref_outs, pre_outs) for n in a)
    for n in ref.tables:
        assert torch.equal(ref.tables[n].weight, pre.tables[n].weight)


def test_import_hetero_does_not_load_numba():
    code = "import sys, hetero, hetero.embedding, hetero.optim, hetero.train; print('numba' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
