"""TorchRec models on hetero's tables over several processes and the planner: 2 ranks row-sharded
and replicated, 2 parameter servers, a checkpoint resumed at another world size, and ``hetero.plan``
placing a converted model's tables - each against hetero in memory, one process
(:mod:`test_torchrec`'s models, batches and comparison)."""

from __future__ import annotations

import torch
import pytest
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import hetero.torchrec as ht
from hetero.optim import SparseOptimizerKind
from test_torchrec import B, FEATURES, _batches, _fused, _hetero_in_memory, _model, _tables, _tables_of, _train, _trains_as


def _samples(kjt: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    """Samples ``[lo, hi)`` of a batch's KJT (a rank's share)."""
    values, lengths = [], []
    for f in FEATURES:
        jt = kjt[f]
        off = jt.offsets()
        values.append(jt.values()[off[lo]:off[hi]])
        lengths.append(jt.lengths()[lo:hi])
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(values), torch.cat(lengths))


def _ranks_run(distribution: str):
    """A rank's share of every batch, the tables placed by ``distribution``, the dense part in DDP:
    the mean loss over the ranks each step, and the tables' whole rows."""
    from hetero.parallel import full_model_state
    from hetero.planner.space import TablePlacement

    model = ht.DistributedModelParallel(_fused("dlrm", "rowwise_adagrad"),
                                        plan=ht.TablePlan(distribution=TablePlacement(distribution)))
    dense = torch.optim.SGD([p for n_, p in model.named_parameters() if "embedding_bag" not in n_], lr=0.1)
    losses = _train_share(model, dense, _batches(count=12))
    tables = {k: v for k, v in full_model_state(model.module).items() if "embedding_bags" in k}
    return losses, tables


def _train_share(model, dense, batches) -> list[float]:
    """This rank's share of every batch trained; each step's loss averaged over the ranks."""
    from hetero.parallel import rank, world_size

    n, r = world_size(), rank()
    losses, share = [], B // n
    for x, kjt, y in batches:
        lo, hi = r * share, (r + 1) * share
        dense.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[lo:hi], _samples(kjt, lo, hi)).reshape(-1),
                                                                    y[lo:hi])
        loss.backward()
        dense.step()
        mean = loss.detach().clone()
        if n > 1:
            torch.distributed.all_reduce(mean)
        losses.append(mean.item() / n)
    return losses


@pytest.mark.parametrize("distribution", ["row_sharded", "replicated"])
def test_two_ranks_train_a_torchrec_model_as_one_process(tmp_path, distribution, cpu_ranks):
    from conftest import run_ranks

    expected_model = _hetero_in_memory()
    before = _tables_of(expected_model)
    expected = _train(expected_model, _batches(count=12))
    losses, tables = run_ranks(tmp_path, 2, _ranks_run, distribution)
    assert max(abs(a - b) for a, b in zip(expected, losses)) < 1e-5
    for k, v in _tables_of(expected_model).items():
        torch.testing.assert_close(tables[k], v, atol=1e-5, rtol=0)
        assert (v - before[k]).abs().max() > 1e-2


def _meta_model() -> torch.nn.Module:
    """TorchRec's DLRM whose collection is on ``meta``: hetero builds the rows from its seeds
    (TorchRec's initializer), as parameter servers do."""
    torch.manual_seed(0)
    return _model("dlrm", TorchRecEBC(tables=_tables(), device=torch.device("meta")))


ADAGRAD = {"optimizer": "exact_row_wise_adagrad", "learning_rate": 0.05, "eps": 1e-8}


def _servers_run():
    """2 parameter servers and 1 worker: the worker's losses (servers serve inside shard_modules)."""
    from hetero import ps
    from hetero.planner.space import TablePlacement

    job = ps.PSJob.init(ps.PSConfig(num_servers=2))
    model = ht.DistributedModelParallel(_meta_model(), plan=ht.TablePlan(distribution=TablePlacement.PARAMETER_SERVER),
                                        sharders=[_Sharder(ADAGRAD)], ps_job=job)
    losses = _train(model, _batches(count=12)) if job.role is ps.Role.WORKER else None
    job.shutdown()
    return losses


class _Sharder:  # (what DistributedModelParallel reads of a TorchRec sharder: its fused_params)
    def __init__(self, fused_params):
        self.fused_params = fused_params


