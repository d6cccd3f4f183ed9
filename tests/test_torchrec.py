"""TorchRec models on hetero's tables (hetero.torchrec) against TorchRec itself on the CPU.

The reference is TorchRec's own execution: ``FusedEmbeddingBagCollection`` (FBGEMM's CPU
table-batched kernels, the optimizer fused into the backward) or an ``EmbeddingBagCollection``
with ``apply_optimizer_in_backward``; the same model, initial weights and batches are trained by
both, and every step's loss is compared. hetero's other placements (SSD tier, dynamic tables, rows
sharded over 2 ranks) are compared with hetero in memory, one process.
"""

from __future__ import annotations

import pytest
import torch
import torchrec.optim as trec_optim
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchRecEC
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import hetero.torchrec as ht
from hetero.optim import LazyAdamConfig, SparseOptimizerKind

T, B, DENSE, ROWS, D = 4, 32, 5, 60, 8
STEPS = 50
FEATURES = [f"f{i}" for i in range(T)]


def _tables(rows: int = ROWS, mean: bool = True) -> list[EmbeddingBagConfig]:
    # one table read by two features, a mean-pooled one (torch's weighted bags are sums only)
    out = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=rows, feature_names=[f"f{i}"]) for i in range(2)]
    out.append(EmbeddingBagConfig(name="t2", embedding_dim=D, num_embeddings=rows, feature_names=["f2", "f3"],
                                  pooling=PoolingType.MEAN if mean else PoolingType.SUM))
    return out


def _batches(count: int = STEPS, keys: int = ROWS, weighted: bool = False, seed: int = 1, one_id: bool = False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (T * B,), generator=g)  # (empty bags among them)
        if one_id:  # every bag one id (hetero looks them up without offsets)
            lengths = torch.ones_like(lengths)
        values = torch.randint(0, keys, (int(lengths.sum()),), generator=g)
        weights = torch.rand(values.shape, generator=g) if weighted else None
        kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths, weights=weights)
        out.append((torch.randn(B, DENSE, generator=g), kjt, torch.randint(0, 2, (B,), generator=g).float()))
    return out


def _model(kind: str, ebc: torch.nn.Module) -> torch.nn.Module:
    if kind == "dlrm":
        return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[16, D],
                    over_arch_layer_sizes=[16, 1])
    if kind == "dlrm_dcn":
        return DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[16, D],
                        over_arch_layer_sizes=[16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    return SimpleDeepFMNN(num_dense_features=DENSE, embedding_bag_collection=ebc, hidden_layer_size=16, deep_fm_dimension=4)


RULES = {"rowwise_adagrad": (trec_optim.RowWiseAdagrad, {"lr": 0.05, "eps": 1e-8}),
         "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-8}), "sgd": (torch.optim.SGD, {"lr": 10.0})}  # (a rate that moves the rows: B = 32, mean loss)


def _fused(kind: str, rule: str, tables=None) -> torch.nn.Module:
    torch.manual_seed(0)
    cls, kwargs = RULES[rule]
    ebc = FusedEmbeddingBagCollection(tables=tables or _tables(), optimizer_type=cls, optimizer_kwargs=kwargs,
                                      device=torch.device("cpu"))
    return _model(kind, ebc)


def _train(model: torch.nn.Module, batches) -> list[float]:
    dense = torch.optim.SGD([p for n, p in model.named_parameters() if "embedding_bag" not in n], lr=0.1)
    losses = []
    for x, kjt, y in batches:
        dense.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, kjt).reshape(-1), y)
        loss.backward()  # (both systems' table updates run inside it)
        dense.step()
        losses.append(loss.item())
    return losses


def _tables_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "embedding_bags" in k and k.endswith("weight")}


