"""Tables moved to the device (a plan's choice): torch's lookups and sparse optimizers train a
table as the host engine and hetero's optimizers do, with the host table's errors."""

import pytest
import torch

from hetero.embedding import (
    DeviceEmbedding,
    HostEmbeddingCollection,
    Pooling,
    TableConfig,
    dense_parameters,
    host_tables,
    move_tables_to_device,
)
from hetero.optim import SparseOptimizerKind, device_sparse_optimizer

CONFIGS = [TableConfig("a", 50, 4, pooling=Pooling.SUM), TableConfig("b", 30, 4),
           TableConfig("c", 20, 4, pooling=Pooling.MEAN, hashed=True)]


def _features(g):
    return {"a": torch.randint(0, 50, (8, 3), generator=g), "b": torch.randint(0, 30, (8, 2), generator=g),
            "c": (torch.randint(-40, 40, (10,), generator=g), torch.tensor([0, 3, 3, 7, 10]))}  # an empty bag


@pytest.mark.parametrize("kind", [SparseOptimizerKind.LAZY_ADAM, SparseOptimizerKind.ADAGRAD, SparseOptimizerKind.SGD])
def test_device_tables_train_as_host_tables(kind):
    torch.manual_seed(1)
    host = HostEmbeddingCollection(CONFIGS)
    torch.manual_seed(1)
    mixed = HostEmbeddingCollection(CONFIGS)
    moved = move_tables_to_device(mixed, ["tables.a", "tables.c"], torch.device("cpu"))
    assert [type(t).__name__ for t in mixed.tables.values()] == ["DeviceEmbedding", "HostEmbedding", "DeviceEmbedding"]
    assert list(host_tables(mixed)) == ["tables.b"] and not list(dense_parameters(mixed))
    reference = [kind.optimizer(host_tables(host), kind.optimizer.Config())]
    optimizers = [kind.optimizer(host_tables(mixed), kind.optimizer.Config()),
                  device_sparse_optimizer(kind, [t.weight for t in moved.values()])]
    initial = {name: t.weight.detach().clone() for name, t in host.tables.items()}
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        features = _features(g)
        for model, opts in ((host, reference), (mixed, optimizers)):
            for o in opts:
                o.zero_grad()
            out = model(features)
            sum((v * torch.arange(v.numel()).reshape(v.shape)).sum() for v in out.values()).backward()
            for o in opts:
                o.step()
    for name in "abc":
        assert (host.tables[name].weight != initial[name]).any()  # trained
        torch.testing.assert_close(mixed.tables[name].weight.detach(), host.tables[name].weight, rtol=0, atol=1e-6)


def test_a_device_table_raises_as_a_host_table_does():
    collection = HostEmbeddingCollection(CONFIGS)
    move_tables_to_device(collection, ["tables.b"], torch.device("cpu"))
    table = collection.tables["b"]
    with pytest.raises(IndexError, match="table 'b': id 30 is out of range for vocab size 30"):
        table(torch.tensor([1, 30]))
    with pytest.raises(ValueError, match="ids must be int64 or int32"):
        table(torch.tensor([1.0]))
    with pytest.raises(KeyError, match="looks up feature 'b'"):
        collection({"a": torch.zeros(2, 3, dtype=torch.int64), "c": torch.zeros(2, 1, dtype=torch.int64)})
    with pytest.raises(ValueError, match="host tables are"):
        move_tables_to_device(collection, ["tables.z"], torch.device("cpu"))
    with pytest.raises(ValueError, match="keep it on the host"):
        DeviceEmbedding(TableConfig("h", 4, 2, dtype=torch.bfloat16), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="keep its tables on the host"):
        device_sparse_optimizer(SparseOptimizerKind.FTRL, [table.weight])