def test_two_parameter_servers_train_a_torchrec_model_as_memory(tmp_path, cpu_ranks):
    from conftest import run_ranks

    expected = _train(ht.shard_modules(_meta_model(), fused_params=ADAGRAD), _batches(count=12))
    got = run_ranks(tmp_path, 3, _servers_run)  # (rank 0: the worker)
    assert max(abs(a - b) for a, b in zip(expected, got)) < 1e-5
    untrained = _train(ht.shard_modules(_meta_model(), fused_params={**ADAGRAD, "learning_rate": 0.0}), _batches(count=12))
    assert max(abs(a - b) for a, b in zip(expected, untrained)) > 1e-4  # (the servers' updates are seen: 9e-4)


def _checkpoint_run(path: str, save: bool):
    """Row-sharded over the ranks: 6 steps then a checkpoint (``save``), or a load of it and 6 steps more."""
    from hetero.parallel import load_distributed_checkpoint, save_distributed_checkpoint
    from hetero.planner.space import TablePlacement

    model = ht.DistributedModelParallel(_fused("dlrm", "rowwise_adagrad"),
                                        plan=ht.TablePlan(distribution=TablePlacement.ROW_SHARDED))
    sparse = model.named_sparse_optimizers()
    dense = torch.optim.SGD([p for n_, p in model.named_parameters() if "embedding_bag" not in n_], lr=0.1)
    batches = _batches(count=12)[:6] if save else _batches(count=12)[6:]
    if not save:
        load_distributed_checkpoint(model.module, path, sparse_optimizers=sparse, optimizer=dense)
    losses = _train_share(model, dense, batches)
    if save:
        save_distributed_checkpoint(model.module, path, sparse_optimizers=sparse, optimizer=dense)
    return losses


def test_a_checkpoint_of_2_row_sharded_ranks_resumes_in_1_process_as_one_uninterrupted_run(tmp_path, cpu_ranks):
    from conftest import run_ranks

    expected = _train(ht.shard_modules(_fused("dlrm", "rowwise_adagrad")), _batches(count=12))
    path = str(tmp_path / "ckpt")
    first = run_ranks(tmp_path, 2, _checkpoint_run, path, True)
    second = run_ranks(tmp_path, 1, _checkpoint_run, path, False)
    assert max(abs(a - b) for a, b in zip(expected, first + second)) < 1e-5


def test_hetero_plan_prices_a_torchrec_models_tables_and_its_choice_trains_as_memory(tmp_path, cache):
    """``hetero.plan`` on the converted model: under a host budget below its tables it puts some
    on the SSD tier; the plan's TablePlans, given to shard_modules, train as the tables in memory."""
    import hetero
    from hetero.placement import StorageTier
    from hetero.planner.config import PlannerConfig
    from hetero.storage import SsdConfig

    rows = 100_000  # 3 tables x 100k x 8 fp32 with row-wise Adagrad: 10.8 MB
    x, kjt, y = _batches(count=1, keys=rows)[0]
    loss = lambda out: torch.nn.functional.binary_cross_entropy_with_logits(out.reshape(-1), y)  # noqa: E731
    ssd = SsdConfig(tmp_path / "tier", cache_bytes=1 << 20)
    config = PlannerConfig(cache_dir=cache, device_tables=False, ssd=ssd)
    planned = ht.shard_modules(_fused("dlrm", "rowwise_adagrad", _tables(rows)))
    kinds = {"": SparseOptimizerKind.ROWWISE_ADAGRAD}
    roomy = hetero.plan(planned, (x, kjt), loss_fn=loss, sparse_optimizers=kinds, config=config)
    assert all(p.memory is StorageTier.HOST_DRAM for p in roomy.table_plans(planned).values())
    tight = hetero.plan(planned, (x, kjt), loss_fn=loss, sparse_optimizers=kinds, config=config,
                        host_memory=roomy.predicted.host_bytes - (4 << 20))
    placed = {q.rsplit(".", 1)[-1]: p for q, p in tight.table_plans(planned).items()}
    assert any(p.memory is StorageTier.SSD for p in placed.values()), tight
    batches = _batches(count=10, keys=rows)
    tiered = ht.shard_modules(_fused("dlrm", "rowwise_adagrad", _tables(rows)), placed)
    assert {n: ht.TablePlan.of(t) for n, t in tiered.sparse_arch.embedding_bag_collection.tables.items()} == placed
    _trains_as(ht.shard_modules(_fused("dlrm", "rowwise_adagrad", _tables(rows))), tiered, batches)