def _trains_as(reference: torch.nn.Module, ours: torch.nn.Module, batches, our_batches=None) -> None:
    """Both trained on ``batches``: every step's loss within 1e-5, the tables equal after, and the
    tables moved (an update that never ran would pass the rest)."""
    before = _tables_of(reference)
    expected, got = _train(reference, batches), _train(ours, our_batches or batches)
    assert max(abs(a - b) for a, b in zip(expected, got)) < 1e-5
    after, mine = _tables_of(reference), _tables_of(ours)
    assert max((after[k] - v).abs().max().item() for k, v in before.items()) > 1e-2
    for k, v in after.items():
        torch.testing.assert_close(mine[k], v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["dlrm", "dlrm_dcn", "deepfm"])
def test_torchrec_models_train_on_hetero_tables_as_on_torchrecs_fused_rowwise_adagrad(kind):
    batches = _batches()
    reference, ours = _fused(kind, "rowwise_adagrad"), ht.shard_modules(_fused(kind, "rowwise_adagrad"))
    assert isinstance(ours.get_submodule(_ebc_path(ours)), ht.EmbeddingBagCollection)
    assert sorted(ours.state_dict()) == sorted(reference.state_dict())
    _trains_as(reference, ours, batches)


def _ebc_path(model: torch.nn.Module) -> str:
    return next(n for n, m in model.named_modules() if isinstance(m, ht.EmbeddingBagCollection))


def test_a_backward_that_fails_before_its_end_does_not_stop_later_updates():
    model = ht.shard_modules(_fused("dlrm", "sgd"))
    x, kjt, y = _batches(count=1)[0]
    out = model.sparse_arch.embedding_bag_collection(kjt)
    out.values().register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("a failing hook")))  # (after hetero's)
    with pytest.raises(RuntimeError, match="a failing hook"):
        out.values().sum().backward()  # (its queued update is dropped with it)
    reference = _fused("dlrm", "sgd")
    reference.load_state_dict(model.state_dict())
    _trains_as(reference, model, _batches(count=5))  # (the tables move: every later backward updates them)


def test_a_feature_without_any_id_in_a_batch_trains_as_torchrec():
    g = torch.Generator().manual_seed(7)
    lengths = torch.cat([torch.zeros(B, dtype=torch.int64), torch.randint(0, 3, (3 * B,), generator=g)])  # f0: none
    kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.randint(0, ROWS, (int(lengths.sum()),), generator=g), lengths)
    batch = (torch.randn(B, DENSE, generator=g), kjt, torch.randint(0, 2, (B,), generator=g).float())
    _trains_as(_fused("dlrm", "rowwise_adagrad"), ht.shard_modules(_fused("dlrm", "rowwise_adagrad")), [batch] * 10)


def test_bags_of_one_id_take_the_lookup_without_offsets_and_train_the_same():
    _trains_as(_fused("dlrm", "rowwise_adagrad"), ht.shard_modules(_fused("dlrm", "rowwise_adagrad")),
               _batches(count=20, one_id=True))


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_sgd_and_adagrad_train_as_torchrecs_fused_ones(rule):
    _trains_as(_fused("dlrm", rule), ht.shard_modules(_fused("dlrm", rule)), _batches())


