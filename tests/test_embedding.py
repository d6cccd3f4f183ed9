"""HostEmbedding against dense nn.Embedding / nn.EmbeddingBag references."""

import pytest
import torch
from torch import nn

from hetero.embedding import HostEmbedding, HostEmbeddingCollection, Pooling, TableConfig, dense_parameters, host_tables


def _pair(vocab=50, dim=8, pooling=Pooling.NONE, seed=0):
    torch.manual_seed(seed)
    host = HostEmbedding(TableConfig("t", vocab, dim, pooling=pooling, init_std=1.0))
    return host, host.weight.detach().clone()


def _dense_grad(sparse_grad, vocab, dim):
    dense = torch.zeros(vocab, dim)
    dense[sparse_grad.ids] = sparse_grad.rows
    return dense


def test_unpooled_forward_and_backward_equal_nn_embedding():
    host, w = _pair()
    ref = nn.Embedding(50, 8, sparse=True)
    ref.weight.data.copy_(w)
    ids = torch.randint(0, 50, (32, 5))
    ids[0, :] = 7  # repeated ids must be coalesced
    upstream = torch.randn(32, 5, 8)

    out = host(ids)
    (out * upstream).sum().backward()
    ref_out = ref(ids)
    (ref_out * upstream).sum().backward()

    assert torch.equal(out, ref_out)
    g = host.pop_sparse_grad()
    first_seen = list(dict.fromkeys(ids.reshape(-1).tolist()))
    assert g.ids.tolist() == first_seen  # unique ids only, in first-occurrence order
    torch.testing.assert_close(_dense_grad(g, 50, 8), ref.weight.grad.to_dense(), rtol=0, atol=1e-6)
    assert host.weight.grad is None  # the table never gets a dense gradient


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN])
def test_bags_with_offsets_equal_nn_embedding_bag(pooling):
    host, w = _pair(pooling=pooling)
    ref = nn.EmbeddingBag(50, 8, mode=pooling.value, include_last_offset=True)
    ref.weight.data.copy_(w)
    ids = torch.tensor([3, 3, 9, 1, 40, 3, 9])
    offsets = torch.tensor([0, 3, 3, 5, 7])  # bag 1 is empty
    upstream = torch.randn(4, 8)

    out = host(ids, offsets)
    (out * upstream).sum().backward()
    ref_out = ref(ids, offsets)
    (ref_out * upstream).sum().backward()

    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    assert torch.equal(out[1], torch.zeros(8))
    torch.testing.assert_close(_dense_grad(host.pop_sparse_grad(), 50, 8), ref.weight.grad, rtol=0, atol=1e-6)


def test_two_dimensional_ids_pool_over_last_dim():
    host, w = _pair(pooling=Pooling.SUM)
    ids = torch.randint(0, 50, (6, 4))
    torch.testing.assert_close(host(ids), w[ids].sum(1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN])
@pytest.mark.parametrize("beside", ["per_id", "bags_of_three"])
def test_bags_of_one_id_equal_nn_embedding_bag(pooling, beside):
    """``(B, 1)`` ids pooled against torch's ``EmbeddingBag``, outputs and gradients, in one group
    lookup with a per-id table (bags of one take the per-id path, no bag offsets) or with a table
    of bags of three (the bag path)."""
    torch.manual_seed(0)
    other = TableConfig("b", 30, 8, init_std=1.0, pooling=Pooling.NONE if beside == "per_id" else Pooling.SUM)
    coll = HostEmbeddingCollection([TableConfig("a", 50, 8, pooling=pooling, init_std=1.0), other])
    ref = nn.EmbeddingBag(50, 8, mode=pooling.value)
    ref.weight.data.copy_(coll.tables["a"].weight.detach())
    ids = torch.randint(0, 50, (32, 1))
    ids[:4] = 7  # repeated ids
    upstream = torch.randn(32, 8)
    out = coll({"a": ids, "b": torch.randint(0, 30, (32,) if beside == "per_id" else (32, 3))})
    assert out["a"].shape == (32, 8)
    (out["a"] * upstream).sum().backward()
    (ref(ids) * upstream).sum().backward()
    torch.testing.assert_close(out["a"], ref(ids), rtol=0, atol=1e-6)
    g = coll.tables["a"].pop_sparse_grad()
    rows = g.ids - coll.tables["a"].group_row
    keep = (rows >= 0) & (rows < 50)
    dense = torch.zeros(50, 8).index_put_((rows[keep],), g.rows[keep], accumulate=True)
    torch.testing.assert_close(dense, ref.weight.grad, rtol=0, atol=1e-6)