def _in_backward(rule: str, weighted: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    ebc = TorchRecEBC(tables=_tables(mean=not weighted), is_weighted=weighted, device=torch.device("cpu"))
    cls, kwargs = RULES[rule]
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    return _model("dlrm", ebc)


def test_apply_optimizer_in_backward_on_an_unsharded_collection_maps_to_the_same_rule():
    _trains_as(_in_backward("adagrad"), ht.shard_modules(_in_backward("adagrad")), _batches())


def test_weighted_bags_and_empty_bags_pool_as_torchrecs_collection():
    batches = _batches(count=10, weighted=True)
    assert any((kjt.lengths() == 0).any() for _, kjt, _ in batches)
    _trains_as(_in_backward("sgd", weighted=True), ht.shard_modules(_in_backward("sgd", weighted=True)), batches)
    # the weights are used: the same model with weights of one trains otherwise
    ones = [(x, KeyedJaggedTensor.from_lengths_sync(FEATURES, kjt.values(), kjt.lengths(), weights=torch.ones_like(kjt.weights())), y)
            for x, kjt, y in batches]
    with pytest.raises(AssertionError):
        _trains_as(_in_backward("sgd", weighted=True), ht.shard_modules(_in_backward("sgd", weighted=True)), batches, ones)


def test_state_dicts_load_both_ways_and_outputs_match():
    x, kjt, _ = _batches(count=1)[0]
    trained = _fused("dlrm", "sgd")
    _train(trained, _batches(count=3, seed=5))
    ours = ht.shard_modules(_fused("dlrm", "sgd"))
    ours.load_state_dict(trained.state_dict())  # a TorchRec checkpoint into the converted model
    with torch.no_grad():
        torch.testing.assert_close(ours(x, kjt), trained(x, kjt), atol=1e-6, rtol=0)
    _train(ours, _batches(count=3, seed=6))
    plain = _in_backward("sgd")
    plain.load_state_dict(ours.state_dict())  # the converted model's state into plain TorchRec
    with torch.no_grad():
        torch.testing.assert_close(plain(x, kjt), ours(x, kjt), atol=1e-6, rtol=0)


def test_an_embedding_collection_returns_torchrecs_jagged_rows():
    torch.manual_seed(0)
    configs = [EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=20, feature_names=["f0", "f1"]),
               EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=30, feature_names=["f2"])]
    reference = TorchRecEC(tables=configs, device=torch.device("cpu"))
    apply_optimizer_in_backward(torch.optim.SGD, reference.parameters(), {"lr": 0.1})
    ours = ht.shard_modules(TorchRecEC(tables=configs, device=torch.device("cpu")),
                            fused_params={"optimizer": "exact_sgd", "learning_rate": 0.1})
    ours.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        lengths = torch.randint(0, 3, (3 * 4,), generator=g) if step % 2 else torch.ones(3 * 4, dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], torch.randint(0, 20, (int(lengths.sum()),), generator=g), lengths)
        outs = []
        for m in (reference, ours):
            out = m(kjt)
            assert list(out) == ["f0", "f1", "f2"]
            sum((jt.values() * torch.arange(4.0)).sum() for jt in out.values()).backward()
            outs.append({k: (jt.values().detach(), jt.lengths()) for k, jt in out.items()})
        for k, (values, lengths) in outs[0].items():
            torch.testing.assert_close(outs[1][k][0], values, atol=1e-6, rtol=0)  # (N, D) rows, as TorchRec's
            assert torch.equal(outs[1][k][1], lengths)
    torch.testing.assert_close(ours.state_dict()["embeddings.a.weight"], reference.state_dict()["embeddings.a.weight"])


def _hetero_in_memory(plan=ht.TablePlan()) -> torch.nn.Module:
    return ht.shard_modules(_fused("dlrm", "rowwise_adagrad"), plan)


def test_the_ssd_tier_trains_a_torchrec_model_as_memory(tmp_path):
    from hetero.placement import StorageTier
    from hetero.storage import SsdConfig

    batches = _batches(count=20)
    # a cache of 96 rows under a store of 120: rows evicted and read back from the file
    ssd = ht.TablePlan(memory=StorageTier.SSD, ssd=SsdConfig(directory=tmp_path, cache_bytes=96 * (D + 1) * 4))
    model = _hetero_in_memory({"t0": ssd, "t1": ssd})
    placed = {n: ht.TablePlan.of(t) for n, t in model.sparse_arch.embedding_bag_collection.tables.items()}
    assert placed == {"t0": ssd, "t1": ssd, "t2": ht.TablePlan()}, placed  # (read back from the built tables)
    _trains_as(_hetero_in_memory(), model, batches)


def test_dynamic_tables_keyed_by_raw_ids_train_as_fixed_rows_when_every_key_fits():
    from hetero.dynamic import DynamicConfig, Keys, KeyMap

    keys = 40  # raw ids 0..39 spread over a 2**40 key space; capacity ROWS > keys
    spread = 1 << 40
    batches = _batches(count=20, keys=keys)
    raw = [(x, KeyedJaggedTensor.from_lengths_sync(FEATURES, kjt.values() * spread + 7, kjt.lengths()), y)
           for x, kjt, y in batches]
    dynamic = ht.shard_modules(_fused("dlrm", "rowwise_adagrad"),
                               ht.TablePlan(keys=Keys.DYNAMIC, dynamic=DynamicConfig(admit_after=1)))
    assert all(ht.TablePlan.of(t).keys is Keys.DYNAMIC for t in dynamic.sparse_arch.embedding_bag_collection.tables.values())
    reference = _hetero_in_memory()
    with torch.no_grad():  # the reference's row k starts as the dynamic table's key k * spread + 7 does
        for name, t in dynamic.sparse_arch.embedding_bag_collection.tables.items():
            init = KeyMap(name, ROWS, t.config.dynamic, t.init_seed).init_rows(
                (torch.arange(keys) * spread + 7).numpy(), D, t.config.init_std)
            reference.sparse_arch.embedding_bag_collection.tables[name].weight[:keys] = torch.from_numpy(init)
    before = _tables_of(reference)
    expected, got = _train(reference, batches), _train(dynamic, raw)
    assert max(abs(a - b) for a, b in zip(expected, got)) < 1e-5
    for name, t in dynamic.sparse_arch.embedding_bag_collection.tables.items():  # key k's row is the reference's row k
        rows = t.rows_of(torch.arange(keys) * spread + 7)
        want = reference.sparse_arch.embedding_bag_collection.tables[name].weight[:keys]
        torch.testing.assert_close(t.weight[rows], want, atol=1e-5, rtol=0)
        assert (want - before[f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"][:keys]).abs().max() > 1e-2


def test_hetero_rules_and_unsupported_settings():
    model = ht.shard_modules(_fused("dlrm", "sgd"),
                             ht.TablePlan(optimizer=ht.SparseRule(SparseOptimizerKind.LAZY_ADAM, LazyAdamConfig(lr=0.01))))
    opt = model.sparse_arch.embedding_bag_collection.fused_optimizer
    assert [type(o).__name__ for o in opt.optimizers.sparse.values()] == ["LazyAdam"]
    _train(model, _batches(count=2))
    assert all(s == 2 for o in opt.optimizers.sparse.values() for s in o.steps.values())
    with pytest.raises(ValueError, match="momentum=0.9 has no hetero counterpart"):
        torch.manual_seed(0)
        ebc = FusedEmbeddingBagCollection(tables=_tables(), optimizer_type=torch.optim.SGD,
                                          optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, device=torch.device("cpu"))
        ht.shard_modules(_model("dlrm", ebc))
    with pytest.raises(ValueError, match="has no sparse optimizer"):
        ht.shard_modules(_model("dlrm", TorchRecEBC(tables=_tables(), device=torch.device("cpu"))))
    with pytest.raises(ValueError, match="need_pos=True is not supported"):
        ht.shard_modules(TorchRecEBC(tables=[EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=8, need_pos=True)]),
                         fused_params={"optimizer": "exact_sgd"})
    from hetero.placement import StorageTier

    untouched = _fused("dlrm", "sgd")
    with pytest.raises(ValueError, match=r"tables \['t0'\] are planned into device memory"):
        ht.shard_modules(untouched, {"t0": ht.TablePlan(memory=StorageTier.DEVICE_MEMORY)})
    assert type(untouched.sparse_arch.embedding_bag_collection) is FusedEmbeddingBagCollection  # (refused: unchanged)
    unweighted = ht.shard_modules(_fused("dlrm", "sgd"))
    x, kjt, _ = _batches(count=1, weighted=True)[0]
    with pytest.raises(ValueError, match="not weighted but the KeyedJaggedTensor carries per-sample weights"):
        unweighted(x, kjt)


def test_a_collection_type_it_does_not_convert_is_refused_naming_it():
    class Custom(TorchRecEBC):
        pass

    torch.manual_seed(0)
    ebc = Custom(tables=_tables(), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="is a .*Custom, which hetero.torchrec does not convert yet"):
        ht.shard_modules(_model("dlrm", ebc), fused_params={"optimizer": "exact_sgd"})