def _table_grad(table, n, g=None):
    """The dense ``(n, D)`` gradient of ``table`` in its group's sparse gradient ``g`` (default: popped)."""
    g = table.pop_sparse_grad() if g is None else g
    rows = g.ids - table.group_row
    keep = (rows >= 0) & (rows < n)
    return torch.zeros(n, g.rows.shape[1]).index_put_((rows[keep],), g.rows[keep], accumulate=True)


def test_a_lookups_outputs_and_gradients_are_the_callers_own():
    """A group lookup of three tables, one output scaled in place, one unused, and the caller's
    gradient tensors overwritten after backward (before the optimizer reads them), against torch's
    ``Embedding`` / ``EmbeddingBag``: the outputs are tensors of their own (autograd refuses in-place
    changes of a custom Function's view outputs) and the gradient a copy (not the caller's tensor)."""
    torch.manual_seed(0)
    coll = HostEmbeddingCollection([TableConfig("a", 50, 8, init_std=1.0), TableConfig("b", 30, 8, pooling=Pooling.SUM,
                                                                                       init_std=1.0),
                                    TableConfig("c", 20, 8, init_std=1.0)])
    ref_a, ref_b = nn.Embedding(50, 8), nn.EmbeddingBag(30, 8, mode="sum")
    ref_a.weight.data.copy_(coll.tables["a"].weight.detach())
    ref_b.weight.data.copy_(coll.tables["b"].weight.detach())
    ids_a, ids_b = torch.randint(0, 50, (16,)), torch.randint(0, 30, (16, 3))
    up_a, up_b = torch.randn(16, 8), torch.randn(16, 8)
    out = coll({"a": ids_a, "b": ids_b, "c": torch.randint(0, 20, (16,))})
    out["a"].mul_(2.0)  # in place, on the lookup's output
    torch.autograd.backward([out["a"], out["b"]], [up_a, up_b])
    ref = ref_a(ids_a).mul_(2.0)
    torch.testing.assert_close(out["a"], ref, rtol=0, atol=1e-6)
    torch.autograd.backward([ref, ref_b(ids_b)], [up_a, up_b])
    up_a.zero_(), up_b.zero_()  # the caller reuses its gradient buffers before the step
    g = coll.tables["a"].pop_sparse_grad()  # (the group's: the three tables share one)
    torch.testing.assert_close(_table_grad(coll.tables["a"], 50, g), ref_a.weight.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(_table_grad(coll.tables["b"], 30, g), ref_b.weight.grad, rtol=0, atol=1e-6)
    assert not _table_grad(coll.tables["c"], 20, g).any()  # an unused output: no gradient, not garbage

    host, w = _pair()  # one table: its gradient arrives as the caller's own tensor, and is copied
    ids = torch.randint(0, 50, (16,))
    up = torch.randn(16, 8)
    host(ids).backward(up)
    expected = torch.zeros(50, 8).index_put_((ids,), up.clone(), accumulate=True)
    up.zero_()
    torch.testing.assert_close(_table_grad(host, 50), expected, rtol=0, atol=1e-6)


def test_gradient_accumulates_over_forwards_until_popped():
    host, _ = _pair()
    host(torch.tensor([1, 2])).sum().backward()
    host(torch.tensor([2, 3])).sum().backward()
    g = host.pop_sparse_grad()
    assert g.ids.tolist() == [1, 2, 3]
    assert g.rows[:, 0].tolist() == [1.0, 2.0, 1.0]
    assert host.pop_sparse_grad() is None


def test_no_gradient_captured_without_grad_mode():
    host, _ = _pair()
    with torch.no_grad():
        host(torch.tensor([1, 2]))
    assert host.pop_sparse_grad() is None


@pytest.mark.parametrize("bad", [50, 1000, -1])
def test_out_of_range_id_names_table_id_and_vocab(bad):
    host, w = _pair()
    with pytest.raises(IndexError) as err:
        host(torch.tensor([[1, bad], [2, 3]]))
    assert str(err.value) == (
        f"table 't': id {bad} is out of range for vocab size 50 (valid ids are 0..49); fix the feature "
        "encoding or set hashed=True on this table to hash ids into range"
    )
    assert torch.equal(host.weight, w)


def test_hashed_table_maps_ids_into_range():
    torch.manual_seed(0)
    host = HostEmbedding(TableConfig("h", 10, 4, hashed=True, init_std=1.0))
    ids = torch.tensor([3, 13, -7, 10**12 + 3])
    torch.testing.assert_close(host(ids), host.weight[torch.tensor([3, 3, 3, 3])], rtol=0, atol=0)


def test_bad_offsets_and_dtype_raise_value_error():
    host, _ = _pair(pooling=Pooling.SUM)
    with pytest.raises(ValueError, match="offsets must be 1-D of length B \\+ 1"):
        host(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="ids must be int64 or int32, got torch.float32"):
        host(torch.tensor([1.0]))


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_decreasing_offsets_are_refused_before_any_kernel_reads_ids(grad):
    # These read past the end of ``ids`` in the pooling kernels (a segfault for [0, 1000, 3]).
    host, _ = _pair(pooling=Pooling.SUM)
    ids = torch.tensor([1, 2, 3])
    with torch.set_grad_enabled(grad):
        for offsets, msg in (([0, 1000, 3], r"offsets\[1\] = 1000 > offsets\[2\] = 3"),
                             ([0, 2, 1, 3], r"offsets\[1\] = 2 > offsets\[2\] = 1")):
            with pytest.raises(ValueError, match=r"table 't': offsets must be non-decreasing .*" + msg):
                host(ids, torch.tensor(offsets))
        coll = HostEmbeddingCollection([TableConfig("t", 100, 4, pooling=Pooling.SUM)])
        with pytest.raises(ValueError, match="offsets must be non-decreasing"):
            coll({"t": (ids, torch.tensor([0, 1000, 3]))})


def test_to_and_dtype_casts_leave_table_on_host_in_fp32():
    model = nn.Module()
    model.emb = HostEmbedding(TableConfig("t", 20, 4))
    model.mlp = nn.Linear(4, 1)
    model.to(torch.float64)
    assert model.emb.weight.dtype == torch.float32 and model.emb.weight.device.type == "cpu"
    assert model.mlp.weight.dtype == torch.float64
    assert model.emb(torch.tensor([1])).dtype == torch.float64  # rows delivered in the model's dtype
    assert [id(p) for p in dense_parameters(model)] == [id(model.mlp.weight), id(model.mlp.bias)]
    assert list(host_tables(model)) == ["emb"]


def test_collection_routes_features_and_reports_missing_feature():
    coll = HostEmbeddingCollection([TableConfig("a", 5, 2), TableConfig("b", 7, 3, feature="x", pooling=Pooling.SUM)])
    out = coll({"a": torch.tensor([1, 2]), "x": (torch.tensor([1, 2, 6]), torch.tensor([0, 1, 3]))})
    assert out["a"].shape == (2, 2) and out["b"].shape == (2, 3)
    with pytest.raises(KeyError, match="table 'b' looks up feature 'x', which is not in the batch"):
        coll({"a": torch.tensor([1])})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_table_never_reaches_the_device():
    model = nn.Module()
    model.emb = HostEmbedding(TableConfig("t", 1000, 16, pooling=Pooling.MEAN))
    model.mlp = nn.Linear(16, 1)
    model.cuda()
    assert model.emb.weight.device.type == "cpu"
    ids, offsets = torch.randint(0, 1000, (64,)), torch.arange(0, 65, 4)
    out = model.mlp(model.emb(ids, offsets))
    assert out.device.type == "cuda"
    out.sum().backward()
    g = model.emb.pop_sparse_grad()
    assert g.ids.device.type == "cpu" and g.rows.device.type == "cpu" and g.rows.is_pinned()
    assert model.emb.weight.device.type == "cpu" and model.emb.weight.grad is None
    ref = nn.EmbeddingBag(1000, 16, mode="mean", include_last_offset=True)
    ref.weight.data.copy_(model.emb.weight)
    torch.testing.assert_close(out.cpu(), model.mlp.cpu()(ref(ids, offsets)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooling, ids, offsets", [
    (Pooling.NONE, [3, 4, 5], None),
    (Pooling.NONE, [[1, 2], [3, 4], [5, 6]], None),  # (B, L) ids looked up each: (B, L, D)
    (Pooling.SUM, [[1, 2], [3, 4], [5, 6]], None),  # (B, L) bags: (B, D)
    (Pooling.MEAN, [[1], [3], [5]], None),  # bags of one: the per-id path
    (Pooling.SUM, [1, 2, 3, 4, 5], [0, 2, 2, 5]),  # offsets: a row per bag
])
def test_a_fake_lookup_has_the_shape_of_the_real_one(pooling, ids, offsets):
    """The planner captures a model on fake tensors: a table's fake output must have the real
    output's shape (it prices the ops after it by their shapes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    coll = HostEmbeddingCollection([TableConfig("t", 10, 4, pooling=pooling)])
    ids = torch.tensor(ids)
    real = coll({"t": (ids, torch.tensor(offsets)) if offsets else ids})["t"]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_ids = mode.from_tensor(ids)
        fake = coll({"t": (fake_ids, mode.from_tensor(torch.tensor(offsets))) if offsets else fake_ids})["t"]
    assert tuple(fake.shape) == tuple(real.shape)


def test_an_exchange_that_starts_nothing_ahead_refuses_start():
    from hetero.embedding.exchange import LocalRows

    exchange = LocalRows(10)
    assert not exchange.starts_lookups()
    with pytest.raises(TypeError, match="LocalRows starts no lookups ahead"):
        exchange.start(None)  # (refused before it reads the plan)
